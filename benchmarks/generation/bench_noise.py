"""The sampler's noise on the CPU: torch's ``exponential_`` against ``exponential_noise``.

Both fill the same ``[B, V]`` float32 buffer with the same draws (``exponential_noise`` is
bit for bit torch's CPU ``exponential_``, vectorised: the script checks it); this measures
what that is worth. Two measurements, in one process:

- one draw of the SmolLM2 decode step's ``[16, 49152]`` noise, each way, alternating;
- whole ``Generator.generate`` calls on SmolLM2-135M's shapes (random weights; 16 rows, P = 32,
  T = 12, no stop tokens, temperature 0.7, full vocabulary), the Generator drawing its noise
  one way or the other, rounds alternating and the order reversed each round
  (``benchmarks/bench_common``). ``--compile`` compiles its prefill and decode step
  (dynamo on inductor; the first call compiles).

    python benchmarks/generation/bench_noise.py --dtype bf16 --compile --rounds 12
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from bench_common.interleave import round_order  # noqa: E402
from bench_common.machine import cpu_model, git_commit  # noqa: E402
from bench_common.stats import format_ratio, summarize_ratios  # noqa: E402

import torchtune_ppo.rollout.generation as generation  # noqa: E402
from torchtune_ppo._patches.torchtune_modules import use_fp32_attention  # noqa: E402
from torchtune_ppo.compile import generation_steps  # noqa: E402
from torchtune_ppo.models import smollm2_135m  # noqa: E402
from torchtune_ppo.rollout.generation import EAGER_STEPS, Generator  # noqa: E402
from torchtune_ppo.rollout.sampling import exponential_noise  # noqa: E402

B, P, T, VOCAB = 16, 32, 12, 49152


def torch_exponential(out, generator=None):
    return out.exponential_(generator=generator)


DRAWS = {"torch exponential_": torch_exponential, "exponential_noise": exponential_noise}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--compile", action="store_true", help="compile the prefill and decode step")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds, after 2 warm-up ones")
    args = ap.parse_args()
    torch.manual_seed(0)
    buf = torch.empty(B, VOCAB)
    same = torch.equal(exponential_noise(buf.clone(), torch.Generator().manual_seed(0)),
                       buf.clone().exponential_(generator=torch.Generator().manual_seed(0)))
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"commit {git_commit(Path(__file__).resolve().parents[2])}; the draws equal: {same}")

    draw_s = {name: [] for name in DRAWS}
    for i in range(40):
        for name in round_order(list(DRAWS), i):
            start = time.perf_counter()
            DRAWS[name](buf)
            draw_s[name].append(time.perf_counter() - start)
    for name, ts in draw_s.items():
        print(f"one [{B}, {VOCAB}] draw, {name}: {statistics.median(ts[4:]) * 1e3:.2f} ms")
    ratio = summarize_ratios([a / b for a, b in zip(draw_s["torch exponential_"][4:],
                                                      draw_s["exponential_noise"][4:])])
    print(f"  draw speed-up {format_ratio(ratio)}")

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    policy = smollm2_135m(max_seq_len=256).to(dtype)
    if dtype == torch.bfloat16:  # as the recipe builds bf16 models on the CPU
        use_fp32_attention(policy)
    steps = generation_steps(compiled=True) if args.compile else EAGER_STEPS
    gen = Generator(policy, batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=0,
                    stop_token_ids=[], temperature=0.7, steps=steps)
    prompts = torch.randint(1, VOCAB, (B, P))
    lens = torch.randint(P - 12, P + 1, (B,))
    call_s = {name: [] for name in DRAWS}
    for i in range(2 + args.rounds):
        for name in round_order(list(DRAWS), i):
            generation.exponential_noise = DRAWS[name]
            start = time.perf_counter()
            gen.generate(prompts, lens, rng=torch.Generator().manual_seed(i))
            call_s[name].append(time.perf_counter() - start)
    generation.exponential_noise = exponential_noise
    for name, ts in call_s.items():
        print(f"generate call ({args.dtype}, {'compiled' if args.compile else 'eager'}), {name}: "
              f"{statistics.median(ts[2:]):.3f} s")
    ratio = summarize_ratios([a / b for a, b in zip(call_s["torch exponential_"][2:],
                                                      call_s["exponential_noise"][2:])])
    print(f"  generate speed-up {format_ratio(ratio)} over {args.rounds} pairs")


if __name__ == "__main__":
    main()
