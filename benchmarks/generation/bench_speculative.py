"""Speculative rollouts against plain decoding on SmolLM2-135M-Instruct: the same prompts, the
same position-keyed noise, so both variants sample the same responses, token for token (checked
every round), and only the forwards that compute them differ.

A visit of the batch's prompts (an "epoch") generates with the policy as it is; the next visit
uses those responses as drafts, after the policy moved: ``--drift`` adds Gaussian noise of that
standard deviation, relative to each weight tensor's own, to every weight between visits (0: the
policy unchanged). With ``--noise per_step`` each visit draws fresh noise (the draft is the
previous visit's sample of another draw), with ``per_prompt`` the visits share it (an unchanged
policy samples its draft again).

Each round runs one visit: ``plain`` (compiled prefill and decode, keyed noise) and ``drafted``
(compiled prefill and verification with the previous visit's responses), taking turns, the order
reversed every round; a fresh drift is added after every round, so each round's pair meets the
same weights. Reported: the per-round ratio plain / drafted of the generate call (median and
95% interval, ``benchmarks/bench_common``), the acceptance, tokens per forward and forwards of
each, and the response lengths.

    python benchmarks/generation/bench_speculative.py                          # long answers, T=128
    python benchmarks/generation/bench_speculative.py --noise per_prompt --drift 1e-3 --out spec.json
    python benchmarks/generation/bench_speculative.py --workload arithmetic -T 12    # the config's answers
    python benchmarks/generation/bench_speculative.py --keyed-overhead -T 64        # keyed noise, no drafts
    python benchmarks/generation/bench_speculative.py --noise-cost                  # the draws alone

``--noise-cost`` times the noise alone, no model: ``exponential_noise`` of ``[batch, 49152]`` (a
decode step's draws from the run generator) against ``keyed_noise`` of ``[batch, 1, 49152]`` and
``[batch, draft_tokens + 1, 49152]``, median of 30 calls (10 for the chunk).

``--keyed-overhead`` measures what position-keyed noise costs when there is no draft (a run's
first epoch): plain decoding drawing its noise from the run's generator (``rng``) against the
same with ``noise_keys`` (``keyed``), no stop tokens so that both run all ``T`` steps, the same
rounds and statistics.

Prepare the model first (``python tools/prepare_smollm2.py``). The prompts are the SmolLM2 chat
arithmetic config's (``recipes/configs/smollm2/135M_ppo_arithmetic.yaml``): ``--workload long``
(default) as ``benchmarks/ppo/bench_ppo.py --workload long`` asks them: variants.json's ood
questions with neither the system line nor the reply prefix, which SmolLM2 answers at length;
``arithmetic``: the training prompts as the config asks them ("Answer with the number only.").
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
from bench_common.machine import machine_info  # noqa: E402
from bench_common.stats import format_ratio, summarize_ratios  # noqa: E402

CONFIG = ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml"
LONG_DATASET = dict(data_files="${ppo_asset:chat_arithmetic/variants.json}", field="ood", system_prompt=None,
                    response_prefix=None)


def load(args):
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    import torchtune_ppo  # noqa: F401  (the ppo_asset resolver)
    cfg = OmegaConf.load(CONFIG)
    cfg.output_dir = args.scratch
    if args.workload == "long":
        cfg.dataset.update(LONG_DATASET)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    data = tt_config.instantiate(cfg.dataset, tokenizer)
    prompts = [data[i]["tokens"] for i in range(args.batch)]
    P = max(len(p) for p in prompts)
    tokens = torch.full((args.batch, P), tokenizer.pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, P - len(p):] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    model = tt_config.instantiate(cfg.policy_model)
    ckpt = tt_config.instantiate(cfg.checkpointer)
    model.load_state_dict(ckpt.load_checkpoint()["model"])
    return model.to(args.dtype).requires_grad_(False), tokens, lens, list(cfg.stop_token_ids), tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["long", "arithmetic"], default="long")
    p.add_argument("-T", "--max-generated-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--draft-tokens", type=int, default=8)
    p.add_argument("--min-draft-rows", type=float, default=0.5, help="as speculative.min_draft_rows")
    p.add_argument("--noise", choices=["per_step", "per_prompt"], default="per_step")
    p.add_argument("--drift", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=8, help="measured rounds, after one warm-up round")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--scratch", default="/tmp/bench_speculative", help="the checkpointer's output_dir (unused)")
    p.add_argument("--eager", action="store_true", help="eager steps instead of compiled")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--noise-cost", action="store_true", help="time the noise draws alone")
    p.add_argument("--keyed-overhead", action="store_true", help="rng against keyed noise, no drafts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.noise_cost:
        return noise_cost(args)

    from torchtune_ppo.compile import generation_steps
    from torchtune_ppo.rollout.generation import Generator
    from torchtune_ppo.rollout.speculative import row_keys

    model, prompts, lens, stops, tokenizer = load(args)
    if args.keyed_overhead:
        return keyed_overhead(args, model, prompts, lens, tokenizer)
    P, T, B = prompts.shape[1], args.max_generated_tokens, args.batch
    steps = generation_steps(compiled=not args.eager)
    gen = Generator(model, batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=tokenizer.pad_id,
                    stop_token_ids=stops, temperature=args.temperature, steps=steps, draft_tokens=args.draft_tokens,
                    min_draft_rows=args.min_draft_rows)
    g = torch.Generator().manual_seed(0)
    scales = {n: w.float().std().item() for n, w in model.named_parameters()}

    def drift():
        if args.drift:
            for n, w in model.named_parameters():
                w.add_((torch.randn(w.shape, generator=g) * (args.drift * scales[n])).to(w.dtype))

    def run(keys, drafts):
        gen.spec_stats.reset()
        start = time.perf_counter()
        out = gen.generate(prompts, lens, noise_keys=keys, drafts=drafts)
        return time.perf_counter() - start, out, gen.spec_stats.metrics()

    def lengths(out):
        resp = out.query_responses[:, P:]
        stop = torch.isin(resp, torch.tensor(stops))
        return torch.where(stop.any(-1), stop.float().argmax(-1) + 1, T).tolist()

    previous, rows = None, []
    for rnd in range(args.rounds + 2):  # round 0 fills the drafts, round 1 warms the verify regions up
        keys, _ = row_keys(prompts, lens, seed=0, round=rnd if args.noise == "per_step" else 0)
        drafts = None if previous is None else [r[:n] for r, n in zip(previous.query_responses[:, P:].tolist(),
                                                                         lengths(previous))]
        order = ["plain", "drafted"] if rnd % 2 == 0 else ["drafted", "plain"]
        result = {}
        for name in order:
            if name == "drafted" and drafts is None:
                continue
            result[name] = run(keys, None if name == "plain" else drafts)
        plain = result["plain"][1]
        if "drafted" in result:
            same = torch.equal(result["drafted"][1].query_responses, plain.query_responses)
            row = dict(round=rnd, plain_s=result["plain"][0], drafted_s=result["drafted"][0], same=same,
                       plain=result["plain"][2], drafted=result["drafted"][2],
                       mean_length=statistics.mean(lengths(plain)))
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                              if not isinstance(v, dict)}), {k: round(v, 3) for k, v in row["drafted"].items()},
                  flush=True)
        previous = plain
        drift()

    measured = rows[1:]
    ratio = summarize_ratios([r["plain_s"] / r["drafted_s"] for r in measured])
    summary = dict(
        args={k: str(v) for k, v in vars(args).items()}, machine=machine_info(ROOT, torch.get_num_threads()),
        speedup=ratio, speedup_text=format_ratio(ratio, spread=True),
        identical=all(r["same"] for r in rows),
        acceptance=statistics.mean(r["drafted"]["spec/acceptance"] for r in measured),
        tokens_per_forward=statistics.mean(r["drafted"]["spec/tokens_per_forward"] for r in measured),
        forwards_plain=statistics.mean(r["plain"]["spec/forwards"] for r in measured),
        forwards_drafted=statistics.mean(r["drafted"]["spec/forwards"] for r in measured),
        plain_s=statistics.median(r["plain_s"] for r in measured),
        drafted_s=statistics.median(r["drafted_s"] for r in measured),
        mean_length=statistics.mean(r["mean_length"] for r in measured), rounds=len(measured),
    )
    print(f"plain / drafted generate: {summary['speedup_text']} over {len(measured)} rounds; "
          f"identical responses: {summary['identical']}; acceptance {summary['acceptance']:.3f}; "
          f"forwards {summary['forwards_plain']:.1f} -> {summary['forwards_drafted']:.1f}; "
          f"mean response {summary['mean_length']:.1f} tokens; plain {summary['plain_s']:.2f}s, "
          f"drafted {summary['drafted_s']:.2f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(summary=summary, rows=rows), indent=1))


def noise_cost(args, vocab: int = 49152) -> None:
    from torchtune_ppo.rollout.sampling import exponential_noise
    from torchtune_ppo.rollout.speculative import keyed_noise

    B, K = args.batch, args.draft_tokens + 1
    g, scratch, keys = torch.Generator().manual_seed(0), torch.Generator(), list(range(B))
    step, chunk = torch.empty(B, vocab), torch.empty(B, K, vocab)

    def median_ms(fn, calls):
        times = []
        for i in range(calls):
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    rows = {
        f"exponential_noise [{B}, {vocab}]": median_ms(lambda i: exponential_noise(step, g), 30),
        f"keyed_noise [{B}, 1, {vocab}]": median_ms(lambda i: keyed_noise(step[:, None], keys, [[i]] * B, scratch), 30),
        f"keyed_noise [{B}, {K}, {vocab}]": median_ms(
            lambda i: keyed_noise(chunk, keys, [range(i, i + K)] * B, scratch), 10),
    }
    for name, ms in rows.items():
        print(f"{name}: {ms:.1f} ms")


def keyed_overhead(args, model, prompts, lens, tokenizer) -> None:
    from torchtune_ppo.compile import generation_steps
    from torchtune_ppo.rollout.generation import Generator
    from torchtune_ppo.rollout.speculative import row_keys

    P, T, B = prompts.shape[1], args.max_generated_tokens, args.batch
    gen = Generator(model, batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=tokenizer.pad_id,
                    stop_token_ids=[], temperature=args.temperature, steps=generation_steps(compiled=not args.eager))
    rng = torch.Generator().manual_seed(0)
    rows = []
    for rnd in range(args.rounds + 1):
        keys, _ = row_keys(prompts, lens, seed=0, round=rnd)
        times = {}
        for name in (["rng", "keyed"] if rnd % 2 == 0 else ["keyed", "rng"]):
            start = time.perf_counter()
            gen.generate(prompts, lens, rng=rng, noise_keys=keys if name == "keyed" else None)
            times[name] = time.perf_counter() - start
        rows.append(dict(round=rnd, **times))
        print(json.dumps({k: round(v, 4) for k, v in rows[-1].items()}), flush=True)
    measured = rows[1:]
    ratio = summarize_ratios([r["rng"] / r["keyed"] for r in measured])
    print(f"rng / keyed generate (no drafts, {T} steps): {format_ratio(ratio, spread=True)} over {len(measured)} "
          f"rounds; rng {statistics.median(r['rng'] for r in measured):.2f}s, keyed "
          f"{statistics.median(r['keyed'] for r in measured):.2f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()},
                                                  machine=machine_info(ROOT, torch.get_num_threads()),
                                                  ratio=ratio, rows=rows), indent=1))


if __name__ == "__main__":
    main()
