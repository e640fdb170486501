"""What ``master_rounding: dither`` costs the optimizer step, against round to nearest.

Parameters of SmolLM2-135M's policy and value model (their shapes, random bf16 values, random
bf16 gradients), fp32 masters and AdamW, stepped the two ways the recipe steps them: the
one-pass step compiled by inductor (``compile.optimizer``, the shipped SmolLM2 configs) and the
four eager passes (``compile.optimizer: false``). Each way with ``nearest`` and ``dither``,
the two roundings alternating step by step (``round_order``), after ``--warmup`` steps each;
prints each row's median step and the per-pair ratio nearest / dither with its interval
(below 1: dither is slower).

    python benchmarks/precision/bench_master_rounding.py [--steps 12] [--paths fused,eager]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from bench_common.interleave import round_order  # noqa: E402
from bench_common.stats import format_ratio, summarize_ratios  # noqa: E402

from torchtune_ppo.compile import maybe_compile  # noqa: E402
from torchtune_ppo.models import smollm2_135m, smollm2_135m_classifier  # noqa: E402
from torchtune_ppo.run.optim import MasterStep, MasterWeights, adam_master_step, grad_sq_sum  # noqa: E402


def shapes():
    with torch.device("meta"):
        models = (smollm2_135m(), smollm2_135m_classifier())
    return [tuple(p.shape) for m in models for p in m.parameters()]


def setup(rounding: str, fused: bool, step_fn):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((0.05 * torch.randn(s, generator=g)).to(torch.bfloat16)) for s in shapes()]
    grads = [(1e-3 * torch.randn(s, generator=g)).to(torch.bfloat16) for s in shapes()]
    master = MasterWeights(params, step_fn if fused else None, rounding=rounding)
    optimizer = torch.optim.AdamW(master.masters, lr=1e-5, weight_decay=0.0, fused=True)
    return params, grads, master, optimizer


def one_step(state, fused: bool) -> float:
    params, grads, master, optimizer = state
    for p, g in zip(params, grads):
        p.grad = g.clone()
    start = time.perf_counter()
    if fused:
        master.fused_step(optimizer, master.grad_norm(), 1.0)
    else:
        master.take_grads()
        torch.nn.utils.clip_grad_norm_(master.masters, max_norm=1.0)
        optimizer.step()
        master.write_back()
    seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    master.zero_grad()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="measured steps of each row")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--paths", default="fused,eager")
    args = ap.parse_args()
    # what the recipe builds for compile.optimizer (torchtune_ppo.compile): the Adam step and the
    # clip norm's sums of squares, both compiled
    step_fn = MasterStep(step=maybe_compile(adam_master_step, enabled=True, dynamic=True),
                         sq_sum=maybe_compile(grad_sq_sum, enabled=True, dynamic=True))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sum(torch.Size(s).numel() for s in shapes()) / 1e6:.0f}M parameters")
    for path in args.paths.split(","):
        fused = path == "fused"
        names = ["nearest", "dither"]
        states = {n: setup(n, fused, step_fn) for n in names}
        times = {n: [] for n in names}
        for i in range(args.warmup + args.steps):
            for n in round_order(names, i):
                s = one_step(states[n], fused)
                if i >= args.warmup:
                    times[n].append(s)
        ratios = [a / b for a, b in zip(times["nearest"], times["dither"])]
        print(f"{path}: nearest {statistics.median(times['nearest']):.3f} s, dither "
              f"{statistics.median(times['dither']):.3f} s a step; nearest / dither "
              f"{format_ratio(summarize_ratios(ratios), spread=True)}")
        del states


if __name__ == "__main__":
    main()
