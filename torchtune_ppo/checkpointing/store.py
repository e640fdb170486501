"""Atomic, resumable checkpoints of a PPO run.

One folder per saved step, written under a temporary name and renamed into place only when
everything in it is on disk, so a crash at any moment leaves either a complete checkpoint or
an ignored temporary folder::

    <output_dir>/checkpoints/
        step_<N>/
            policy/              Hugging Face format, written by torchtune's FullModelHFCheckpointer;
                                 for a LoRA policy its adapters in PEFT's layout
                                 (adapter_model.safetensors, adapter_config.json; adapter_model.pt
                                 in torchtune's names, read on resume), and the merged weights
                                 only where the recipe asks (the run's last save); a LoRA
                                 value model's head beside them (head.safetensors)
            value/               same, for the value model (model_type of its checkpointer, e.g. REWARD);
                                 absent for a critic-free run
            training_state.pt    the dict the recipe passes: optimizer, counters, data position, RNG
            config.yaml          the run's resolved config (checked on resume: resume_config.py)
            COMPLETE             JSON marker written last: step, every file with its size and
                                 sha256, time; a resume verifies the checksums
            evaluation.json      the evaluations' record after this step's own evaluation, which
                                 runs after the checkpoint is written (so that a failure or a kill
                                 in it never costs the step): written later, atomically, outside
                                 COMPLETE; it replaces the record in training_state.pt when read
                                 (:func:`load_training_state`). Absent: that evaluation never
                                 finished, and a resume runs it again
        step_<N>/ (sharded)      checkpoint_format: sharded: shards/ (every rank's own shards of the
                                 weights, optimizer state and fp32 masters, torch.distributed.checkpoint),
                                 training_state.pt, config.yaml, COMPLETE, evaluation.json as above
                                 (:mod:`.sharded`; ``tune-ppo export`` turns it into HF folders)
        .tmp_step_<N>_<pid>/     a save in progress, or left by a crash: never read, cleaned later
        step_<N>.damaged-<time>/ a step folder a resume found damaged or incomplete, set aside
                                 (renamed, never deleted) so that the run can save step N again
    <output_dir>/.run.lock       held by the run writing the folder (rank 0): a second run there is refused

The weights go through torchtune's own HF writer (model_type conversions, config.json copy,
sharding as in the source checkpoint); a fresh writer is instantiated per save from the same
config block with ``output_dir`` pointing into the temporary folder.

Typical use in a recipe (rank 0 saves; state dicts are full, unsharded)::

    if not resuming and existing_checkpoints(cfg.output_dir):
        raise RuntimeError(...)
    ckpt = latest_checkpoint(cfg.output_dir) if resuming else None
    overrides = checkpointer_overrides(ckpt) if ckpt else {"policy": {}, "value": {}}
    policy_checkpointer = config.instantiate(cfg.checkpointer, **overrides["policy"])
    ...
    manager = CheckpointManager(cfg.output_dir, cfg.checkpointer, cfg.value_checkpointer, keep_last_n=3)
    manager.save(step, policy_sd, value_sd, {"optimizer": opt.state_dict(), "step": step,
                                             "rng": capture_rng_state([sampling_generator])})
"""

import datetime
import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils

from torchtune_ppo._patches.checkpointer import set_weight_map
from torchtune_ppo.config.components import import_component
# checkpoints/ and each step's config.yaml: named below this package, read at validation too
from torchtune_ppo.config.run_folder import CHECKPOINTS_DIRNAME, CONFIG_FNAME  # noqa: F401
from torchtune_ppo.config.run_folder import STEP_RE as _STEP_RE

log = utils.get_logger("INFO")

MARKER_FNAME = "COMPLETE"
TRAINING_STATE_FNAME = "training_state.pt"
EVALUATION_FNAME = "evaluation.json"
MODEL_NAMES = ("policy", "value")
LOCK_FNAME = ".run.lock"
SOURCE_MANIFEST_FNAME = "manifest.json"  # tools/prepare_smollm2.py's list of its folder's checksums
# Files of a saved model folder that nothing in a resume reads, and that users edit (PEFT wants
# base_model_name_or_path in adapter_config.json; generation settings; tokenizer files; notes):
# changed since the save, they are named in a warning, and the weights stay usable.
_EDITABLE_RE = re.compile(
    r"^(policy|value)/(adapter_config\.json|generation_config\.json|tokenizer[^/]*|special_tokens_map\.json"
    r"|[^/]*\.(md|txt))$")
_TMP_PREFIX = ".tmp_"
_TMP_PID_RE = re.compile(r"^\.tmp_.*_(\d+)$")
# Weight files torchtune's HF writer produces: model-00001-of-00003.safetensors (or .bin).
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.(safetensors|bin)$")
# Adapter files torchtune's HF writer produces (PEFT layout, and torchtune's names in the .pt).
_ADAPTER_RE = re.compile(r"^(adapter_(model|config)\.(safetensors|bin|pt|json)|head\.safetensors)$")
ADAPTER_PT_FNAME = "adapter_model.pt"
# A LoRA value model's head, trained whole beside its adapters, in torchtune's names.
HEAD_FNAME = "head.safetensors"
SHARDS_DIRNAME = "shards"  # a sharded checkpoint's DCP folder (checkpointing.sharded)
_MAX_NAMES = 5  # parameter names listed in a non-finite error

