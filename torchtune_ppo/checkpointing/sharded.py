"""Sharded checkpoints (``checkpoint_format: sharded``): every rank writes its own shards.

A step folder of this format holds, beside ``training_state.pt``, ``config.yaml`` and the
``COMPLETE`` marker of every format (:mod:`.store`)::

    step_<N>/
        shards/              torch.distributed.checkpoint (DCP): .metadata and one __<rank>_0.distcp
                             per rank that saved: the trained models' weights (model.<name>.<fqn>),
                             the optimizer's state (optim.<name>.<fqn>.<key>) and bf16 runs' fp32
                             masters (master.<name>.<fqn>), each rank its own shard of them
        training_state.pt    the rest, on rank 0: counters, data position, random states, the
                             optimizer's settings (its param_groups, by parameter name)

Nothing is gathered to one process: each rank writes what it holds, so rank 0's memory during a
save does not grow with the model. A load reshards to the ranks it finds (DCP reads each
rank's part of every tensor, whatever the saving ranks held), so a checkpoint of W processes
resumes on any W'. Every rank must reach the same folder: one file system shared by the ranks
(one host, or a shared mount across hosts).

With ``async_save`` the state is copied to fresh host tensors (staged) while the step waits,
then written by a background thread while training goes on; at most one save is in flight (the
next waits for it), and a save at a stop, a failure or the run's end is written before the
process goes on. The folder is renamed into place only once every rank's shard, the metadata
and the marker with every file's checksum are on disk, so a kill at any moment leaves a
complete folder or an ignored temporary one.
"""

import concurrent.futures
import contextlib
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune import utils

from torchtune_ppo import distributed
from torchtune_ppo.checkpointing.store import SHARDS_DIRNAME

log = utils.get_logger("INFO")

FORMATS = ("full", "sharded")


