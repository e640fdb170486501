"""Which dtype ``dtype: auto`` means: decided once at start-up, from the device, and kept on resume.

``auto`` is bf16 where the hardware multiplies bf16 natively, fp32 elsewhere:

- a CPU: bf16 when ``/proc/cpuinfo`` lists ``avx512_bf16`` or ``amx_bf16``; fp32 without them
  (torch would emulate bf16 products, slower than fp32 ones) or when the file cannot be read;
- a CUDA GPU: bf16 when ``torch.cuda.is_bf16_supported(including_emulation=False)`` (compute
  capability 8.0 and up, or ROCm), else fp32;
- any other device (mps, xpu, npu): fp32.

A resume keeps the dtype its checkpoints were saved in (``dtype`` must match on resume), so a
run moved to a machine that would choose otherwise goes on as it began.

:func:`choose_dtype` is the rule alone, on facts passed in; :func:`machine_dtype` reads them from
this machine; :func:`resolve_auto_dtype` adds the resume and the planning for another machine
(``check_machine=False``). ``validate_config`` calls it and logs its note.
"""

from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import torch
import yaml

from torchtune_ppo.config.run_folder import saved_config, step_folders
from torchtune_ppo.config.schema import parse_device

DTYPES = ("fp32", "bf16")  # what ``auto`` becomes; the rest of the run sees only these
CPUINFO = "/proc/cpuinfo"  # read by cpu_bf16_flags; tests point it at a file of their own
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags of native bf16 products
# Planning for another machine, its facts unknown: a CUDA target is taken to have bf16 (every
# data-centre GPU since the A100), a CPU target not (fp32, the larger of the two plans).
PLANNED_CUDA_BF16 = True


def cpu_bf16_flags(cpuinfo: Optional[str] = None) -> Optional[Tuple[str, ...]]:
    """The native-bf16 flags (:data:`CPU_BF16_FLAGS`) that ``cpuinfo`` lists: ``()`` when none,
    None when the file cannot be read (not Linux).

    Args:
        cpuinfo (Optional[str]): the file to read; None: :data:`CPUINFO` (``/proc/cpuinfo``).
    """
    try:
        words = set(Path(cpuinfo or CPUINFO).read_text(errors="replace").split())
    except OSError:
        return None
    return tuple(f for f in CPU_BF16_FLAGS if f in words)


def native_bf16(cpuinfo: Optional[str] = None) -> Optional[bool]:
    """Whether this CPU computes bf16 natively (``avx512_bf16`` or ``amx_bf16``): True, False, or
    None where ``cpuinfo`` cannot be read (not Linux). Without it torch emulates bf16 products,
    slower than fp32 ones."""
    flags = cpu_bf16_flags(cpuinfo)
    return None if flags is None else bool(flags)


def choose_dtype(device: Optional[str], *, cpu_bf16_flags: Optional[Sequence[str]],
                 cuda_bf16: Optional[bool]) -> Tuple[str, str]:
    """What ``dtype: auto`` is on a device with these facts.

    Args:
        device (Optional[str]): ``cpu``, ``cuda``, ``cuda:N``, ...; None: not known.
        cpu_bf16_flags (Optional[Sequence[str]]): the native-bf16 flags the CPU lists
            (:func:`cpu_bf16_flags`); empty: none; None: not known. Read for a CPU device only.
        cuda_bf16 (Optional[bool]): whether the GPU multiplies bf16 natively; None: not known.
            Read for a CUDA device only.

    Returns:
        Tuple[str, str]: ``("bf16" or "fp32", the reason in words)``.
    """
    parsed = parse_device(device)
    kind = parsed.type if parsed is not None else None
    if kind == "cpu":
        if cpu_bf16_flags is None:
            return "fp32", "/proc/cpuinfo cannot be read, so whether this CPU has native bf16 is not known"
        if cpu_bf16_flags:
            return "bf16", f"this CPU multiplies bf16 natively: {', '.join(cpu_bf16_flags)} in /proc/cpuinfo"
        return "fp32", (f"this CPU has no native bf16 (neither {' nor '.join(CPU_BF16_FLAGS)} in /proc/cpuinfo): "
                        "torch would emulate bf16 products, slower than fp32")
    if kind == "cuda":
        if cuda_bf16 is None:
            return "fp32", "whether this GPU multiplies bf16 natively is not known (no CUDA device is visible)"
        if cuda_bf16:
            return "bf16", "this GPU multiplies bf16 natively (torch.cuda.is_bf16_supported(including_emulation=False))"
        return "fp32", ("this GPU has no native bf16 (compute capability below 8.0: "
                        "torch.cuda.is_bf16_supported(including_emulation=False) is False)")
    where = f"device={device}" if device is not None else "the device is not known"
    return "fp32", f"{where}: auto picks bf16 only on a CPU or CUDA GPU that multiplies it natively"