# Test hook: when TORCHTUNE_PPO_CRASH_DURING_SAVE names a point of `CheckpointManager.save`
# (after_policy, after_value, after_training_state, before_rename; a sharded save's after_shards:
# every rank's shards written, nothing else; ``<point>:<step>``: only in the
# save of that step), the process SIGKILLs itself there, so tests can check that a crash mid-save
# never leaves a checkpoint that looks complete.
_CRASH_ENV = "TORCHTUNE_PPO_CRASH_DURING_SAVE"
# Test hook: when set (to anything), writing training_state.pt fails as on a full disk
# (OSError ENOSPC), as a real full disk would.
_FULL_DISK_ENV = "TORCHTUNE_PPO_FULL_DISK_DURING_SAVE"
_HASH_CHUNK = 1 << 22


class NonFiniteWeightsError(ValueError):
    """A state dict about to be saved holds NaN or Inf values."""


class CheckpointExistsError(FileExistsError):
    """A complete checkpoint of this step is already on disk."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (full disk, permissions, I/O error); nothing of it is left."""


class DamagedCheckpointError(ValueError):
    """A checkpoint's file does not match its COMPLETE marker, or cannot be read."""


# ----------------------------------------------------------------------------- saving


class CheckpointManager:
    """Writes ``<output_dir>/checkpoints/step_<N>`` atomically and prunes old ones.

    Args:
        output_dir (Union[str, Path]): the run's output folder.
        policy_checkpointer (Union[DictConfig, Mapping]): config block of the policy's
            ``FullModelHFCheckpointer`` (``cfg.checkpointer``): its ``checkpoint_dir`` supplies
            config.json and the shard layout, its ``model_type`` the weight conversion.
        value_checkpointer (Optional[Union[DictConfig, Mapping]]): same for the value model
            (``cfg.value_checkpointer``); None for a run without one (a critic-free estimator).
        keep_last_n (Optional[int]): keep only the newest ``n`` complete checkpoints; older ones
            are deleted after a save completes. ``None`` keeps all. A checkpoint that a
            checkpointer above loads from (``checkpoint_dir`` inside it) is never deleted.

    Raises:
        TypeError: a checkpointer block is not a ``FullModelHFCheckpointer``.
        ValueError: ``keep_last_n`` is not ``None`` or a positive int.
        FileNotFoundError: a checkpointer's config.json or checkpoint files are missing.
    """

    def __init__(
        self,
        output_dir: Union[str, Path],
        policy_checkpointer: Union[DictConfig, Mapping],
        value_checkpointer: Optional[Union[DictConfig, Mapping]],
        *,
        keep_last_n: Optional[int] = None,
    ) -> None:
        if keep_last_n is not None and (not isinstance(keep_last_n, int) or keep_last_n < 1):
            raise ValueError(f"keep_last_n must be None or a positive int, got {keep_last_n!r}")
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / CHECKPOINTS_DIRNAME
        self.keep_last_n = keep_last_n
        self.kept_step: Optional[int] = None  # a step pruning never deletes (see keep_step)
        # Resolved, detached copies: interpolations like ${output_dir} are fixed now, and the
        # output_dir override at save time does not touch the recipe's config.
        self._writer_cfgs = {
            name: _resolved_block(block, name)
            for name, block in zip(MODEL_NAMES, (policy_checkpointer, value_checkpointer))
            if block is not None
        }
        # Fail at setup, not hours later at the first save.
        self._weight_maps = {name: _weight_map(c) for name, c in self._writer_cfgs.items()}

    def save(
        self,
        step: int,
        policy_state_dict: Mapping[str, torch.Tensor],
        value_state_dict: Optional[Mapping[str, torch.Tensor]],
        training_state: Dict[str, Any],
        run_config: Optional[Mapping[str, Any]] = None,
        adapters: Optional[Mapping[str, Tuple[Mapping[str, torch.Tensor], Mapping[str, Any],
                                              Mapping[str, torch.Tensor]]]] = None,
    ) -> Path:
        """Write one complete checkpoint of ``step``, then prune older ones.

        Nothing named ``step_<step>`` exists until every file is written and fsynced; on any
        error the temporary folder is removed and the error re-raised.

        Args:
            step (int): the PPO step just finished; names the folder ``step_<step>``.
            policy_state_dict (Mapping[str, torch.Tensor]): full policy state dict in torchtune
                format (e.g. ``{k: v.detach().cpu() for k, v in model.state_dict().items()}``).
            value_state_dict (Optional[Mapping[str, torch.Tensor]]): full value model state
                dict; None when the manager has no value checkpointer.
            training_state (Dict[str, Any]): everything else needed to resume, saved with
                ``torch.save`` as given (optimizer state, counters, data position, RNG states
                from :func:`capture_rng_state`).
            run_config (Optional[Mapping[str, Any]]): the run's resolved config, written to
                ``config.yaml`` (checked on resume by :mod:`.resume_config`).
            adapters (Optional[Mapping]): for a LoRA model, by name (``policy``, ``value``): its
                adapter state dict in torchtune's names, the adapter config
                (:func:`torchtune_ppo.lora.peft_adapter_config`), both written in PEFT's layout,
                and the parameters trained whole beside them (a value head; may be empty). Its
                state dict above may then be None (adapters only) or the merged weights.

        Returns:
            Path: the completed ``<output_dir>/checkpoints/step_<step>``.

        Raises:
            CheckpointExistsError: ``step_<step>`` is already complete on disk.
            NonFiniteWeightsError: a floating tensor of either state dict holds NaN/Inf; nothing
                is written.
            CheckpointWriteError: a write failed (e.g. no space left on device): it names the
                folder and the OS error; the partial folder is removed, earlier ones are kept.
        """
        step = int(step)
        final = self.root / f"step_{step}"
        adapters = dict(adapters or {})
        has_value = value_state_dict is not None or "value" in adapters
        if has_value != ("value" in self._writer_cfgs):
            raise ValueError("CheckpointManager.save: a value state dict (or value adapters) goes with a value checkpointer, "
                             f"got {'one' if has_value else 'none'} and "
                             f"{'one' if 'value' in self._writer_cfgs else 'none'}.")
        weights = {"policy": policy_state_dict, "value": value_state_dict}
        if policy_state_dict is None and "policy" not in adapters:
            raise ValueError("save: no policy weights and no policy adapters to write.")
        weights = {name: sd for name, sd in weights.items() if sd is not None or name in adapters}
        _check_finite({**{k: v for k, v in weights.items() if v is not None},
                       **{f"{k} adapters": {**v[0], **v[2]} for k, v in adapters.items()}})

        tmp = self.prepare(step)
        try:
            for name, sd in weights.items():
                self._write_hf(name, sd, step, tmp, adapters.get(name))
                _maybe_crash(f"after_{name}")
        except BaseException as e:
            error = self._abandon(e, tmp, final)
            if error is e:
                raise
            raise error from e
        return self.complete(step, tmp, training_state, run_config)

    def prepare(self, step: int, pid: Optional[int] = None) -> Path:
        """A fresh, empty temporary folder for a save of ``step``, named by ``pid`` (this
        process's; a sharded save's ranks all use rank 0's, so that they write one folder).

        Raises:
            CheckpointExistsError: ``step_<step>`` is already complete on disk.
            CheckpointWriteError: the folder cannot be made.
        """
        final = self.root / f"step_{int(step)}"
        if final.exists() and _invalid_reason(final) is None:
            raise CheckpointExistsError(f"Checkpoint {final} is already complete; refusing to overwrite it")
        tmp = self.root / f"{_TMP_PREFIX}step_{int(step)}_{os.getpid() if pid is None else pid}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by an earlier failed save of this process (or a reused pid)
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            raise _write_error(e, final, self.root) from e
        return tmp

    def complete(self, step: int, tmp: Path, training_state: Dict[str, Any],
                 run_config: Optional[Mapping[str, Any]] = None, fmt: str = "full") -> Path:
        """Writes the training state and config into ``tmp`` (which holds the weights), fsyncs
        it, writes the marker last and renames it to ``step_<step>``; then prunes. On any error
        ``tmp`` is removed and a :class:`CheckpointWriteError` raised for an I/O failure."""
        final = self.root / f"step_{int(step)}"
        try:
            _write_training_state(training_state, tmp / TRAINING_STATE_FNAME)
            if run_config is not None:
                (tmp / CONFIG_FNAME).write_text(OmegaConf.to_yaml(OmegaConf.create(dict(run_config))))
            _maybe_crash("after_training_state", step)
            _fsync_tree(tmp)
            _write_marker(tmp, int(step), fmt)
            _maybe_crash("before_rename", step)
            if final.exists():
                # Only an incomplete folder can be here (checked above): set aside, never deleted.
                set_aside(final, _invalid_reason(final) or "incomplete")
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException as e:
            error = self._abandon(e, tmp, final)
            if error is e:
                raise
            raise error from e
        log.info(f"Saved checkpoint {final}")
        self._clean_tmp()
        if self.keep_last_n is not None:
            self._prune(keep=final)
        return final

    def _abandon(self, e: BaseException, tmp: Path, final: Path) -> BaseException:
        # The partial folder goes; an I/O failure is said as one (CheckpointWriteError), any
        # other error is returned as it is.
        error = _write_error(e, final, self.root) if isinstance(e, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        return e if error is None else error

    def _write_hf(self, name: str, state_dict: Optional[Mapping[str, torch.Tensor]], step: int, tmp: Path,
                  adapter: Optional[Tuple[Mapping[str, torch.Tensor], Mapping[str, Any],
                                          Mapping[str, torch.Tensor]]] = None) -> None:
        """Write ``tmp/<name>/`` with torchtune's HF writer: the weights, and the adapters in
        PEFT's layout when ``adapter`` (state dict, config) is given.

        The writer puts files in ``<its output_dir>/epoch_<step>/``; we give it a scratch
        ``output_dir`` inside ``tmp`` and move that folder to ``tmp/<name>``.
        """
        scratch = tmp / f".writer_{name}"
        # should_load_recipe_state=False: otherwise its __init__ looks for recipe_state.pt and
        # adapter files in output_dir (our empty scratch folder) and fails.
        writer = config.instantiate(
            self._writer_cfgs[name], output_dir=str(scratch), should_load_recipe_state=False
        )
        # save_checkpoint needs the shard map that only load_checkpoint fills; rebuilt at setup.
        set_weight_map(writer, self._weight_maps[name])
        # save_checkpoint replaces the MODEL_KEY entry in place: give it a dict of our own.
        payload = {training.MODEL_KEY: {} if state_dict is None else dict(state_dict)}
        if adapter is not None:
            payload[training.ADAPTER_KEY] = dict(adapter[0])
            payload[training.ADAPTER_CONFIG] = dict(adapter[1])
        writer.save_checkpoint(payload, epoch=step, adapter_only=state_dict is None)
        os.rename(scratch / f"epoch_{step}", tmp / name)
        # The writer copies every other file of the source folder, a manifest of the source's own
        # files among them; COMPLETE describes this folder, so a copied manifest would mislead.
        (tmp / name / SOURCE_MANIFEST_FNAME).unlink(missing_ok=True)
        if adapter is not None and adapter[2]:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in adapter[2].items()}, str(tmp / name / HEAD_FNAME),
                      metadata={"format": "pt"})
        shutil.rmtree(scratch)

    def _clean_tmp(self) -> None:
        """Remove temporary folders left by crashed or failed saves (never a live process's)."""
        for p in self.root.iterdir():
            m = _TMP_PID_RE.match(p.name)
            if m is None or not p.is_dir():
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or not _pid_alive(pid):
                log.info(f"Removing leftover temporary checkpoint folder {p}")
                shutil.rmtree(p, ignore_errors=True)

    def keep_step(self, step: Optional[int]) -> None:
        """Pruning never deletes ``step_<step>`` (the best evaluation's checkpoint) until another
        step replaces it; None: no such step."""
        self.kept_step = None if step is None else int(step)

    def _prune(self, keep: Path) -> None:
        complete = _complete_steps(self.root, warn=False)
        kept = {p for _, p in complete[-self.keep_last_n:]} | {keep}
        kept |= {p for s, p in complete if s == self.kept_step}
        for _, path in complete:
            if path in kept:
                continue
            if self._loaded_from(path):
                log.info(f"Keeping {path}: a checkpointer loads its weights from it")
                continue
            # Rename first, so that a crash mid-delete leaves a tmp folder, not a broken step_*.
            doomed = self.root / f"{_TMP_PREFIX}prune_{path.name}_{os.getpid()}"
            os.rename(path, doomed)
            shutil.rmtree(doomed)
            log.info(f"Pruned checkpoint {path} (keep_last_n={self.keep_last_n})")

    def _loaded_from(self, path: Path) -> bool:
        # A writer reads config.json (and other non-weight files) from its checkpoint_dir at
        # every save: deleting the checkpoint a run resumed from would break the next save.
        path = path.resolve()
        for cfg in self._writer_cfgs.values():
            ckpt_dir = Path(cfg.checkpoint_dir).resolve()
            if ckpt_dir == path or path in ckpt_dir.parents:
                return True
        return False


