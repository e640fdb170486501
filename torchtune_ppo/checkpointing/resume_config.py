"""The run's config saved in every checkpoint, and the check a resume makes against it.

A checkpoint's training state only means something under the config it was saved with: the
data position counts batches of ``batch_size``, the epoch permutation comes from ``seed`` and
``shuffle`` over ``dataset``, the LR scheduler counts optimizer steps of ``ppo_batch_size`` /
``ppo_epochs`` / ``gradient_accumulation_steps``, the optimizer state belongs to one optimizer
class and to the models the builders make. Those keys (:data:`MUST_MATCH`) must be the same on
resume, or the run stops before any weights load, except the data's paths (``dataset.data_files``,
a local ``dataset.source``) when the files now named hold the bytes the checkpoint recorded (its
data identity: each file's size and sha256): the data moved, which is said in a note. Every
other key takes the new value; a note lists the ones that changed. The optimizer's
hyperparameters (``optimizer.lr``,
``weight_decay``, ...) are applied to the restored optimizer's param groups after its state is
loaded (:func:`apply_optimizer_overrides`), since loading the state would put the old ones back.

Value pretraining's keys (``value_pretrain.*``) are read against the checkpoint's pretraining
state (:func:`value_pretrain_differences`): saved mid-pretraining, ``value_pretrain.lmbda`` must
match, since the saved loss record that the stopping rule reads holds losses against returns of
that lambda; ``max_steps``, ``tolerance`` and ``window`` may change (the whole record is saved,
and the rule is applied to it again with the new values, so pretraining may end at the resume).
Saved after pretraining ended, every ``value_pretrain`` key may change and none has an effect.

Not checked here: the number of processes. A checkpoint saved on W ranks resumes on any number
(the optimizer state is keyed by parameter name); the random states restart, with a warning,
when the count differs (see :class:`~torchtune_ppo.checkpointing.CheckpointClient`).
``forward_batch_size`` may change: it splits the same work differently, but the sampled
responses then differ from the uninterrupted run's (the draws are made per forward batch).
"""

import glob
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import utils

from torchtune_ppo.checkpointing.store import CONFIG_FNAME, TRAINING_STATE_FNAME
from torchtune_ppo.config.run_folder import saved_config
from torchtune_ppo.config.schema import MUST_MATCH, defaults

log = utils.get_logger("INFO")

# Never compared: where the run is, and the switch that says it is resuming.
IGNORED = ("output_dir", "resume_from_checkpoint")
_MISSING = "<not set>"


class ResumeConfigError(ValueError):
    """A resume's config differs from its checkpoint's in a key that must match."""