def shard_state(models: Mapping[str, nn.Module], optimizer: torch.optim.Optimizer,
                masters: Optional[List[torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """What this rank writes: its part of every trained model's weights, of the optimizer's
    per-parameter tensors and of the fp32 masters, flat and keyed by name. The tensors are the
    live ones (DTensors under FSDP2), so that :func:`load_shards` fills them in place."""
    out: Dict[str, torch.Tensor] = {}
    for name, m in models.items():
        out.update({f"model.{name}.{k}": v for k, v in m.state_dict().items()})
    names = distributed.trained_names(dict(models))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(params) != len(names):
        raise ValueError(f"the optimizer holds {len(params)} parameters, the trained models {len(names)}: "
                         "a sharded checkpoint names the optimizer's state by the models' parameters.")
    for n, p in zip(names, params):
        for key, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"optim.{n}.{key}"] = v
    for n, m in zip(names, masters or []):
        out[f"master.{n}"] = m
    return out


def optimizer_settings(models: Mapping[str, nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's param_groups (parameters by name) and which parameters have a state:
    the part of it that is not sharded, for ``training_state.pt``."""
    names = iter(distributed.trained_names(dict(models)))
    groups, stateful = [], []
    for g in optimizer.param_groups:
        group_names = [next(names) for _ in g["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": group_names})
        stateful += [n for n, p in zip(group_names, g["params"]) if optimizer.state.get(p)]
    return {"format": "sharded", "param_groups": groups, "stateful": stateful}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives every parameter the optimizer's initial state (a step of lr 0 on zero gradients,
    which changes no weight), so that a load has tensors to fill."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]  # fp32 masters need no grad flag
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def load_shards(folder: Path, models: Mapping[str, nn.Module], optimizer: torch.optim.Optimizer,
                settings: Mapping[str, Any], masters: Optional[List[torch.Tensor]] = None) -> None:
    """Fills the models, the optimizer and the masters from ``folder/shards`` in place, each
    rank its own part, whatever the number of ranks that saved; every rank must call it. bf16
    masters move between their two layouts: one process's masters (``master.*``) fill the fp32
    shards of several, whose fp32 weights fill one process's masters.

    Raises:
        ValueError: the shards miss a tensor this run trains, or a shape differs (another model).
    """
    names = distributed.trained_names(dict(models))
    saved_names = [n for g in settings["param_groups"] for n in g["params"]]
    if saved_names != names:
        missing = sorted(set(names) - set(saved_names))[:3] or sorted(set(saved_names) - set(names))[:3]
        raise ValueError(f"{folder}: its optimizer names {len(saved_names)} trained parameters, this run "
                         f"{len(names)} (first differing: {missing}); resume with the models it was saved with.")
    if settings["stateful"]:
        init_optimizer_state(optimizer)
    targets = shard_state(models, optimizer, masters)
    stateful = set(settings["stateful"])
    targets = {k: v for k, v in targets.items()
               if not k.startswith("optim.") or k.split(".", 1)[1].rsplit(".", 1)[0] in stateful}
    reader = dcp.FileSystemReader(str(Path(folder) / SHARDS_DIRNAME))
    saved = reader.read_metadata().state_dict_metadata
    sources = {k: k for k in targets}  # this run's tensor -> the checkpoint's that fills it
    saved_masters = any(k.startswith("master.") for k in saved)
    if masters is None and saved_masters:
        # bf16 masters saved on one process, resumed on several: the fp32 shards take the masters
        sources.update({f"model.{n}": f"master.{n}" for n in names})
    elif masters is not None and not saved_masters and all(
            getattr(saved.get(f"model.{n}"), "properties", None) is not None
            and saved[f"model.{n}"].properties.dtype == torch.float32 for n in names):
        # saved on several processes, whose fp32 shards were the masters: they fill this run's
        # masters, rounded into the bf16 weights after the load (MasterWeights.write_back)
        for n in names:
            del sources[f"model.{n}"]
            sources[f"master.{n}"] = f"model.{n}"
    absent = [s for s in sources.values() if s not in saved]
    if any(k.startswith("master.") for k in absent):
        raise ValueError(f"{folder} holds no fp32 master weights (saved with master_weights=False or dtype=fp32): "
                         "resume it with the settings it was saved with.")
    if absent:
        raise ValueError(f"{folder}/{SHARDS_DIRNAME} holds no {absent[:3]} ({len(absent)} tensors missing): "
                         "it was saved from other models; resume it with the models it was saved with.")
    for k, src in sources.items():
        size, v = tuple(getattr(saved[src], "size", ())), targets[k]
        if size != tuple(v.shape):
            raise ValueError(f"{folder}/{SHARDS_DIRNAME}: {src} has shape {size} there but {tuple(v.shape)} in this "
                             "run's model; the checkpoint is of another model size or family.")
    state = {src: targets[k] for k, src in sources.items()}
    with _one_process_quiet():
        dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    for g, saved_group in zip(optimizer.param_groups, settings["param_groups"]):
        g.update({k: v for k, v in saved_group.items() if k != "params"})
    for name, m in models.items():  # the state dict's tensors are the parameters: loaded in place
        prefix = f"model.{name}."
        m.load_state_dict({k[len(prefix):]: v for k, v in targets.items() if k.startswith(prefix)})


def read_full(folder: Path, prefix: str) -> Dict[str, torch.Tensor]:
    """Every tensor of ``folder/shards`` whose name starts with ``prefix`` (e.g.
    ``model.policy.``), whole, on the CPU, keyed without the prefix; read by one process."""
    reader = dcp.FileSystemReader(str(Path(folder) / SHARDS_DIRNAME))
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
           if k.startswith(prefix) and hasattr(m, "size")}
    if out:
        with _one_process_quiet():
            dcp.load(out, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in out.items()}


def stage(state: Mapping[str, torch.Tensor], into: Optional[Dict[str, torch.Tensor]] = None
          ) -> Dict[str, torch.Tensor]:
    """Host copies of ``state``'s tensors (a DTensor's local shard, with its layout), so that the
    steps after a save cannot change what it writes. ``into``: the copies of an earlier save,
    written over when every tensor matches in name, shape and dtype (no new memory to fault in);
    else fresh ones."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    if into is not None and into.keys() == state.keys() and all(
            local(into[k]).shape == local(v).shape and into[k].dtype == v.dtype for k, v in state.items()):
        for k, v in state.items():
            local(into[k]).copy_(local(v).detach())
        return into

    def copy(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return DTensor.from_local(t.to_local().detach().to("cpu", copy=True), t.device_mesh, t.placements,
                                      run_check=False, shape=t.shape, stride=t.stride())
        return t.detach().to("cpu", copy=True)
    return {k: copy(v) for k, v in state.items()}


class ShardWriter:
    """Writes each rank's shards of a step into a temporary folder every rank names alike, then
    has rank 0 complete it (``complete(tmp)``: training state, marker, rename); in the background
    with ``async_save``.

    Args:
        async_save (bool): stage and return; the write runs in a thread, one save at a time.
    """

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self.last_blocked_s = 0.0  # how long the last save held the step
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[concurrent.futures.Future] = None
        self._group = None
        self._staged: Optional[Dict[str, torch.Tensor]] = None  # host copies, reused save after save
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if async_save:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            if distributed:  # the background write's collectives, apart from training's
                self._group = dist.new_group(backend="gloo")
        self._lock = threading.Lock()

    def save(self, tmp: Path, state: Mapping[str, torch.Tensor], complete: Callable[[], Any],
             blocking: bool = False) -> None:
        """Writes ``state`` (this rank's shards) to ``tmp/shards`` on every rank, then calls
        ``complete`` (rank 0's: the rest of the folder and the rename). ``blocking``: written
        before returning, also with ``async_save``. Errors of a background save are raised by
        the next call (or :meth:`wait`)."""
        start = time.perf_counter()
        self.wait()
        if not self.async_save:
            _write(tmp, state, None)
            complete()
            self.last_blocked_s = time.perf_counter() - start
            return
        staged = self._staged = stage(state, self._staged)  # the last save's buffers, written over
        self._pending = self._pool.submit(self._write_then_complete, tmp, staged, complete)
        self.last_blocked_s = time.perf_counter() - start
        if blocking:
            self.wait()

    def _write_then_complete(self, tmp: Path, staged, complete) -> None:
        try:
            _write(tmp, staged, self._group)
            complete()
        except BaseException as e:
            log.error(f"The background save into {tmp} failed: {type(e).__name__}: {e}")
            raise

    def wait(self) -> None:
        """Until the save in flight, if any, is on disk; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finishes the save in flight and stops the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _write(tmp: Path, state: Mapping[str, torch.Tensor], group) -> None:
    # sync_files: each shard fsynced before the metadata that names it is written
    writer = dcp.FileSystemWriter(str(Path(tmp) / SHARDS_DIRNAME), sync_files=True)
    with _one_process_quiet():
        dcp.save(dict(state), storage_writer=writer, process_group=group, no_dist=not dist.is_initialized())


@contextlib.contextmanager
def _one_process_quiet():
    # DCP warns "assuming the intent is to save in a single process" on one process: it is.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        yield