def _resolved_block(block: Union[DictConfig, Mapping], name: str) -> DictConfig:
    if isinstance(block, DictConfig):
        block = OmegaConf.to_container(block, resolve=True)
    block = OmegaConf.create(dict(block))
    component = block.get("_component_", "")
    try:
        cls = import_component(component, f"{name} checkpointer's _component_")
    except ValueError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, training.FullModelHFCheckpointer)):
        raise TypeError(
            f"{name} checkpointer: checkpoints are written in HF format by "
            f"torchtune.training.FullModelHFCheckpointer (or a subclass), got _component_={component!r}"
        )
    return block


def _weight_map(cfg: DictConfig) -> Dict[str, str]:
    """HF key -> shard id ``"0001"``, ... exactly as torchtune's ``load_checkpoint`` builds it.

    Shards are the checkpoint files sorted by path (torchtune's order); only the headers are read.
    """
    files = cfg.checkpoint_files
    if not isinstance(files, (list, tuple)) and not OmegaConf.is_list(files):
        # {filename_format: model-{}-of-{}.safetensors, max_filename: "00004"}
        files = training.FormattedCheckpointFiles.from_dict(dict(files)).build_checkpoint_filenames()
    ckpt_dir = Path(cfg.checkpoint_dir)
    if not (ckpt_dir / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir / 'config.json'} not found (checkpoint_dir={ckpt_dir})")
    weight_map = {}
    for idx, path in enumerate(sorted(ckpt_dir / f for f in files)):
        if not path.is_file():
            raise FileNotFoundError(f"Checkpoint file {path} not found")
        for key in _tensor_names(path):
            weight_map[key] = f"{idx + 1:04}"
    return weight_map


