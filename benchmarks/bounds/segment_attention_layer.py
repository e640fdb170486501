"""One attention layer on long packed rows: block-causal masks against attention by sequence.

Two packed rows of 620 slots as SmolLM2's long-answer workload packs them with the shared prompt
prefix (a 20-token prefix copy, then six sequences of 60-140 slots each; 14 sequences in all),
SmolLM2's 9 heads of 64, bf16 q/k/v through the recipe's attention (:func:`sdpa`: fp32 on the
CPU), forward and backward. Prints both times per call (medians of 10 after 3 warm-ups, twice)
and the op table of the by-sequence path (its gathers' backward is ``aten::_index_put_impl_``).

    python benchmarks/bounds/segment_attention_layer.py
"""

import statistics
import time

import torch
from torch.profiler import profile

from torchtune_ppo._patches.torchtune_modules import sdpa, segment_attention
from torchtune_ppo.rlhf import block_causal_masks
from torchtune_ppo.rlhf.segments import segment_layout

H, D, L, PREFIX = 9, 64, 620, 20
SEQUENCES = ([140, 120, 100, 90, 60, 80], [130, 110, 95, 85, 70, 100])


def packed_rows():
    """Flat segment and prefix ids of the two rows (unused slots: negative, their own)."""
    seg, pre, sid = [], [], 100
    for r, lens in enumerate(SEQUENCES):
        s, p = [r] * PREFIX, [r] * PREFIX
        for n in lens:
            s += [sid] * n
            p += [r] * n
            sid += 1
        unused = list(range(-1 - r * L, -1 - r * L - (L - len(s)), -1))
        seg += s + unused
        pre += p + unused
    return seg, pre


def main() -> None:
    torch.manual_seed(0)
    seg, pre = packed_rows()
    mask = block_causal_masks(torch.tensor(seg).view(2, L), torch.tensor(pre).view(2, L))
    layout = segment_layout(seg, pre, row_len=L)
    print(f"{len(SEQUENCES)} rows of {L} slots; layout q {tuple(layout.q_index.shape)}, "
          f"kv {tuple(layout.kv_index.shape)}; {torch.get_num_threads()} threads")

    def step(kind, q, k, v):
        out = sdpa(q, k, v, mask[:, None], 0.0, False) if kind == "masks" else segment_attention(q, k, v, layout, 0.0)
        out.sum().backward()

    def time_kind(kind):
        q, k, v = (torch.randn(2, H, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        times = []
        for i in range(13):
            start = time.perf_counter()
            step(kind, q, k, v)
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:]) * 1e3

    for _ in range(2):
        print(", ".join(f"{kind} {time_kind(kind):.2f} ms" for kind in ("masks", "by sequence")),
              "(forward and backward, one layer)")
    q, k, v = (torch.randn(2, H, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with profile() as prof:
        for _ in range(5):
            step("by sequence", q, k, v)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
