"""Inductor compile time of SmolLM2-135M's 30 layers: unrolled (as the recipe's regions compile
them) against one layer compiled once and reused (``torch.compiler.nested_compile_region``).

A measurement only: the recipe does not use nested regions. One process per variant, a fresh
inductor cache each (``TORCHINDUCTOR_CACHE_DIR`` in a new temporary folder, FX graph cache off),
random weights (compile time does not depend on them), fp32, 8 rows of 43 tokens (a loss-step
micro-step of ``bench_ppo.py --smollm2``). The region is the trunk up to the final norm
(``final_hidden_states``), forward only (``fwd``) or forward and backward (``fwdbwd``). Prints
the first call's time (trace + compile + run), the median of 7 steady calls, and the max
difference from eager. With ``--warm DIR`` the inductor cache is ``DIR`` with the FX graph cache
on: the first run in a new ``DIR`` is cold, a second run with the same ``DIR`` is a warm start
(dynamo traces again; inductor and AOTAutograd read their caches), as a second training run is.

    python benchmarks/bounds/smollm2_compile_time.py unrolled fwd
    python benchmarks/bounds/smollm2_compile_time.py nested fwdbwd --warm /tmp/cache_nested
"""

import os
import statistics
import sys
import tempfile
import time

WARM = sys.argv[sys.argv.index("--warm") + 1] if "--warm" in sys.argv else None
os.environ["TORCHINDUCTOR_CACHE_DIR"] = WARM or tempfile.mkdtemp(prefix="inductor_")

import torch  # noqa: E402
from torchtune.modules import TransformerSelfAttentionLayer  # noqa: E402

from torchtune_ppo._patches.torchtune_modules import final_hidden_states  # noqa: E402
from torchtune_ppo.models import smollm2_135m  # noqa: E402

ROWS, LEN = 8, 43


def main(variant: str, what: str) -> None:
    torch._inductor.config.fx_graph_cache = WARM is not None
    torch.manual_seed(0)
    model = smollm2_135m(max_seq_len=256)
    tokens = torch.randint(0, 49152, (ROWS, LEN))
    mask = torch.tril(torch.ones(LEN, LEN, dtype=torch.bool)).expand(ROWS, LEN, LEN)
    pos = torch.arange(LEN).expand(ROWS, LEN)

    def region(model, tokens, mask, pos):
        return final_hidden_states(model, tokens, mask=mask, input_pos=pos)

    def run(fn):
        if what == "fwd":
            with torch.no_grad():
                return fn(model, tokens, mask, pos)
        model.zero_grad(set_to_none=True)
        h = fn(model, tokens, mask, pos)
        h.square().mean().backward()
        return h.detach()

    expected = run(region)
    if variant == "nested":  # one traced and compiled subgraph, called by all 30 layers
        TransformerSelfAttentionLayer.forward = torch.compiler.nested_compile_region(
            TransformerSelfAttentionLayer.forward)
    compiled = torch.compile(region, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    out = run(compiled)
    first = time.perf_counter() - start
    times = []
    for _ in range(7):
        start = time.perf_counter()
        run(compiled)
        times.append(time.perf_counter() - start)
    steady = statistics.median(times)
    print(f"{variant} {what}{' (cache ' + WARM + ')' if WARM else ''}: first call {first:.1f} s, "
          f"steady call {steady:.3f} s (median of 7, {min(times):.3f}-{max(times):.3f}), "
          f"max |compiled - eager| {(out - expected).abs().max().item():.2e}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main(*sys.argv[1:3])