def _tensor_names(path: Path) -> List[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    # .bin / .pt: mmap so that only the pickled index is read eagerly.
    return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True).keys())


def _check_finite(state_dicts: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Raise :class:`NonFiniteWeightsError` naming every model with NaN/Inf and its first params."""
    problems = []
    for model, sd in state_dicts.items():
        bad, count = [], 0
        for key, t in sd.items():
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                count += 1
                if len(bad) < _MAX_NAMES:
                    bad.append(key)
        if count:
            more = f" and {count - len(bad)} more" if count > len(bad) else ""
            problems.append(f"{model}: {', '.join(bad)}{more}")
    if problems:
        raise NonFiniteWeightsError(
            "Refusing to save a checkpoint with non-finite (NaN/Inf) weights in "
            + "; ".join(problems)
        )


def _write_training_state(state: Dict[str, Any], path: Path) -> None:
    # Through a Python file object: a failed write raises the OSError itself (errno, "No space
    # left on device"), where torch.save(obj, path) says "unexpected pos ..." instead.
    with open(path, "wb") as f:
        if os.environ.get(_FULL_DISK_ENV):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        torch.save(state, f)


def _write_error(error: Exception, final: Path, root: Path) -> Optional[Exception]:
    """A :class:`CheckpointWriteError` naming the folder and the OS error, for an I/O failure
    (also the ones torch or safetensors report without an errno); None for other errors."""
    if isinstance(error, CheckpointWriteError):
        return error
    if isinstance(error, OSError) and error.errno is not None:
        where = error.filename or final
        reason = f"{os.strerror(error.errno)} (errno {error.errno}: {errno.errorcode.get(error.errno, '?')})"
    elif isinstance(error, (OSError, RuntimeError)) or type(error).__name__ == "SafetensorError":
        where, reason = final, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        try:  # torch and safetensors lose the errno of a full disk: look at the disk itself
            if shutil.disk_usage(root if root.exists() else root.parent).free < (1 << 20):
                reason = f"{os.strerror(errno.ENOSPC)} ({reason})"
        except OSError:
            pass
    else:
        return None
    kept = [p.name for _, p in _complete_steps(root, warn=False)] if root.is_dir() else []
    return CheckpointWriteError(
        f"Could not write checkpoint {final}: {reason} at {where}. The partial folder is removed; "
        f"earlier checkpoints are kept ({', '.join(kept) if kept else 'none'}). Free space or fix "
        "the folder, then resume with resume_from_checkpoint=True."
    )


def check_loaded_finite(state_dict: Mapping[str, torch.Tensor], key: str) -> None:
    """Raises :class:`NonFiniteWeightsError` naming the checkpointer ``key`` and the first
    parameters holding NaN/Inf in weights just loaded."""
    try:
        _check_finite({key: state_dict})
    except NonFiniteWeightsError as e:
        raise NonFiniteWeightsError(
            f"{key}: the loaded weights hold NaN/Inf: {str(e).split(key + ': ', 1)[1]}. The checkpoint "
            "is damaged or was not written by this recipe (which never saves non-finite weights)."
        ) from None


def _maybe_crash(point: str, step: Optional[int] = None) -> None:
    if os.environ.get(_CRASH_ENV) in (point, f"{point}:{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every folder (children before parents) under ``root``."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for fname in filenames:
            fd = os.open(os.path.join(dirpath, fname), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(folder: Path, step: int, fmt: str = "full") -> None:
    """Write ``COMPLETE`` last: the step, the format, every file with its size and sha256, the
    weight files per model (a sharded folder's are its shards, listed with the other files)."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    marker = {
        "step": step,
        "format": fmt,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": {str(p.relative_to(folder)): p.stat().st_size for p in paths},
        "sha256": {str(p.relative_to(folder)): sha256_of(p) for p in paths},
        "checkpoint_files": {
            name: sorted(p.name for p in (folder / name).iterdir() if _SHARD_RE.match(p.name))
            for name in MODEL_NAMES if (folder / name).is_dir()
        },
        "adapter_files": {
            name: sorted(p.name for p in (folder / name).iterdir() if _ADAPTER_RE.match(p.name))
            for name in MODEL_NAMES if (folder / name).is_dir()
        },
    }
    path = folder / MARKER_FNAME
    with open(path, "w") as f:
        json.dump(marker, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)


# ----------------------------------------------------------------------------- discovery


def _read_marker(folder: Path) -> Dict[str, Any]:
    with open(Path(folder) / MARKER_FNAME) as f:
        return json.load(f)


def _invalid_reason(folder: Path, verify: bool = False) -> Optional[str]:
    """``None`` if ``folder`` is a complete checkpoint, else why not; ``verify`` also checks
    every file's sha256 against the marker (markers of older saves have none: sizes only)."""
    m = _STEP_RE.match(folder.name)
    if m is None:
        return "name is not step_<N>"
    try:
        marker = _read_marker(folder)
    except FileNotFoundError:
        return f"no {MARKER_FNAME} marker (save interrupted?)"
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER_FNAME} marker ({e})"
    if not isinstance(marker, dict):
        return f"{MARKER_FNAME} marker is not a JSON object"
    if marker.get("step") != int(m.group(1)):
        return f"{MARKER_FNAME} marker is for step {marker.get('step')}"
    for rel, size in marker.get("files", {}).items():
        if _EDITABLE_RE.match(rel):
            continue  # not read by a resume: see edited_files
        p = folder / rel
        if not p.is_file():
            return f"{rel} listed in {MARKER_FNAME} is missing"
        if p.stat().st_size != size:
            return f"{rel} has {p.stat().st_size} bytes, {MARKER_FNAME} says {size}"
    if marker.get("format") == "sharded":
        files = marker.get("files") or {}
        if f"{SHARDS_DIRNAME}/.metadata" not in files or not any(f.endswith(".distcp") for f in files):
            return f"{MARKER_FNAME} lists no {SHARDS_DIRNAME}/.metadata and shard files"
        weights, adapters = {"policy": True}, {}
    else:
        weights, adapters = marker.get("checkpoint_files") or {}, marker.get("adapter_files") or {}
    # the policy always; the value model where it was saved (none: critic-free)
    for name in ("policy", *(n for n in MODEL_NAMES if n != "policy" and (n in weights or n in adapters))):
        if not (weights.get(name) or adapters.get(name)):
            return f"{MARKER_FNAME} lists no {name} weight or adapter files"
    if verify:
        for rel, digest in marker.get("sha256", {}).items():
            if not _EDITABLE_RE.match(rel) and sha256_of(folder / rel) != digest:
                return (f"{rel} is damaged: its sha256 differs from the one {MARKER_FNAME} recorded "
                        "at save (same size, different bytes)")
    return None