def config_to_save(cfg: Union[DictConfig, Mapping]) -> Dict[str, Any]:
    """The run's resolved config as a plain dict (interpolations fixed), for ``config.yaml``."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(d, Mapping):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _matches(key: str, patterns: Tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in patterns)


def config_differences(saved: Mapping, new: Mapping) -> Tuple[List[Tuple[str, Any, Any]], List[Tuple[str, Any, Any]]]:
    """``(must_match, may_change)``: lists of ``(key, saved value, new value)`` that differ."""
    a, b = _flatten(saved), _flatten(new)
    must, may = [], []
    for key in sorted(set(a) | set(b)):
        if _matches(key, IGNORED):
            continue
        old, cur = a.get(key, _MISSING), b.get(key, _MISSING)
        if _same(old, cur):
            continue
        (must if _matches(key, MUST_MATCH) else may).append((key, old, cur))
    return must, may


def check_resume_config(checkpoint: Union[str, Path], cfg: Union[DictConfig, Mapping]) -> List[str]:
    """Compares the resuming run's config with the checkpoint's; call before loading weights.

    Args:
        checkpoint (Union[str, Path]): the ``step_<N>`` folder the run resumes from.
        cfg (Union[DictConfig, Mapping]): the resuming run's config.

    Returns:
        List[str]: the keys that may change and did (each is logged with both values).

    Raises:
        ResumeConfigError: listing every differing key of :data:`MUST_MATCH` (and
            ``value_pretrain.lmbda`` when saved mid-pretraining) with the saved and the new
            value, and what to do.
    """
    saved = saved_config(checkpoint)
    if saved is None:
        log.warning(f"{checkpoint} has no saved {CONFIG_FNAME} (a checkpoint of an older format): "
                    "the config cannot be checked against it. Keep batch_size, seed, shuffle, "
                    "dataset and the models as they were, or the resumed run is not the same run.")
        return []
    new = config_to_save(cfg)
    # A key the saved config lacks did not exist yet when it was saved: the run had its default.
    saved = {**{k: v for k, v in defaults().items() if k not in saved and k in new}, **saved}
    must, may = config_differences(saved, new)
    must, gone, gone_keys = moved_data_differences(checkpoint, must, new)
    pretrain_must, may, why = value_pretrain_differences(checkpoint, may)
    must += pretrain_must
    if must:
        lines = "\n".join(f"  {k}: saved {old!r}, now {new!r}" for k, old, new in must)
        why += gone
        # a saved data path that no longer exists is no way on: it is explained instead
        fix = " ".join(cli_override(k, old) for k, old, _ in must if old is not _MISSING and k not in gone_keys)
        if fix:
            fix = f"Resume with the saved values, e.g. with these overrides on the command line:\n  {fix}\n"
        else:
            fix = "Resume over the saved data, " if gone else "Resume with the saved values (remove the new keys), "
        raise ResumeConfigError(
            f"Cannot resume from {checkpoint}: these keys differ from the config it was saved "
            f"with ({Path(checkpoint) / CONFIG_FNAME}), and the saved training state (data "
            f"position, random states, optimizer and LR schedule) only means something with the "
            f"saved values:\n{lines}\n{why}{fix}"
            "or start a fresh run in another output_dir (resume_from_checkpoint=False)."
        )
    if may:
        lines = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in may)
        log.info(f"Resuming with config changes from {checkpoint} (the new values apply): {lines}")
    return [k for k, _, _ in may]


def moved_data_differences(checkpoint: Union[str, Path], must: List[Tuple[str, Any, Any]], new: Mapping
                           ) -> Tuple[List[Tuple[str, Any, Any]], str, List[str]]:
    """Takes the data's paths (``dataset.data_files``, a local ``dataset.source``) out of ``must``
    when the files the new config names hold the data the checkpoint was trained on (the same
    size and sha256 as its recorded data identity, :func:`~torchtune_ppo.data.identity.moved_files`),
    with a note.

    Returns:
        Tuple[List[Tuple[str, Any, Any]], str, List[str]]: the differences that still must match;
        when a saved path among them no longer exists and the checkpoint recorded its data, a
        line that says so and what the data are, and those keys, whose saved value is no way on
        (else empty).
    """
    from torchtune_ppo.data.identity import moved_files

    # `source` is where the data are only when it is a local path (else the reader: json, csv, ...)
    moved = [d for d in must if _matches(d[0], ("dataset.data_files",))
             or (d[0] == "dataset.source" and isinstance(d[2], str) and Path(d[2]).exists())]
    if not moved:
        return must, "", []
    identity = saved_data_identity(checkpoint)
    block = new.get("dataset") if isinstance(new.get("dataset"), Mapping) else {}
    pairs = moved_files(identity, block) if identity else None
    if pairs is not None:
        log.info(f"Resuming over the data {checkpoint} was trained on at a new path (the same size and sha256 "
                 f"as it recorded): {'; '.join(f'{a} -> {b}' for a, b in pairs)}.")
        return [d for d in must if d not in moved], "", []
    recorded = (identity or {}).get("files") or []
    gone = {k: [p for p in _strings(old) if not Path(p).exists() and not glob.glob(p, recursive=True)]
            for k, old, _ in moved}
    gone = {k: paths for k, paths in gone.items() if paths}
    if not gone or not recorded:  # without a recorded identity, what the data were is unknown
        return must, "", []
    recorded = "; ".join(f"{Path(f['path']).name}: {f['size']} bytes, sha256 {f['sha256'][:12]}..." for f in recorded)
    paths = ", ".join(repr(p) for ps in gone.values() for p in ps)
    return must, (f"The saved data path {paths} no longer exists, and the path now given does not hold the "
                  f"data the checkpoint was trained on ({recorded}); a path that holds them, moved or copied "
                  "unchanged, is accepted by their sha256.\n"), list(gone)


def saved_data_identity(checkpoint: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """The data identity the checkpoint recorded (:mod:`torchtune_ppo.data.identity`), read
    without loading the rest of its training state; None when it recorded none."""
    path = Path(checkpoint) / TRAINING_STATE_FNAME
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    identity = state.get("data_identity")
    return dict(identity) if isinstance(identity, Mapping) else None


def _strings(value: Any) -> List[str]:
    """The strings in a config value (a path, a list or a mapping of them)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    return [s for v in value for s in _strings(v)] if isinstance(value, (list, tuple)) else []


def saved_value_pretrain(checkpoint: Union[str, Path]) -> Dict[str, Any]:
    """The checkpoint's value pretraining state (``steps_run``, ``losses``, ``done``), read
    without loading the rest of the training state into memory; a checkpoint from before value
    pretraining existed: done when PPO had begun."""
    state = torch.load(Path(checkpoint) / TRAINING_STATE_FNAME, map_location="cpu", mmap=True, weights_only=True)
    saved = state.get("value_pretrain")
    if saved is None:
        return {"steps_run": 0, "losses": [], "done": state.get("steps_run", 0) > 0}
    return dict(saved)


