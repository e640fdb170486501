"""``dtype: auto``: bf16 where the device multiplies bf16 natively, fp32 elsewhere; decided once
in ``validate_config``, logged with its reason, and kept from the checkpoint on resume."""

import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the config resolvers)
from torchtune_ppo.checkpointing import check_resume_config, config_to_save
from torchtune_ppo.checkpointing.resume_config import ResumeConfigError
from torchtune_ppo.config import notes, precision, validate_config
from torchtune_ppo.config.precision import choose_dtype, cpu_bf16_flags, native_bf16
from torchtune_ppo.run import memory, preflight

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_arithmetic.yaml"
# Lines of a real /proc/cpuinfo (an Intel Xeon), with and without the bf16 flags.
FLAGS = "fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_vnni"


def _cpuinfo(path: Path, *extra: str) -> str:
    path.write_text(f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: {' '.join([FLAGS, *extra])}\n\n")
    return str(path)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Sets the flags this machine's CPU lists (the file ``precision`` reads), and forgets the
    notes already logged so that each test sees its own."""
    monkeypatch.setattr(notes, "NOTED", set())

    def set_flags(*flags: str, readable: bool = True) -> None:
        path = tmp_path / "cpuinfo"
        monkeypatch.setattr(precision, "CPUINFO", _cpuinfo(path, *flags) if readable else str(tmp_path / "none"))

    return set_flags


def _cfg(**overrides):
    cfg = OmegaConf.load(CONFIG)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def _notes(caplog):
    return [r.getMessage() for r in caplog.records if "dtype=auto" in r.getMessage()]


# --- the rule, on facts passed in ---------------------------------------------------------------


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_a_cpu_with_native_bf16_chooses_bf16(tmp_path, flag):
    path = _cpuinfo(tmp_path / "cpuinfo", flag)
    assert cpu_bf16_flags(path) == (flag,) and native_bf16(path) is True
    dtype, reason = choose_dtype("cpu", cpu_bf16_flags=cpu_bf16_flags(path), cuda_bf16=None)
    assert dtype == "bf16"
    assert reason == f"this CPU multiplies bf16 natively: {flag} in /proc/cpuinfo"


def test_a_cpu_without_native_bf16_chooses_fp32(tmp_path):
    path = _cpuinfo(tmp_path / "cpuinfo", "avx512_fp16", "bf16")  # neither flag, near names
    assert cpu_bf16_flags(path) == () and native_bf16(path) is False
    dtype, reason = choose_dtype("cpu", cpu_bf16_flags=(), cuda_bf16=True)  # a GPU's bf16 is no matter here
    assert dtype == "fp32" and "no native bf16 (neither avx512_bf16 nor amx_bf16" in reason


def test_unreadable_cpuinfo_chooses_fp32(tmp_path):
    missing = str(tmp_path / "missing")
    assert cpu_bf16_flags(missing) is None and native_bf16(missing) is None
    dtype, reason = choose_dtype("cpu", cpu_bf16_flags=None, cuda_bf16=None)
    assert dtype == "fp32" and "cannot be read" in reason


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_follows_the_gpus_bf16_support(device):
    amx = ("amx_bf16",)  # the host CPU's flags do not decide for a GPU
    assert choose_dtype(device, cpu_bf16_flags=amx, cuda_bf16=True)[0] == "bf16"
    dtype, reason = choose_dtype(device, cpu_bf16_flags=amx, cuda_bf16=False)
    assert dtype == "fp32" and "compute capability below 8.0" in reason
    assert choose_dtype(device, cpu_bf16_flags=amx, cuda_bf16=None)[0] == "fp32"


def test_other_devices_choose_fp32():
    for device in ("mps", "xpu", None):
        dtype, reason = choose_dtype(device, cpu_bf16_flags=("amx_bf16",), cuda_bf16=True)
        assert dtype == "fp32", device
    assert reason.startswith("the device is not known")


# --- validate_config ----------------------------------------------------------------------------


@pytest.mark.parametrize("flags, dtype", [(("amx_bf16",), "bf16"), ((), "fp32")])
def test_validate_config_resolves_auto_and_logs_why(machine, caplog, flags, dtype):
    machine(*flags)
    with caplog.at_level(logging.INFO):
        cfg = validate_config(_cfg(dtype="auto"))
    assert cfg.dtype == dtype
    assert config_to_save(cfg)["dtype"] == dtype  # what each checkpoint's config.yaml holds
    [note] = _notes(caplog)
    expected = ("this CPU multiplies bf16 natively: amx_bf16 in /proc/cpuinfo" if flags else
                "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16 in /proc/cpuinfo)")
    assert note.startswith(f"Note: dtype=auto: {dtype} ({expected}")


def test_resolved_bf16_gets_the_bf16_rules(machine):
    """The checks after the resolution read the concrete dtype: optimizer_in_bwd in bf16 trains the
    bf16 weights directly, as with an explicit dtype=bf16."""
    machine("avx512_bf16")
    cfg = validate_config(_cfg(dtype="auto", optimizer_in_bwd=True, gradient_accumulation_steps=1,
                               clip_grad_norm="null"))
    assert cfg.dtype == "bf16" and cfg.master_weights is False


@pytest.mark.parametrize("explicit, flags", [("fp32", ("avx512_bf16",)), ("bf16", ())])
def test_an_explicit_dtype_is_never_overridden(machine, caplog, explicit, flags):
    machine(*flags)  # this machine would choose the other dtype
    with caplog.at_level(logging.INFO):
        assert validate_config(_cfg(dtype=explicit)).dtype == explicit
        assert validate_config(_cfg(dtype="auto")).dtype != explicit
    assert len(_notes(caplog)) == 1  # only the auto run says anything


def test_auto_with_unreadable_cpuinfo_is_fp32(machine):
    machine(readable=False)
    assert validate_config(_cfg(dtype="auto")).dtype == "fp32"


def test_a_bad_dtype_names_auto_among_the_choices():
    with pytest.raises(ValueError, match=r"dtype must be one of \['fp32', 'bf16', 'auto'\], got 'bf17'"):
        validate_config(_cfg(dtype="bf17"))


# --- resume ------------------------------------------------------------------------------------


def _saved_run(output_dir: Path, step: int, text: str) -> Path:
    folder = output_dir / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(text)
    return folder


def test_resume_keeps_the_saved_dtype_and_says_both(machine, caplog, tmp_path):
    machine()  # this machine would choose fp32
    out = tmp_path / "run"
    folder = _saved_run(out, 2, "dtype: bf16\nbatch_size: 8\n")
    with caplog.at_level(logging.INFO):
        cfg = validate_config(_cfg(dtype="auto", output_dir=str(out), resume_from_checkpoint=True))
    assert cfg.dtype == "bf16"
    [note] = _notes(caplog)
    assert note == (f"Note: dtype=auto: resuming in bf16 as the checkpoint {folder} was saved; this machine "
                    "would choose fp32: this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16 in "
                    "/proc/cpuinfo): torch would emulate bf16 products, slower than fp32.")


def test_resume_reads_the_newest_step_folder_with_a_readable_config(machine, tmp_path):
    machine("amx_bf16")  # would choose bf16
    out = tmp_path / "run"
    _saved_run(out, 9, "dtype: bf16\n")
    _saved_run(out, 10, "dtype: fp32\n")  # newest by number (step_9 sorts after it as text)
    _saved_run(out, 11, "dtype: [\n")  # unreadable: skipped
    (out / "checkpoints" / "step_12").mkdir()  # no config.yaml: skipped
    _saved_run(out, 13, "dtype: bf16\n").rename(out / "checkpoints" / "step_13.damaged-20250101T000000Z")
    assert precision.saved_dtype(out) == ("fp32", out / "checkpoints" / "step_10")
    assert validate_config(_cfg(dtype="auto", output_dir=str(out), resume_from_checkpoint=True)).dtype == "fp32"


def test_resume_without_a_checkpoint_takes_the_machines_choice(machine, caplog, tmp_path):
    machine("avx512_bf16")
    with caplog.at_level(logging.INFO):
        cfg = validate_config(_cfg(dtype="auto", output_dir=str(tmp_path / "empty"), resume_from_checkpoint=True))
    assert cfg.dtype == "bf16"
    assert _notes(caplog) == ["Note: dtype=auto: bf16 (this CPU multiplies bf16 natively: avx512_bf16 in "
                              "/proc/cpuinfo)."]


def test_a_fresh_run_ignores_checkpoints_in_its_folder(machine, tmp_path):
    """resume_from_checkpoint=False: the saved dtype is not read (preflight then refuses the folder)."""
    machine("avx512_bf16")
    out = tmp_path / "run"
    _saved_run(out, 2, "dtype: fp32\n")
    assert validate_config(_cfg(dtype="auto", output_dir=str(out))).dtype == "bf16"


def test_the_resolved_dtype_passes_the_resume_check_and_an_explicit_other_one_does_not(machine, tmp_path):
    """The run saved in fp32 on a machine without native bf16, resumed with auto on one with it: fp32
    kept and the saved config agrees; an explicit bf16 is refused by the must-match check."""
    machine()
    out = tmp_path / "run"
    first = validate_config(_cfg(dtype="auto", output_dir=str(out)))
    folder = _saved_run(out, 2, OmegaConf.to_yaml(OmegaConf.create(config_to_save(first))))
    machine("amx_bf16")
    resumed = validate_config(_cfg(dtype="auto", output_dir=str(out), resume_from_checkpoint=True))
    assert resumed.dtype == "fp32"
    assert check_resume_config(folder, resumed) == []
    explicit = validate_config(_cfg(dtype="bf16", output_dir=str(out), resume_from_checkpoint=True))
    with pytest.raises(ResumeConfigError, match=r"dtype: saved 'fp32', now 'bf16'"):
        check_resume_config(folder, explicit)


# --- planning for another machine, and the preflight warning ----------------------------------


@pytest.mark.parametrize("device, dtype", [("cuda", "bf16"), ("cpu", "fp32")])
def test_the_memory_planner_never_sees_auto(machine, caplog, device, dtype):
    machine("amx_bf16")  # this machine's CPU is no matter when planning for another one
    with caplog.at_level(logging.INFO):
        cfg = validate_config(_cfg(dtype="auto", device=device), check_machine=False)
    assert cfg.dtype == dtype
    assert "planning for another machine" in _notes(caplog)[0]
    plan = memory.memory_plan(cfg)
    explicit = memory.memory_plan(validate_config(_cfg(dtype=dtype, device=device), check_machine=False))
    assert plan.rows == explicit.rows


def test_preflight_warns_with_the_same_reader(machine):
    machine()
    assert preflight.native_bf16 is precision.native_bf16
    assert preflight.native_bf16() is False  # reads precision.CPUINFO, as auto does
    machine("avx512_bf16")
    assert preflight.native_bf16() is True