def edited_files(folder: Path) -> List[str]:
    """What changed since the save among a checkpoint's files that a resume does not read
    (``adapter_config.json``, ``generation_config.json``, tokenizer files, notes): one line per
    file, e.g. ``"policy/adapter_config.json: 312 -> 359 bytes, other contents"``."""
    try:
        marker = _read_marker(folder)
    except (OSError, ValueError):
        return []
    changes = []
    for rel, digest in (marker.get("sha256") or {}).items():
        if not _EDITABLE_RE.match(rel):
            continue
        p, size = folder / rel, (marker.get("files") or {}).get(rel)
        if not p.is_file():
            changes.append(f"{rel}: removed")
        elif sha256_of(p) != digest:
            now = p.stat().st_size
            changes.append(f"{rel}: {size} -> {now} bytes, other contents" if size != now
                           else f"{rel}: same size ({now} bytes), other contents")
    return changes


def set_aside(folder: Path, reason: str) -> Path:
    """Rename a damaged or incomplete ``step_<N>`` folder to ``step_<N>.damaged-<UTC time>``, so
    that nothing reads it and a run may save step N again; nothing in it is deleted.

    Returns:
        Path: where the folder now is.
    """
    folder = Path(folder)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target, n = folder.with_name(f"{folder.name}.damaged-{stamp}"), 1
    while target.exists():
        target, n = folder.with_name(f"{folder.name}.damaged-{stamp}-{n}"), n + 1
    os.rename(folder, target)
    _fsync_dir(folder.parent)
    log.warning(f"Set aside checkpoint {folder} as {target.name} ({reason}); nothing in it was deleted. "
                f"The run goes on from an older checkpoint and saves step {folder.name[5:]} anew.")
    return target


