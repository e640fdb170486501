"""Validation of the recipe config, done in one place before any model is loaded.

A PPO run spends minutes loading four models and compiling before its first step, and a bad
value can surface hundreds of steps later (or never, as a silently different run). Everything
that can be checked without weights is checked by this package, in this order by the recipe:

1. ``check_cli_overrides(sys.argv[1:])`` and ``validate_config(cfg)``: keys, then each value
   against its kind in ``schema.SCHEMA``, each component block's keys against its callable's
   arguments (``components.py``), then the rules between keys, the device, checkpoint files,
   and the models' settings read from a build on the meta device.
2. ``validate_with_tokenizer(cfg, tokenizer)`` (``generation``): right after the tokenizer is
   instantiated.
3. ``instantiate_dataset(cfg.dataset, tokenizer)`` then ``validate_dataset(dataset, cfg)``
   (``data_files``): before any weights are read.

This module reads the config as a whole (its keys, torchtune's keys mapped onto ours, the
defaults, the ``loss`` block) and calls the rules between keys, which live by subject:
``batches`` (sizes, processes, shared prompts), ``weights`` (the models built and their
checkpoints, LoRA, lengths and vocabularies), ``generation`` (sampling, responses, the
tokenizer), ``training`` (optimizer, PPO-family options, evaluation) and ``machine`` (device,
CPU threads).

Every error names the key (dotted, e.g. ``loss.epsilon``), quotes the value and says what
would be valid.
"""

import dataclasses
import inspect
from typing import Any, Dict, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from torchtune_ppo.config.batches import check_batch_sizes
from torchtune_ppo.config.components import check_component_arguments, import_component
from torchtune_ppo.config.generation import check_min_response_length, check_no_eos_penalty
from torchtune_ppo.config.machine import check_device
from torchtune_ppo.config.notes import note
from torchtune_ppo.config.precision import resolve_auto_dtype
from torchtune_ppo.config.schema import (
    COMPILE_REGIONS,
    EVAL_KEYS,
    Component,
    KEYS,
    LOSS_KEYS,
    NOTED_KEYS,
    SCHEMA,
    ROLLOUT_CORRECTION_KEYS,
    SPECULATIVE_KEYS,
    VALUE_PRETRAIN_KEYS,
    _is_int,
    _show,
    defaults,
    parse_compile,
)
from torchtune_ppo.config.training import (check_algorithms, check_checkpoint_format, check_eval, check_optimizer_in_bwd,
                                          check_optimizer_lr)
from torchtune_ppo.config.weights import check_advantage_estimator, check_checkpoint_files, check_models, check_reward


VALID_KEYS = tuple(KEYS) + tuple(k.torchtune_key for k in SCHEMA if k.torchtune_key)


def check_cli_overrides(args: Sequence[str]) -> None:
    """Refuse command-line overrides that OmegaConf would merge into something else.

    ``compile=True compile.generate=False`` becomes ``{compile: {generate: False}}``: the
    bool is dropped. Merged over a YAML that has a full compile block, the regions not named
    keep the YAML's values, so "everything but generation" silently runs what the YAML says.
    The same holds for any key given both a bare true/false/null and dotted sub-keys. A
    ``+key=value`` (Hydra's syntax for adding a key) is refused too: OmegaConf would read a key
    named ``+key``.

    Args:
        args (Sequence[str]): the command line after the program name (``sys.argv[1:]``);
            items that are not ``key=value`` are ignored.

    Raises:
        ValueError: naming both overrides and what to write instead; or the ``+key`` and the
            ``key=value`` to write.
    """
    for arg in args:
        if arg.startswith("+") and "=" in arg:  # Hydra's syntax for adding a key
            raise ValueError(plus_override(arg.split("=", 1)[0]))
    bare: Dict[str, str] = {}
    dotted: Dict[str, Dict[str, str]] = {}
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "~")):
            continue
        key, value = arg.split("=", 1)
        if "." in key:
            head, sub = key.split(".", 1)
            dotted.setdefault(head, {})[sub] = value
        else:
            bare[key] = value
    for key, value in bare.items():
        if key not in dotted or value.lower() not in ("true", "false", "null", "none"):
            continue
        subs = dotted[key]
        given = " ".join(f"{key}.{k}={v}" for k, v in subs.items())
        hint = ""
        if key == "compile" and value.lower() in ("true", "false"):
            on = value.lower() == "true"
            full = {k: subs.get(k, str(on and k != "rollout")) for k in COMPILE_REGIONS}
            full.update({k: v for k, v in subs.items() if k not in full})
            hint = " Write every region instead: " + " ".join(
                f"compile.{k}={v}" for k, v in full.items()
            ) + "."
        raise ValueError(
            f"{key}={value} and {given} on one command line: OmegaConf keeps only the "
            f"{key}.* overrides and drops {key}={value}, so the keys not named keep the YAML's "
            f"values instead of following {key}={value}.{hint}"
        )


