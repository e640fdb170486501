"""Decode-step products at a few rows on this CPU: one weight hot in cache, and SmolLM2-135M's 30
layers' weights streamed from memory, unfused (q, k, v, o, gate, up, down) against fused
(qkv and gate+up as one weight each). bf16, torch's threads; median of repeated calls.

    OMP_NUM_THREADS=2 python benchmarks/bounds/decode_products.py
"""

import time

import torch

DIM, KV, MLP, LAYERS = 576, 192, 1536, 30


def _median(fn, n=30):
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    dt = torch.bfloat16
    for m in (16, 32, 64, 128):
        x = torch.randn(m, DIM).to(dt)
        for out in (MLP, 2 * MLP, DIM + 2 * KV):
            w = torch.randn(out, DIM).to(dt)
            s = _median(lambda: x @ w.t(), 50)
            print(f"{m} rows x [{out}, {DIM}] hot: {s * 1e6:.0f} us, {2 * m * out * DIM / s / 1e9:.0f} GFLOP/s")
    shapes = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (MLP, DIM), (MLP, DIM), (DIM, MLP)] * LAYERS
    ws = [torch.randn(s).to(dt) for s in shapes]
    xs = {n: torch.randn(16, n).to(dt) for n in (DIM, MLP)}
    s = _median(lambda: [xs[w.shape[1]] @ w.t() for w in ws], 20)
    nbytes = sum(w.numel() * 2 for w in ws)
    print(f"30 layers unfused, 16 rows, streamed: {s * 1e3:.1f} ms ({nbytes / s / 1e9:.1f} GB/s of weights)")
    fused = [(torch.randn(DIM + 2 * KV, DIM).to(dt), torch.randn(DIM, DIM).to(dt), torch.randn(2 * MLP, DIM).to(dt),
              torch.randn(DIM, MLP).to(dt)) for _ in range(LAYERS)]
    s = _median(lambda: [(xs[DIM] @ a.t(), xs[DIM] @ b.t(), xs[DIM] @ c.t(), xs[MLP] @ d.t()) for a, b, c, d in fused], 20)
    print(f"30 layers fused (qkv, gate+up), 16 rows, streamed: {s * 1e3:.1f} ms; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