def _complete_steps(root: Path, warn: bool = True) -> List[Tuple[int, Path]]:
    """``[(N, path)]`` of complete ``step_<N>`` folders under ``root``, sorted by N."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m is None or not p.is_dir():
            continue
        reason = _invalid_reason(p)
        if reason is None:
            out.append((int(m.group(1)), p))
        elif warn:
            log.warning(f"Skipping checkpoint folder {p}: {reason}")
    return sorted(out)


def latest_checkpoint(output_dir: Union[str, Path], verify: bool = False,
                      set_aside_damaged: bool = False) -> Optional[Path]:
    """The newest complete checkpoint of a run.

    ``step_*`` folders without a valid marker are skipped with a warning naming them, and
    leftover temporary folders of interrupted saves are reported and ignored.

    Args:
        output_dir (Union[str, Path]): the run's output folder.
        verify (bool): also check the sha256 of every file, newest checkpoint first; a damaged
            one is named (file and what is wrong) with a warning and the next older one tried.
            Files a resume does not read (:func:`edited_files`) are only warned about.
        set_aside_damaged (bool): rename (:func:`set_aside`) every damaged or incomplete
            ``step_<N>`` folder newer than the one returned, so that the resumed run can save
            those steps again instead of finding them in its way.

    Returns:
        Optional[Path]: ``<output_dir>/checkpoints/step_<N>`` with the largest N that is
        complete, or ``None`` if there is none.
    """
    root = Path(output_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        if p.name.startswith(_TMP_PREFIX) and p.is_dir():
            log.warning(f"Ignoring {p}: an interrupted save; it is removed by the next save")
    complete = _complete_steps(root)
    chosen: Optional[Path] = None
    damaged: Dict[Path, str] = {}
    if not verify:
        chosen = complete[-1][1] if complete else None
    for _, path in reversed(complete if verify else []):
        reason = _invalid_reason(path, verify=True)
        if reason is None:
            chosen = path
            break
        damaged[path] = reason
        log.warning(f"Skipping damaged checkpoint {path}: {reason}. Trying the next older one.")
    if chosen is not None and verify:
        for change in edited_files(chosen):
            log.warning(f"{chosen}: {change} since the save. A resume does not read this file, so the "
                        "checkpoint stays usable; the next save writes its own.")
    if set_aside_damaged:
        floor = -1 if chosen is None else int(_STEP_RE.match(chosen.name).group(1))
        for p in sorted(root.iterdir()):
            m = _STEP_RE.match(p.name)
            if m is not None and p.is_dir() and int(m.group(1)) > floor:
                set_aside(p, damaged.get(p) or _invalid_reason(p) or "damaged")
    return chosen


def existing_checkpoints(output_dir: Union[str, Path]) -> List[Path]:
    """Every checkpoint folder in ``output_dir``, complete or not, that a fresh run would clobber.

    Covers ``checkpoints/step_*`` and the older layout ``policy/epoch_*``, ``value/epoch_*``
    written by torchtune's checkpointers directly. Temporary folders are not counted.

    Args:
        output_dir (Union[str, Path]): the run's output folder.

    Returns:
        List[Path]: sorted paths; empty when a fresh run may start there.
    """
    output_dir = Path(output_dir)
    found = []
    for parent, pattern in ((CHECKPOINTS_DIRNAME, "step_*"), ("policy", "epoch_*"), ("value", "epoch_*")):
        found += [p for p in (output_dir / parent).glob(pattern) if p.is_dir()]
    return sorted(found)


# ----------------------------------------------------------------------------- loading


def _require_complete(checkpoint: Union[str, Path]) -> Path:
    checkpoint = Path(checkpoint)
    reason = _invalid_reason(checkpoint)
    if reason is not None:
        raise ValueError(f"{checkpoint} is not a complete checkpoint: {reason}")
    return checkpoint


def load_training_state(checkpoint: Union[str, Path], *, weights_only: bool = True,
                        mmap: bool = False) -> Dict[str, Any]:
    """The ``training_state`` dict given to :meth:`CheckpointManager.save`, on CPU.

    Args:
        checkpoint (Union[str, Path]): a complete ``step_<N>`` folder.
        weights_only (bool): kept for callers; the file is always loaded with
            ``weights_only=True`` (tensors, containers and Python scalars, including
            ``random.getstate()``): a checkpoint is data, never code.
        mmap (bool): map the tensors from the file instead of reading them, for a look at the
            plain entries (counters, data identity) that costs no read of the optimizer state;
            never for tensors that will be trained in place.

    Returns:
        Dict[str, Any]: the saved dict.

    Raises:
        ValueError: ``checkpoint`` is not complete.
        DamagedCheckpointError: the file cannot be unpickled as plain data.
    """
    checkpoint = _require_complete(checkpoint)
    path = checkpoint / TRAINING_STATE_FNAME
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - torch's own message would advise unsafe loading
        first = (str(e).splitlines() or [""])[0]
        what = "not plain data" if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e) else first
        raise DamagedCheckpointError(
            f"{path} cannot be read ({type(e).__name__}: {what}): it is damaged, or holds objects "
            "other than tensors, containers and numbers, so it was not written by this recipe. "
            f"Move {checkpoint} aside to resume from the checkpoint before it."
        ) from None
    evaluation = _evaluation_after(checkpoint)
    if evaluation is not None:
        state["evaluation"] = evaluation
    return state


def write_evaluation(checkpoint: Union[str, Path], evaluation: Mapping[str, Any]) -> Path:
    """Records in a complete ``step_<N>`` folder the evaluations' record after step N's own
    evaluation (``EvalRecord.state_dict()``, its history ending at step N), which ran after the
    folder was written: ``evaluation.json``, written aside and renamed into place, so that it is
    either whole or absent. :func:`load_training_state` reads it in place of the record the
    training state holds.

    Raises:
        ValueError: ``checkpoint`` is not complete, or the history does not end at its step.
    """
    checkpoint = _require_complete(checkpoint)
    step = int(_STEP_RE.match(checkpoint.name).group(1))
    history = evaluation.get("history") or []
    if not history or history[-1].get("step") != step:
        raise ValueError(f"write_evaluation: the record of {checkpoint} must end with the evaluation of step "
                         f"{step}, got {[h.get('step') for h in history]}.")
    tmp = checkpoint / f"{_TMP_PREFIX}{EVALUATION_FNAME}_{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": step, "evaluation": dict(evaluation)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / EVALUATION_FNAME)
    _fsync_dir(checkpoint)
    return checkpoint / EVALUATION_FNAME


def _evaluation_after(checkpoint: Path) -> Optional[Dict[str, Any]]:
    """The record of ``checkpoint``'s ``evaluation.json`` (None: absent); one that cannot be read
    or is of another step is named in a warning and left out (the resumed run evaluates again)."""
    path = checkpoint / EVALUATION_FNAME
    if not path.is_file():
        return None
    step = int(_STEP_RE.match(checkpoint.name).group(1))
    try:
        with open(path) as f:
            saved = json.load(f)
        history = saved["evaluation"]["history"]
        if saved["step"] != step or history[-1]["step"] != step:
            raise ValueError(f"it is the evaluation of step {saved['step']}")
        return saved["evaluation"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        log.warning(f"Ignoring {path} ({type(e).__name__}: {e}): the resumed run evaluates step {step} again.")
        return None


def checkpointer_overrides(checkpoint: Union[str, Path]) -> Dict[str, Dict[str, Any]]:
    """Checkpointer arguments that load the weights of a saved checkpoint.

    Use with the run's own checkpointer blocks, which keep ``model_type`` and ``output_dir``:
    ``config.instantiate(cfg.checkpointer, **overrides["policy"])`` and
    ``config.instantiate(cfg.value_checkpointer, **overrides["value"])``.

    Args:
        checkpoint (Union[str, Path]): a complete ``step_<N>`` folder.

    Returns:
        Dict[str, Dict[str, Any]]: ``{"policy": {"checkpoint_dir": str, "checkpoint_files":
        [str, ...]}, "value": {...}}``.

    Raises:
        ValueError: ``checkpoint`` is not complete.
    """
    checkpoint = _require_complete(checkpoint)
    files = _read_marker(checkpoint).get("checkpoint_files") or {}  # none in a sharded one
    return {
        name: {"checkpoint_dir": str(checkpoint / name), "checkpoint_files": list(files[name])}
        for name in MODEL_NAMES if name in files
    }


def is_sharded(checkpoint: Union[str, Path]) -> bool:
    """Whether a complete checkpoint is of ``checkpoint_format: sharded`` (its weights in
    ``shards/``, loaded after the models are built from the config's checkpointers)."""
    return _read_marker(_require_complete(checkpoint)).get("format") == "sharded"


def load_adapters(checkpoint: Union[str, Path], name: str) -> Dict[str, torch.Tensor]:
    """The trained adapter weights of model ``name`` saved in a complete checkpoint, in
    torchtune's names (``adapter_model.pt``; the PEFT-layout safetensors beside it hold the same
    tensors in Hugging Face's names), with a value model's head (``head.safetensors``), on the CPU.

    Raises:
        ValueError: ``checkpoint`` is not complete.
        FileNotFoundError: it holds no adapters of ``name`` (saved from a model without LoRA).
    """
    checkpoint = _require_complete(checkpoint)
    path = checkpoint / name / ADAPTER_PT_FNAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {checkpoint} holds no {name} adapters, so it was saved by a run "
            f"whose {name} had no LoRA layers; resume it with that run's model builder.")
    state = torch.load(path, map_location="cpu", weights_only=True)
    head = checkpoint / name / HEAD_FNAME
    if head.is_file():
        from safetensors.torch import load_file

        state.update(load_file(str(head)))
    return state