def plus_override(key: str) -> str:
    """What to say of a ``+key`` override, whose ``+`` OmegaConf keeps in the key's name."""
    plain = key.lstrip("+")
    head = plain.split(".")[0]
    valid = (f"write {plain}=<value>: every key of the config is set that way, whether the YAML has it or not"
             if head in VALID_KEYS else f"and {head!r} is not a config key either (valid keys: {sorted(VALID_KEYS)})")
    return f"{key}: torchtune's command line takes key=value, with no '+' (Hydra's syntax for adding a key); {valid}."


def with_defaults(cfg: DictConfig) -> DictConfig:
    """Fill optional keys with their schema defaults (a copy; the user's config is left as given).

    Args:
        cfg (DictConfig): the recipe config.

    Returns:
        DictConfig: a merged copy.
    """
    values = defaults()
    loss = cfg.get("loss")
    if isinstance(loss, (DictConfig, dict)) and "_component_" in loss:
        # torchtune's PPOLoss defaults epsilon to 0.1; merging our plain defaults into its
        # block would change what a torchtune config that leaves a key out means.
        del values["loss"]
    return OmegaConf.merge(OmegaConf.create(values), cfg)


def validate_config(cfg: DictConfig, *, check_machine: bool = True) -> DictConfig:
    """Check a recipe config and return it with defaults filled in.

    Every check runs before any weights are read: the models are built on the meta device to
    read their ``max_seq_len`` and vocabulary size.

    Args:
        cfg (DictConfig): the recipe config as parsed from YAML and the command line.
        check_machine (bool): also check that the checkpoint files exist and the device is
            available here, and decide ``dtype: auto`` from this machine (and, resuming, from the
            saved config); off to plan a run for another machine (``torchtune_ppo.run.memory``),
            where ``auto`` is bf16 on cuda and fp32 elsewhere (``config.precision``).

    Returns:
        DictConfig: a copy with every optional key of ``schema.SCHEMA`` set, and ``dtype``
        fp32 or bf16 (never ``auto``).

    Raises:
        ValueError: on a missing, unknown, mistyped, out-of-range or inconsistent key.
        FileNotFoundError: when a checkpoint file named in a checkpointer does not exist.
    """
    # A key with a torchtune stand-in (num_ppo_steps: num_steps) is checked by the mapping.
    missing = [k.name for k in SCHEMA if k.required and not k.torchtune_key and k.name not in cfg]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}.")
    cfg = _map_torchtune_keys(cfg)
    unknown = sorted(set(cfg.keys()) - set(VALID_KEYS))
    plus = [k for k in unknown if isinstance(k, str) and k.startswith("+")]
    if plus:  # `+eval.every_n_steps=2` arrives as {"+eval": {"every_n_steps": 2}}
        key, node = plus[0], cfg[plus[0]]
        while isinstance(node, DictConfig) and len(node) == 1:
            sub = next(iter(node))
            key, node = f"{key}.{sub}", node[sub]
        raise ValueError(plus_override(key))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys are {sorted(VALID_KEYS)}.")
    cfg = with_defaults(cfg)
    _null_components(cfg)
    cfg.loss = _loss_with_defaults(cfg.loss)
    _check_block_keys(cfg, "value_pretrain", VALUE_PRETRAIN_KEYS)
    _check_block_keys(cfg, "rollout_correction", ROLLOUT_CORRECTION_KEYS)
    _check_block_keys(cfg, "speculative", SPECULATIVE_KEYS)
    _check_block_keys(cfg, "eval", EVAL_KEYS)

    for key in SCHEMA:
        key.kind.check(key.name, cfg[key.name])
    _resolve_dtype(cfg, check_machine)  # before any check that reads cfg.dtype
    # a typo inside a block (optimizer.lrr), before anything is built; a package missing here, for a run here
    check_component_arguments(cfg, installed_only=check_machine)
    # Read once here: a bare compile: true|false becomes the mapping of every region, so the
    # rest of the run reads cfg.compile.<region>.
    cfg.compile = dataclasses.asdict(parse_compile(cfg.compile))
    check_optimizer_in_bwd(cfg)
    check_checkpoint_format(cfg)
    check_batch_sizes(cfg)
    check_min_response_length(cfg)
    check_no_eos_penalty(cfg)
    check_optimizer_lr(cfg)
    check_reward(cfg)
    check_advantage_estimator(cfg)  # first: a critic-free run refuses the critic's keys by name
    check_algorithms(cfg)
    check_eval(cfg)
    if check_machine:
        check_device(cfg.device)
        check_checkpoint_files(cfg)
    check_models(cfg)
    return cfg


