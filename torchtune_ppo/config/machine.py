"""What this machine offers a run: the device a config names, and the CPU threads it may use
(``cpu_threads`` and ``OMP_NUM_THREADS``)."""

import os
from typing import Any, Optional, Tuple

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


def cpu_threads(setting: Any) -> int:
    """The thread count ``cpu_threads`` means on this machine (see its key in ``SCHEMA``).

    A number above the cores this process may run on is capped to them with a warning: more
    OpenMP threads than cores spin-wait for each other and run several times slower.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set but is not a positive integer (or OpenMP's list of
            them, ``4,2``), naming its value and what is valid.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
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
    if cores > 1:
        utils.get_logger("INFO").info(
            f"cpu_threads=auto: {cores - 1} thread(s) on {cores} cores, one left free (beside another busy "
            f"process every core would make OpenMP's threads wait for each other); on a machine of its own "
            f"cpu_threads={cores} runs faster.")
    return max(1, cores - 1)


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
            "decides (`auto`: every core but one).")
    return int(counts[0])