# ----------------------------------------------------------------------------- recipe helpers


def check_writable(output_dir: Union[str, Path]) -> None:
    """Creates ``output_dir`` if needed and writes (then removes) a probe file in it, so an
    unwritable folder is reported with its path and the OS error before any logger or model
    is made.

    Raises:
        CheckpointWriteError: naming the path and the OS error (e.g. "Permission denied").
    """
    path = Path(output_dir)
    probe = path / f".write_probe_{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointWriteError(
            f"output_dir {str(path)!r} is not writable: {e.strerror or e} ({e.filename or path}). "
            "Choose another output_dir, or fix the folder's permissions or free its disk."
        ) from None


def checkpoint_to_resume(output_dir: Union[str, Path], resume: bool) -> Optional[str]:
    """The checkpoint a run starts from: None for a fresh run, the newest complete one to resume.

    Takes the output folder's lock (:func:`lock_output_dir`) unless it refuses first (a refused
    run leaves the folder as it was). Resuming, damaged or incomplete step folders newer than the
    one chosen are set aside (renamed, never deleted), under the lock.

    Args:
        output_dir (Union[str, Path]): the run's output folder.
        resume (bool): ``resume_from_checkpoint``.

    Raises:
        FileExistsError: a fresh run into a folder that holds checkpoints (it would overwrite them).
        FileNotFoundError: resuming, but no complete checkpoint is there.
        RuntimeError: another run holds the folder's lock.
    """
    if not resume:
        existing = existing_checkpoints(output_dir)
        if existing:
            raise FileExistsError(
                f"output_dir {str(output_dir)!r} already holds checkpoints "
                f"({', '.join(str(p) for p in existing[:3])}); a fresh run would overwrite "
                "them. Resume with resume_from_checkpoint=True, or choose another output_dir."
            )
        lock_output_dir(output_dir)  # after the refusal above: a refused run leaves the folder untouched
        return None
    if (Path(output_dir) / CHECKPOINTS_DIRNAME).is_dir():
        lock_output_dir(output_dir)  # before anything is set aside
    # Rank 0 checks every file and sets damaged folders aside; the other ranks take its answer.
    latest = latest_checkpoint(output_dir, verify=True, set_aside_damaged=True) if _rank() == 0 else None
    if _world_size() > 1:
        shared = [latest]
        torch.distributed.broadcast_object_list(shared, src=0)
        latest = shared[0]
    if latest is None:
        raise FileNotFoundError(
            f"resume_from_checkpoint=True but output_dir {str(output_dir)!r} holds no complete "
            f"checkpoint (<output_dir>/{CHECKPOINTS_DIRNAME}/step_<N> with a {MARKER_FNAME} marker "
            "and files that match it)."
        )
    log.info(f"Resuming from {latest}")
    return str(latest)


