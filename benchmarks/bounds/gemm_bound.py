"""The GEMM throughput that bounds a PPO step on this machine's CPU, for benchmarks/RESULTS.md.

Two numbers, fp32, torch's default threads:

- the loss step's GEMM: ``[575, 256] @ [256, 768]`` (a packed micro-step of the 8-layer
  ``--cpu-large`` model times its MLP weight), repeated on one hot weight: the FLOP rate a
  compute-bound step can reach;
- a decode step's GEMMs: ``[16, D]`` inputs times the 56 weight matrices of that 8-layer
  policy in turn, as ``nn.Linear`` lays them out (``x @ W.t()``): the time one decode step of
  16 rows cannot go below, and the rate at which it streams the weights.

    python benchmarks/bounds/gemm_bound.py
    python benchmarks/bounds/gemm_bound.py --smollm2   # per phase on SmolLM2-135M: smollm2_bound.py
"""

import sys
import time
from pathlib import Path

import torch

DIM, MLP, KV, LAYERS, ROWS, TOKENS = 256, 768, 128, 8, 16, 575


def _seconds(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(TOKENS, DIM, generator=g), torch.randn(DIM, MLP, generator=g)
    s = _seconds(lambda: a @ b, 200)
    print(f"loss-step GEMM [{TOKENS}, {DIM}] @ [{DIM}, {MLP}]: {2 * TOKENS * DIM * MLP / s / 1e9:.0f} GFLOP/s")

    # q, k, v, o, gate, up, down of each layer, as nn.Linear weights [out, in]
    shapes = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (MLP, DIM), (MLP, DIM), (DIM, MLP)] * LAYERS
    weights = [torch.randn(shape, generator=g) for shape in shapes]
    inputs = {n: torch.randn(ROWS, n, generator=g) for n in (DIM, MLP)}
    s = _seconds(lambda: [inputs[w.shape[1]] @ w.t() for w in weights], 30)
    flops = sum(2 * ROWS * o * i for o, i in shapes)
    weight_bytes = sum(o * i * 4 for o, i in shapes)
    print(f"decode GEMMs, {ROWS} rows x {len(weights)} weights ({weight_bytes / 2**20:.0f} MiB): "
          f"{s * 1e3:.2f} ms per step, {flops / s / 1e9:.0f} GFLOP/s, {weight_bytes / s / 1e9:.1f} GB/s")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    if "--smollm2" in sys.argv[1:]:
        sys.path.insert(0, str(Path(__file__).parent))
        import smollm2_bound

        smollm2_bound.main([a for a in sys.argv[1:] if a != "--smollm2"])
    else:
        main()