def value_pretrain_differences(checkpoint: Union[str, Path], may: List[Tuple[str, Any, Any]]
                               ) -> Tuple[List[Tuple[str, Any, Any]], List[Tuple[str, Any, Any]], str]:
    """Splits the ``value_pretrain.*`` keys out of ``may`` by the checkpoint's pretraining state
    (see the module's docstring): ``(must_match, may_change, why)``, ``why`` the reason for
    ``must_match`` (a line, or empty). Logs what the changed keys that may change do."""
    changed = [d for d in may if d[0].startswith("value_pretrain.")]
    if not changed:
        return [], may, ""
    state = saved_value_pretrain(checkpoint)
    names = ", ".join(k for k, _, _ in changed)
    if state["done"]:
        log.info(f"{names} changed, with no effect: value pretraining of the run in {checkpoint} is over "
                 "(it runs only before PPO's first step).")
        return [], may, ""
    must = [d for d in changed if d[0] == "value_pretrain.lmbda"]
    why = (f"It was saved after {state['steps_run']} of value pretraining's steps: the loss record that "
           "pretraining's stopping rule reads holds value losses against returns of the saved "
           "value_pretrain.lmbda.\n") if must else ""
    rest = [d for d in changed if d not in must]
    if rest:
        log.info(f"{checkpoint} was saved after {state['steps_run']} of value pretraining's steps: "
                 f"{', '.join(k for k, _, _ in rest)} apply from now, to the saved record of "
                 f"{len(state['losses'])} value losses (pretraining ends at once if it now meets the rule).")
    return must, [d for d in may if d not in must], why


def _param_groups(optimizer: Any) -> List[Tuple[int, Dict[str, Any]]]:
    # InBackwardOptimizer: one optimizer per parameter, all of them to update.
    wrappers = getattr(optimizer, "_wrappers", None)
    if wrappers:
        return [(i, g) for w in wrappers.values() for opt in w.optim_map.values()
                for i, g in enumerate(opt.param_groups)]
    return list(enumerate(optimizer.param_groups))


# A string that reads back as itself unquoted: a name, a dotted path, a file path (checked by
# parsing it as well: `true`, `null`, `1e-5` are not strings there). None of YAML's flow
# indicators, so it stays one item inside a list too.
_PLAIN = re.compile(r"[A-Za-z_/.~][A-Za-z0-9_/.~+-]*")


def _override_value(value: Any) -> str:
    """``value`` as the value of a ``key=value`` override that torchtune's command line reads back
    as ``value``: it parses overrides with ``OmegaConf.from_dotlist``, i.e. as YAML, so lists are
    flow sequences (``[a, b]``), mappings flow mappings, and strings are double-quoted unless they
    read back as themselves."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_override_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_override_value(str(k))}: {_override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    # torchtune turns the override value `None` into null.
    if _PLAIN.fullmatch(text) and text != "None" and OmegaConf.from_dotlist([f"v={text}"]).v == text:
        return text
    # "${" would be an interpolation to OmegaConf: escaped, it stays text.
    return json.dumps(text.replace("${", "\\${"), ensure_ascii=False)


def cli_override(key: str, value: Any) -> str:
    """``key=value`` as an override for torchtune's command line, quoted for a POSIX shell: what
    is printed can be pasted as it is, and the shell and torchtune's parser (OmegaConf's
    dotlist) give back ``value``, lists and mappings included."""
    return shlex.quote(f"{key}={_override_value(value)}")


def apply_optimizer_overrides(optimizer: Any, cfg_optimizer: Union[DictConfig, Mapping],
                              lr_scheduler: Optional[Any] = None) -> Dict[str, Tuple[Any, Any]]:
    """Puts the config's optimizer hyperparameters into a restored optimizer's param groups.

    ``optimizer.load_state_dict`` restores the saved param groups, hyperparameters included, so
    a resume with ``optimizer.lr=1e-5`` would otherwise train at the saved lr. With an LR
    scheduler, ``lr`` sets its base lr and the current lr is scaled by the same ratio, so the
    schedule's position is kept.

    Args:
        optimizer (Any): has ``param_groups`` (restored).
        cfg_optimizer (Union[DictConfig, Mapping]): the ``optimizer`` config block.
        lr_scheduler (Optional[Any]): a torch LR scheduler with ``base_lrs``, restored.

    Returns:
        Dict[str, Tuple[Any, Any]]: ``{key: (restored value, new value)}`` of what changed.
    """
    block = config_to_save(cfg_optimizer)
    changed = {}
    for key, value in block.items():
        if key.startswith("_"):
            continue
        for i, group in _param_groups(optimizer):
            if key not in group:
                continue
            old = group[key]
            new = tuple(value) if isinstance(old, tuple) and isinstance(value, (list, tuple)) else value
            if key == "lr" and lr_scheduler is not None and group.get("initial_lr"):
                base, new = group["initial_lr"], float(new)
                if not _same(base, new):  # untouched when equal: a resume stays bit-exact
                    group["lr"], group["initial_lr"] = old * new / base, new
                    if i < len(getattr(lr_scheduler, "base_lrs", [])):
                        lr_scheduler.base_lrs[i] = new
                    changed[key] = (base, new)
                continue
            if not _same(old, new):
                changed[key] = (old, new)
                group[key] = float(new) if key == "lr" else new
    if changed:
        log.info("Optimizer settings from the config replace the checkpoint's: "
                 + ", ".join(f"optimizer.{k}: {a} -> {b}" for k, (a, b) in changed.items()))
    return changed
