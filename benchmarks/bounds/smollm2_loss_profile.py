"""Where an eager loss micro-step of SmolLM2-135M spends its time: torch.profiler's op table.

Random weights, fp32 or bf16 (``--dtype``), the ``bench_ppo.py --smollm2`` micro-step: 8 packed rows of 43 tokens,
the policy's logprobs at 96 reads (tied output layer, log-softmax), the value model's head at
the same reads, backward through both. Prints the step's time, ``aten::mm``'s share of the
profiled self time, and the op table.

    OMP_NUM_THREADS=1 python benchmarks/bounds/smollm2_loss_profile.py [--dtype bf16]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torchtune_ppo._patches.torchtune_modules import final_hidden_states, use_fp32_attention
from torchtune_ppo.models import smollm2_135m, smollm2_135m_classifier

R, L, K, VOCAB = 8, 43, 96, 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the models' weights and compute (bf16: AMX where the CPU has it)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    policy = smollm2_135m(max_seq_len=256).to(dtype)
    value = smollm2_135m_classifier(max_seq_len=256).to(dtype)
    if dtype == torch.bfloat16:  # as the recipe builds bf16 models on CPU (models/build.py)
        use_fp32_attention(policy), use_fp32_attention(value)
    tokens = torch.randint(0, VOCAB, (R, L))
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool)).expand(R, L, L)
    pos = torch.arange(L).expand(R, L)
    reads, targets = torch.randint(0, R * L, (K,)), torch.randint(0, VOCAB, (K,))

    def step():
        h = final_hidden_states(policy, tokens, mask=mask, input_pos=pos).reshape(R * L, -1)[reads]
        logprobs = torch.log_softmax(policy.output(h).float(), -1).gather(1, targets[:, None])
        hv = final_hidden_states(value, tokens, mask=mask, input_pos=pos).reshape(R * L, -1)[reads]
        (logprobs.sum() + value.output(hv).square().sum()).backward()
        policy.zero_grad(set_to_none=True)
        value.zero_grad(set_to_none=True)

    step()
    start = time.perf_counter()
    step()
    print(f"eager micro-step {time.perf_counter() - start:.2f} s, {args.dtype}, {torch.get_num_threads()} threads")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    mm = sum(e.self_cpu_time_total for e in ops if e.key == "aten::mm")
    print(f"aten::mm: {mm / total:.0%} of the self time")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