_held_locks: Dict[str, Any] = {}  # resolved output_dir -> the open lock file of this process


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def lock_output_dir(output_dir: Union[str, Path]) -> None:
    """Holds ``<output_dir>/.run.lock`` (an ``flock``, released when the process ends, even
    killed, or by :func:`release_output_dir`) so that two runs never write one folder: two
    resumes at once would save the same steps over each other. Rank 0 only; taking it again in
    the same process is a no-op.

    Raises:
        RuntimeError: another process holds it; names that process (pid, host, start, command).
        CheckpointWriteError: the folder cannot be created or written.
    """
    import fcntl
    import socket
    import sys

    if _rank() != 0:
        return
    check_writable(output_dir)
    path = Path(output_dir).resolve() / LOCK_FNAME
    if str(path) in _held_locks:
        return
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RuntimeError(
            f"output_dir {str(output_dir)!r} is in use by another run ({holder}): two runs writing one folder "
            "would save over each other's checkpoints. Wait for that run to end (or stop it: it saves "
            "and exits on Ctrl-C, SIGTERM or SIGHUP), or choose another output_dir.") from None
    f.seek(0)
    f.truncate()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {' '.join(sys.argv)[:300]}\n")
    f.flush()
    _held_locks[str(path)] = f


def release_output_dir(output_dir: Union[str, Path]) -> None:
    """Lets go of the lock :func:`lock_output_dir` took (at the end of a run); a no-op otherwise."""
    f = _held_locks.pop(str(Path(output_dir).resolve() / LOCK_FNAME), None)
    if f is not None:
        f.close()  # closing the file releases the flock


def check_shapes(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], key: str) -> None:
    """Names the checkpointer ``key``, the parameter and both shapes when a checkpoint does not fit.

    Raises:
        ValueError: a tensor's shape differs from the model parameter of the same name.
    """
    expected = model.state_dict()
    for name, tensor in state_dict.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise ValueError(
                f"{key}: parameter {name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
                f"{tuple(expected[name].shape)} in the model; the checkpoint is of another model "
                f"size or family than the config's model builder."
            )
