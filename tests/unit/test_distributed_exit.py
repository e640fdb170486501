"""The process group is left at exit, while the interpreter is alive: a gloo group left to the
interpreter's teardown can abort a run that finished (SIGABRT, "terminate called without an
active exception"), which torchrun reports as a failed run."""

import socket
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")

SCRIPT = textwrap.dedent("""
    import atexit, torch, torch.distributed as dist
    from torchtune_ppo import distributed
    assert distributed.init_distributed(torch.device("cpu")) and dist.is_initialized()
    x = torch.ones(3)
    dist.all_reduce(x)  # the group did work, as a run's does
    atexit._run_exitfuncs()  # what the interpreter runs at exit, before its teardown
    print("initialized after exit functions:", dist.is_initialized())
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_process_group_is_destroyed_by_the_exit_functions():
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialized after exit functions: False" in proc.stdout, proc.stdout


def test_shutdown_without_a_group_is_a_no_op():
    from torchtune_ppo import distributed

    assert not torch.distributed.is_initialized()
    distributed.shutdown()