def default_device() -> str:
    """The device torchtune's ``get_device(None)`` picks (``device: null``): cuda, npu, xpu, then cpu."""
    if torch.cuda.is_available():
        return "cuda"
    from torchtune_ppo._patches.torchtune_modules import is_npu_available

    if is_npu_available:
        return "npu"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def machine_dtype(device: Optional[str]) -> Tuple[str, str]:
    """:func:`choose_dtype` with this machine's facts, read only for the device's kind.

    Args:
        device (Optional[str]): the config's ``device``; None: the one torchtune picks here.
    """
    device = default_device() if device is None else device
    parsed = parse_device(device)
    kind = parsed.type if parsed is not None else None
    flags = cpu_bf16_flags() if kind == "cpu" else None
    cuda = None
    if kind == "cuda" and torch.cuda.is_available():
        cuda = torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 is slower than fp32
    return choose_dtype(device, cpu_bf16_flags=flags, cuda_bf16=cuda)


def saved_dtype(output_dir: Union[str, Path]) -> Optional[Tuple[str, Path]]:
    """The dtype a run in ``output_dir`` was saved in: ``(dtype, step folder)`` from the newest
    ``checkpoints/step_<N>`` folder whose ``config.yaml`` reads, or None when there is none.

    Every step folder of a run holds the same dtype (it must match on resume). The folder is
    not verified (checksums) nor locked here: the resume does that later, and compares every
    key that must match. A saved config without ``dtype`` was saved with the default, fp32.
    """
    for _, folder in reversed(step_folders(output_dir)):
        try:
            saved = saved_config(folder)
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if not isinstance(saved, dict):
            continue
        dtype = saved.get("dtype", "fp32")
        if dtype in DTYPES:
            return dtype, folder
    return None


def resolve_auto_dtype(device: Optional[str], *, output_dir: Optional[str], resume: bool,
                       check_machine: bool) -> Tuple[str, str]:
    """What ``dtype: auto`` is for this run, and the note that says why.

    Args:
        device (Optional[str]): the config's ``device``.
        output_dir (Optional[str]): the run's output folder, read when ``resume``.
        resume (bool): ``resume_from_checkpoint``: the dtype of the newest saved config
            (:func:`saved_dtype`) wins over this machine's choice.
        check_machine (bool): False to plan a run for another machine
            (``torchtune_ppo.run.memory``): its facts are unknown, so ``auto`` is bf16 on a cuda
            device (:data:`PLANNED_CUDA_BF16`) and fp32 on any other, and no checkpoint is read.

    Returns:
        Tuple[str, str]: ``("fp32" or "bf16", the note)``, e.g. ``("bf16", "dtype=auto: bf16
        (this CPU multiplies bf16 natively: avx512_bf16 in /proc/cpuinfo).")``.
    """
    if not check_machine:
        dtype, _ = choose_dtype(device, cpu_bf16_flags=None, cuda_bf16=PLANNED_CUDA_BF16)
        return dtype, (f"dtype=auto: {dtype} (planning for another machine: auto is planned as bf16 on cuda, "
                       "fp32 on any other device; give dtype=bf16 or dtype=fp32 to plan that instead).")
    dtype, reason = machine_dtype(device)
    saved = saved_dtype(output_dir) if resume and output_dir is not None else None
    if saved is None:
        return dtype, f"dtype=auto: {dtype} ({reason})."
    kept, folder = saved
    if kept == dtype:
        return kept, f"dtype=auto: {kept}, as the checkpoint {folder} was saved ({reason})."
    return kept, (f"dtype=auto: resuming in {kept} as the checkpoint {folder} was saved; this machine would "
                  f"choose {dtype}: {reason}.")
