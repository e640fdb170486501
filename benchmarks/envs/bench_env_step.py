"""What one environment step costs the rollout, by where it runs (``turns.isolation``).

Times ``safe_step`` on the calculator (a well-behaved environment: ~10 us of its own work) called
directly (``turns.timeout_s: null``), in a worker thread and in a forked worker process, and the
fork of a fresh worker (paid once, and again after each step that overran). A conversation of a
few turns, as the rollout passes it. Median and p90 over ``--calls`` calls, after a warm-up.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/envs/bench_env_step.py --calls 2000 [--ballast-mb 2000]
"""

import argparse
import statistics
import time

from torchtune_ppo.envs import Calculator, Conversation, safe_step
from torchtune_ppo.envs import base


def _times(fn, n: int):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, times) -> str:
    times = sorted(times)
    return (f"{name:<28} median {statistics.median(times) * 1e6:8.1f} us   "
            f"p90 {times[int(0.9 * (len(times) - 1))] * 1e6:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--ballast-mb", type=int, default=0,
                        help="import torch and hold this many MB of tensors first, as a run holds its models "
                             "(a fork copies the page tables)")
    args = parser.parse_args()
    if args.ballast_mb:
        import torch

        ballast = torch.ones(args.ballast_mb * 2**20 // 4)  # noqa: F841 (kept alive until the end)
    env = Calculator()
    conv = Conversation(prompt="What is 347 * 29? Use the calculator. " * 4,
                        turns=(("assistant", "I need <calc>347 * 2</calc>"), ("tool", "694")) * 2,
                        reference="10063", seed=12345)
    turn = "Then <calc>347 * 29</calc>"
    for name, kw in (("direct (timeout_s: null)", dict(timeout_s=None)),
                     ("thread", dict(timeout_s=10.0, isolation="thread")),
                     ("process", dict(timeout_s=10.0, isolation="process"))):
        call = lambda: safe_step(env, conv, turn, **kw)  # noqa: E731
        assert call()[1] is None
        _times(call, 200)  # warm-up (the worker forks at the first call)
        print(_row(name, _times(call, args.calls)), flush=True)

    def fresh():
        base._WORKERS.close()
        safe_step(env, conv, turn, timeout_s=10.0, isolation="process")

    print(_row("process: fork + first call", _times(fresh, args.forks)), flush=True)


if __name__ == "__main__":
    main()
