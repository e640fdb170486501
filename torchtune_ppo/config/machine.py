"""What this machine offers a run: the device a config names, and the CPU threads it may use
(``cpu_threads`` and ``OMP_NUM_THREADS``)."""

import os
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torchtune import utils

from torchtune_ppo.config.schema import KEYS, parse_device


def check_device(device: Any, key: str = "device") -> None:
    """Check that a device string names a device this machine has.

    torchtune's ``get_device("cuda")`` runs on the CPU without a word when no GPU is present,
    which turns a GPU run into a CPU run that looks like it is merely slow.

    Args:
        device (Any): ``None`` (torchtune picks from the machine), or ``cpu``, ``cuda``,
            ``cuda:N``, ``mps``, ``xpu``, ``npu`` (``:N`` allowed for all but cpu/mps).
        key (str): how the message names the setting.

    Raises:
        ValueError: on an unknown device string or a device that is not available.
    """
    KEYS["device"].kind.check(key, device)
    if device is None:
        return
    parsed = parse_device(device)
    kind = parsed.type
    if kind == "cpu":
        return
    available, count, backend = _device_availability(kind)
    if not available:
        raise ValueError(
            f"{key} is {device!r} but this machine has no {kind} device ({backend} is "
            f"False; torch {torch.__version__}). torchtune would run on the CPU instead without "
            f"saying so; set {key}=cpu or install a torch build for {kind}."
        )
    if parsed.index is not None and count is not None and parsed.index >= count:
        raise ValueError(
            f"{key} is {device!r} but only {count} {kind} device(s) are visible; "
            f"use {kind}:0 to {kind}:{count - 1}, or plain {kind}."
        )


def _device_availability(kind: str) -> Tuple[bool, Optional[int], str]:
    if kind == "cuda":
        ok = torch.cuda.is_available()
        return ok, torch.cuda.device_count() if ok else 0, "torch.cuda.is_available()"
    if kind == "mps":
        return torch.backends.mps.is_available(), 1, "torch.backends.mps.is_available()"
    if kind == "xpu":
        ok = hasattr(torch, "xpu") and torch.xpu.is_available()
        return ok, torch.xpu.device_count() if ok else 0, "torch.xpu.is_available()"
    from torchtune_ppo._patches.torchtune_modules import is_npu_available

    return bool(is_npu_available), None, "torchtune.utils.is_npu_available"


def cpu_threads(setting: Any, busy: Optional[Callable[[Sequence[int]], Optional[float]]] = None) -> int:
    """The thread count ``cpu_threads`` means on this machine (see its key in ``SCHEMA``).

    ``auto``: ``OMP_NUM_THREADS`` when set; else the cores this process may run on less those
    other processes keep busy at start-up (:func:`busy_cores`, rounded), shared among the
    processes torchrun started on this machine (``LOCAL_WORLD_SIZE``), at least 1. On a machine
    of its own that is every core; beside a busy process it leaves that process its core, where
    every core would make OpenMP's threads spin-wait for a descheduled peer (several times
    slower, ``benchmarks/RESULTS.md``, "CPU threads under load").

    A number above the cores this process may run on is capped to them with a warning: more
    OpenMP threads than cores spin-wait for each other and run several times slower.

    Args:
        setting (Any): ``"auto"`` or a positive integer.
        busy (Optional[Callable]): how busy the cores are (cores in, busy cores or None out);
            None: :func:`busy_cores`.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set but is not a positive integer (or OpenMP's list of
            them, ``4,2``), naming its value and what is valid.
    """
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = len(affinity)
    omp = omp_num_threads()
    if setting != "auto":
        if int(setting) > cores:
            utils.get_logger("INFO").warning(
                f"cpu_threads={int(setting)} is more than the {cores} cores this process may run "
                f"on; using {cores} (more threads than cores wait for each other).")
            return cores
        return int(setting)
    if omp is not None:
        return omp
    local = _local_world_size()
    taken = (busy or busy_cores)(affinity)
    others = 0 if taken is None else min(cores, int(taken + 0.5))
    threads = max(1, (cores - others) // local)
    seen = ("how busy they are could not be read (/proc/stat), so all are used" if taken is None
            else f"other processes kept {taken:.1f} of them busy at start-up")
    shared = f", shared by {local} processes on this machine" if local > 1 else ""
    utils.get_logger("INFO").info(
        f"cpu_threads=auto: {threads} thread(s) on {cores} cores ({seen}{shared}); cpu_threads=N chooses. "
        "A process that starts later beside this run can slow it several times (OpenMP's threads wait for "
        "a descheduled peer): then set cpu_threads below the cores.")
    return threads


def busy_cores(cores: Sequence[int], interval: float = 0.25, stat: str = "/proc/stat") -> Optional[float]:
    """How many of ``cores`` other processes keep busy: the busy share of each (user, system,
    interrupts and time the hypervisor took, i.e. not idle nor waiting for I/O) over
    ``interval`` seconds of ``stat`` (Linux's ``/proc/stat``), summed; this process sleeps
    meanwhile. None where the file cannot be read or parsed (not Linux)."""
    before = _core_times(stat)
    if before is None:
        return None
    time.sleep(interval)
    after = _core_times(stat)
    if after is None:
        return None
    total = 0.0
    for core in cores:
        if core not in before or core not in after:
            return None
        (busy0, all0), (busy1, all1) = before[core], after[core]
        if all1 > all0:
            total += (busy1 - busy0) / (all1 - all0)
    return total


def _core_times(stat: str) -> Optional[Dict[int, Tuple[int, int]]]:
    """Each core's ``(busy, all)`` clock ticks since boot, from ``stat``'s ``cpuN`` lines."""
    try:
        with open(stat) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    times = {}
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        try:
            ticks = [int(x) for x in fields[:8]]
        except ValueError:
            return None
        if len(ticks) < 5:
            return None
        idle = ticks[3] + ticks[4]  # idle and iowait
        times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times or None


def _local_world_size() -> int:
    """The processes torchrun started on this machine (``LOCAL_WORLD_SIZE``), 1 without it."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def omp_num_threads() -> Optional[int]:
    """``OMP_NUM_THREADS`` as OpenMP reads it (a positive integer, or a comma-separated list of
    them for nested levels, the first of which counts here); None when it is not set.

    Raises:
        ValueError: set to anything else (``0``, ``-1``, ``abc``, empty), which OpenMP ignores
            with a warning and ``torch.set_num_threads`` refuses without naming the variable.
    """
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None:
        return None
    counts = [p.strip().removeprefix("+") for p in value.split(",")]
    if not all(c.isdigit() and c.isascii() and int(c) > 0 for c in counts):
        raise ValueError(
            f"OMP_NUM_THREADS={value!r} is not a positive integer: set it to the number of CPU "
            "threads to use (e.g. OMP_NUM_THREADS=1), or unset it and the config's cpu_threads "
            "decides (`auto`: every core other processes leave free).")
    return int(counts[0])
