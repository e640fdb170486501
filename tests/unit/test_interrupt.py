"""``run/interrupt.py``: SIGHUP (a closed terminal, a dropped ssh connection) stops a run as
SIGTERM does, and the printed resume command can be pasted into a shell as is."""

import os
import shlex
import signal
import time

import pytest
from omegaconf import OmegaConf

from torchtune_ppo.run.interrupt import resume_command, stop_on_signals

needs_sighup = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")


def _signal_self(sig, until, seconds=2.0):
    """Send ``sig`` to this process, then wait in short sleeps (between which Python runs its
    signal handlers) until ``until()`` or ``seconds``."""
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def sighup_caught():
    """SIGHUP caught by a recorder around the test: were the run's handler missing, a SIGHUP
    would land there (not end the test process), and it must be back afterwards."""
    caught = []
    recorder = lambda signum, frame: caught.append(signum)  # noqa: E731
    before = signal.signal(signal.SIGHUP, recorder)
    try:
        yield caught, recorder
    finally:
        signal.signal(signal.SIGHUP, before)


@needs_sighup
def test_sighup_asks_to_stop_as_sigterm_does_and_the_handlers_are_restored(sighup_caught):
    caught, recorder = sighup_caught
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with stop_on_signals() as stop:
        assert not stop
        _signal_self(signal.SIGHUP, until=lambda: bool(stop) or bool(caught))
        assert stop and stop.signum == signal.SIGHUP and not caught  # no exit: the step goes on
        # A second SIGHUP gets the default action (ends the process at once, without saving).
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.getsignal(signal.SIGHUP) is recorder


@needs_sighup
def test_sighup_ignored_at_start_stays_ignored():
    """`nohup tune run ...` starts the run with SIGHUP ignored so that it outlives its terminal."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_on_signals() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # still handled
            _signal_self(signal.SIGHUP, until=lambda: bool(stop), seconds=0.2)
            assert not stop
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_resume_command_pasted_in_a_shell_gives_back_list_overrides(tmp_path):
    argv = ["ppo_full_finetune", "--config", "my run.yaml", "policy_model.lora_attn_modules=[q_proj, v_proj]",
            "dataset.data_files=['a b.json', 'it''s.json']", f"output_dir={tmp_path}/old", "seed=1"]
    out = f"{tmp_path}/a run"
    words = shlex.split(resume_command(argv, out))
    assert words == ["tune", "run", *argv[:5], "seed=1", f"output_dir={out}", "resume_from_checkpoint=True"]
    parsed = OmegaConf.from_dotlist(words[5:])
    assert parsed.policy_model.lora_attn_modules == ["q_proj", "v_proj"]
    assert parsed.dataset.data_files == ["a b.json", "it's.json"] and parsed.output_dir == out