def _null_components(cfg: DictConfig) -> None:
    """A block that may be null and whose ``_component_`` is null is read as null: on tune's
    command line ``reward=null`` sets ``reward._component_`` (torchtune's shorthand for a block's
    component), and ``~reward`` cannot remove a block that has one; each such block is noted."""
    for key in SCHEMA:
        block = cfg.get(key.name)
        if (isinstance(key.kind, Component) and key.kind.optional and isinstance(block, DictConfig)
                and "_component_" in block and block["_component_"] is None):
            cfg[key.name] = None
            note(f"{key.name}._component_ is null: read as `{key.name}: null` (on tune's command line "
                 f"`{key.name}=null` sets the block's _component_)")


def _resolve_dtype(cfg: DictConfig, check_machine: bool) -> None:
    """``dtype: auto`` becomes fp32 or bf16 here, once, with a note that says why
    (:func:`~torchtune_ppo.config.precision.resolve_auto_dtype`); the rest of the run, and the
    config saved in each checkpoint, see only the concrete dtype."""
    if cfg.dtype != "auto":
        return
    cfg.dtype, why = resolve_auto_dtype(
        cfg.device, output_dir=cfg.output_dir, resume=cfg.resume_from_checkpoint, check_machine=check_machine)
    note(why)


def _check_block_keys(cfg: DictConfig, key: str, valid: Sequence[str]) -> None:
    block = cfg[key]
    if isinstance(block, DictConfig):
        unknown = sorted(set(block.keys()) - set(valid))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; valid keys are {list(valid)}.")


def _map_torchtune_keys(cfg: DictConfig) -> DictConfig:
    """A copy with torchtune 0.6.1 PPO config keys mapped onto ours, each mapping noted once."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, meaning in NOTED_KEYS.items():
        if key in cfg:
            note(f"{key}: {meaning}")
            del cfg[key]
    if "num_steps" in cfg and cfg.get("num_ppo_steps") is not None:
        raise ValueError(
            f"num_steps ({_show(cfg.num_steps)}) and num_ppo_steps ({_show(cfg.num_ppo_steps)}) "
            "are both set; give one: num_ppo_steps counts PPO steps, num_steps counts prompts "
            "as in torchtune's recipe (num_steps // batch_size PPO steps)."
        )
    if "num_steps" in cfg:
        num_steps, batch_size = cfg.num_steps, cfg.batch_size
        if not (_is_int(num_steps) and _is_int(batch_size) and batch_size >= 1):
            raise ValueError(
                f"num_steps must be an integer count of prompts (as in torchtune's recipe), got "
                f"{_show(num_steps)} with batch_size {_show(batch_size)}."
            )
        if num_steps < batch_size:
            raise ValueError(
                f"num_steps counts prompts, as in torchtune's recipe: num_steps={num_steps} is "
                f"fewer than batch_size={batch_size}, so no PPO step would run. Raise num_steps, "
                "or give num_ppo_steps (PPO steps) instead."
            )
        dropped = f"; the last {num_steps % batch_size} prompts are not used" if num_steps % batch_size else ""
        note(f"num_steps={num_steps} counts prompts, as in torchtune's recipe: "
             f"{num_steps // batch_size} PPO steps of batch_size={batch_size}{dropped}.")
        cfg.num_ppo_steps = num_steps // batch_size
        del cfg["num_steps"]
    elif cfg.get("num_ppo_steps") is None:
        raise ValueError(
            "config is missing num_ppo_steps (PPO steps to run), or num_steps (prompts, as in "
            "torchtune's recipe)."
        )
    return cfg


def _loss_with_defaults(loss: Any) -> Any:
    """``loss`` with a ``_component_``'s own defaults written out and unknown keys refused.

    Written out so that the numbers the schema checks are the ones the run uses; the block is
    checked without instantiating it. Anything but a mapping is left to the schema's check.
    """
    if not isinstance(loss, DictConfig):
        return loss
    keys = set(loss.keys())
    if "_component_" not in loss:
        unknown = sorted(keys - set(LOSS_KEYS))
        if unknown:
            raise ValueError(
                f"loss: unknown key(s) {unknown}; valid keys are {list(LOSS_KEYS)}, or give a "
                "`_component_: torchtune.rlhf.loss.PPOLoss` block."
            )
        return loss
    path = loss._component_
    params = _signature_defaults(path, "loss._component_")
    if params is None:
        return loss
    unknown = sorted(keys - {"_component_"} - set(params))
    if unknown:
        raise ValueError(f"loss: unknown key(s) {unknown} for {path}; its arguments are {list(params)}.")
    for key in LOSS_KEYS:
        default = params.get(key, inspect.Parameter.empty)
        if key not in loss and default is not inspect.Parameter.empty:
            loss[key] = default
    return loss


def _signature_defaults(path: Any, key: str) -> Optional[Dict[str, Any]]:
    """Arguments of a ``_component_`` and their defaults; None if it takes ``**kwargs``."""
    component = import_component(path, key)
    try:
        params = inspect.signature(component).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {
        name: p.default
        for name, p in params.items()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
    }
