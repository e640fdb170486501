"""Where an eager loss micro-step of SmolLM2-135M spends its time: torch.profiler's op table.

Random weights, fp32 or bf16 (``--dtype``), the ``bench_ppo.py --smollm2`` micro-step: 8 packed rows of 43 tokens,
the policy's logprobs at 96 reads (tied output layer, log-softmax), the value model's head at
the same reads, backward through both. Prints the step's time, ``aten::mm``'s share of the
profiled self time, and the op table. ``--compile`` compiles the forward as the recipe's
``compile.loss_step`` does (inductor, static shapes; AOTAutograd compiles the backward) and
names inductor's own kernels in the table (``cpp.enable_kernel_profile``); its first call
compiles for minutes on 2 cores. bf16 models get the recipe's token embeddings
(``Fp32GradEmbedding``); ``--plain-embeddings`` keeps ``nn.Embedding``. ``--ab N`` profiles
nothing: it builds both kinds side by side and times N rounds of their micro-steps alternating
(``benchmarks/bench_common``), the speed-up with its interval. ``--grad-alone`` times the token
embedding's backward alone (the micro-step's 344 token rows into a ``[49152, 576]`` gradient),
bf16 and fp32, compiled and eager, and prints how far torch's bf16 kernel lands from the fp32 sum
when tokens repeat (20 distinct ones).

    OMP_NUM_THREADS=1 python benchmarks/bounds/smollm2_loss_profile.py [--dtype bf16] [--compile]
    python benchmarks/bounds/smollm2_loss_profile.py --dtype bf16 --compile --ab 12
    python benchmarks/bounds/smollm2_loss_profile.py --grad-alone
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchtune_ppo._patches.torchtune_modules import final_hidden_states, use_fp32_attention
from torchtune_ppo.compile import maybe_compile
from torchtune_ppo.models import smollm2_135m, smollm2_135m_classifier
from torchtune_ppo.models.embedding import use_fp32_grad_embeddings

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from bench_common.interleave import round_order  # noqa: E402
from bench_common.stats import format_ratio, summarize_ratios  # noqa: E402

R, L, K, VOCAB = 8, 43, 96, 49152


def micro_step(dtype: torch.dtype, *, compiled: bool, fp32_grad_embeddings: bool):
    """The micro-step (forward, backward, gradients freed) on a new policy and value model."""
    torch.manual_seed(0)
    policy = smollm2_135m(max_seq_len=256).to(dtype)
    value = smollm2_135m_classifier(max_seq_len=256).to(dtype)
    if dtype == torch.bfloat16:  # as the recipe builds bf16 models on CPU (models/build.py)
        use_fp32_attention(policy), use_fp32_attention(value)
        if fp32_grad_embeddings:
            use_fp32_grad_embeddings(policy), use_fp32_grad_embeddings(value)
    tokens = torch.randint(0, VOCAB, (R, L))
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool)).expand(R, L, L)
    pos = torch.arange(L).expand(R, L)
    reads, targets = torch.randint(0, R * L, (K,)), torch.randint(0, VOCAB, (K,))

    def forward():
        h = final_hidden_states(policy, tokens, mask=mask, input_pos=pos).reshape(R * L, -1)[reads]
        logprobs = torch.log_softmax(policy.output(h).float(), -1).gather(1, targets[:, None])
        hv = final_hidden_states(value, tokens, mask=mask, input_pos=pos).reshape(R * L, -1)[reads]
        return logprobs.sum() + value.output(hv).square().sum()

    loss_fn = maybe_compile(forward, enabled=compiled)

    def step():
        loss_fn().backward()
        policy.zero_grad(set_to_none=True)
        value.zero_grad(set_to_none=True)

    return step


def ab(dtype: torch.dtype, compiled: bool, rounds: int) -> None:
    steps = {name: micro_step(dtype, compiled=compiled, fp32_grad_embeddings=name == "Fp32GradEmbedding")
             for name in ("nn.Embedding", "Fp32GradEmbedding")}
    times = {name: [] for name in steps}
    for i in range(2 + rounds):  # 2 warm-up rounds (the first compiles)
        for name in round_order(list(steps), i):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{'compiled' if compiled else 'eager'} micro-step, {name}: {statistics.median(ts[2:]):.3f} s")
    ratio = summarize_ratios([a / b for a, b in zip(times["nn.Embedding"][2:], times["Fp32GradEmbedding"][2:])])
    print(f"  speed-up {format_ratio(ratio)} over {rounds} pairs")


def grad_alone() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (R * L,))

    def backward(emb, out_grad, ids=ids):
        emb.weight.grad = None
        (emb(ids) * out_grad).sum().backward()

    def loss(emb, out_grad):
        return (emb(ids) * out_grad).sum()

    compiled_loss = torch.compile(loss)

    def compiled(emb, out_grad):
        emb.weight.grad = None
        compiled_loss(emb, out_grad).backward()

    for dtype in (torch.bfloat16, torch.float32):
        out_grad = torch.randn(R * L, 576).to(dtype)
        plain = nn.Embedding(VOCAB, 576).to(dtype)
        ours = nn.Embedding(VOCAB, 576).to(dtype)
        use_fp32_grad_embeddings(ours)
        rows = {"nn.Embedding compiled": (compiled, plain), "nn.Embedding eager": (backward, plain),
                "Fp32GradEmbedding compiled": (compiled, ours)}
        times = {name: [] for name in rows}
        for i in range(24):  # the first 4 rounds warm up (and compile)
            for name in round_order(list(rows), i):
                fn, emb = rows[name]
                start = time.perf_counter()
                fn(emb, out_grad)
                times[name].append(time.perf_counter() - start)
        print(", ".join(f"{name} {statistics.median(ts[4:]) * 1e3:.1f} ms" for name, ts in times.items()),
              f"({dtype}, {torch.get_num_threads()} threads)")
    few = torch.randint(0, 20, (R * L,))
    out_grad = torch.randn(R * L, 576).to(torch.bfloat16)
    exact = torch.zeros(VOCAB, 576, dtype=torch.float64).index_add_(0, few, out_grad.double())
    backward(plain := nn.Embedding(VOCAB, 576).to(torch.bfloat16), out_grad, few)
    print(f"20 distinct tokens: torch's bf16 kernel {(plain.weight.grad.double() - exact).abs().max():.3f} off "
          f"the exact sum, one rounding of it {(exact.bfloat16().double() - exact).abs().max():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the models' weights and compute (bf16: AMX where the CPU has it)")
    ap.add_argument("--compile", action="store_true", help="compile the forward (and so the backward)")
    ap.add_argument("--plain-embeddings", action="store_true", help="bf16: keep nn.Embedding")
    ap.add_argument("--ab", type=int, default=0, metavar="N", help="time N rounds of both embeddings instead")
    ap.add_argument("--grad-alone", action="store_true", help="time the embedding's backward alone instead")
    ap.add_argument("--rows", type=int, default=14, help="rows of the op table")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.grad_alone:
        return grad_alone()
    if args.ab:
        return ab(dtype, args.compile, args.ab)
    if args.compile:
        torch._inductor.config.cpp.enable_kernel_profile = True
    step = micro_step(dtype, compiled=args.compile, fp32_grad_embeddings=not args.plain_embeddings)
    start = time.perf_counter()
    step()
    if args.compile:
        print(f"first call (compiling) {time.perf_counter() - start:.1f} s")
    step()
    start = time.perf_counter()
    step()
    print(f"{'compiled' if args.compile else 'eager'} micro-step {time.perf_counter() - start:.2f} s, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    mm = sum(e.self_cpu_time_total for e in ops if e.key == "aten::mm")
    print(f"aten::mm: {mm / total:.0%} of the self time")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
