"""Generation benchmark: torchtune's ``generate`` (no cache, KV cache, compiled decode step)
against ``torchtune_ppo.rollout.generation.Generator`` (eager, compiled), on one random-weight model.

Each variant generates the same left-padded batch with the same sampling settings and no stop
tokens (every row runs the full length). Reported apart, as medians over the timed calls
after warm-up: prefill time (the prompt forward and the first sampled token), decode
tokens/s (the other ``T - 1`` tokens of every row), the whole call, and the first call, which
holds the compile time of compiled variants.

The variants share one model in one process and take turns one call at a time, the order
reversed every round, so that each round's calls meet the same machine state; speed-ups are
medians over rounds of per-round ratios against the fastest torchtune variant, with 95%
intervals, and rounds go on until every interval is within ``--target-width`` or for
``--max-steps`` rounds (``benchmarks/bench_common``). The machine state and the headline
verdict go with the result.

The Generator's prefill is timed by wrapping its ``_prefill`` attribute for the call: the one
private reach here. ``Generator`` has no public seam between its prefill and its decode loop
(``prepare``, ``draw_noise`` and the module-level ``prefill`` are public, but calling them
outside ``generate`` would time another call, not this one's prefill).

With ``--group n`` the batch holds ``batch / n`` prompts, each ``n`` times in a row (GRPO-style
groups), and the variants ``ours-shared`` / ``ours-shared-compiled`` prefill each prompt once
(``Generator(group_size=n)``) where ``ours`` / ``ours-compiled`` prefill all ``batch`` rows; with
only our variants the ratios are against the first one named. Their prefill time includes
copying each prompt's cache into its group's other rows.

    python benchmarks/generation/bench_generation.py                # demo-size model, CPU, fp32
    python benchmarks/generation/bench_generation.py --llama-1b --device cuda --out gen.json
    python benchmarks/generation/bench_generation.py --group 4 --prompt-len 128 \
        --variants ours,ours-shared                                 # one prefill per group
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch._inductor.config
import torchtune.generation._generation as tt_gen
from torchtune.models.llama2._component_builders import llama2
from torchtune.models.llama3_2._component_builders import llama3_2
from torchtune.modules import local_kv_cache

from torchtune_ppo.compile import generation_steps
from torchtune_ppo.rollout.generation import Generator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
from bench_common.interleave import run_interleaved  # noqa: E402
from bench_common.machine import CpuMeter, headline_verdict, loadavg, machine_info, verdict_lines  # noqa: E402
from bench_common.stats import format_ratio, pair_ratios, summarize_ratios  # noqa: E402

PAD = 0
TOP_K = 50


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class PrefillClock:
    """Wraps a prefill function: syncs and stamps the time when the first call of a run ends."""

    def __init__(self, fn: Callable, device: torch.device) -> None:
        self.fn, self.device, self.stamp = fn, device, None

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        if self.stamp is None:
            sync(self.device)
            self.stamp = time.perf_counter()
        return out


def build_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    max_seq_len = args.prompt_len + args.gen_len
    with torch.device(args.device):
        if args.llama_1b:
            model = llama3_2(vocab_size=128_256, num_layers=16, num_heads=32, num_kv_heads=8,
                             embed_dim=2048, max_seq_len=max_seq_len, intermediate_dim=8192)
        else:
            model = llama2(vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, embed_dim=args.dim,
                           max_seq_len=max_seq_len, intermediate_dim=args.intermediate)
    return model.to(args.dtype).eval()


def make_prompts(args) -> torch.Tensor:
    """[batch, prompt_len] random prompts, left-padded to real lengths spread over 1..P; with
    ``--group n``, ``batch / n`` such prompts, each repeated ``n`` times in a row."""
    g = torch.Generator().manual_seed(0)
    distinct = args.batch // args.group
    prompts = torch.randint(1, args.vocab, (distinct, args.prompt_len), generator=g)
    lengths = torch.linspace(1, args.prompt_len, distinct).round().long()
    for row, n in enumerate(lengths.tolist()):
        prompts[row, : args.prompt_len - n] = PAD
    return prompts.repeat_interleave(args.group, dim=0).to(args.device)


def torchtune_runner(model, args, *, kv_cache: bool, compiled: bool) -> Callable:
    """One torchtune ``generate`` call, the way its PPO and generate recipes make it."""
    decode = None
    if compiled:
        # As recipes/generate.py does: compile generate_next_token, prefill stays eager.
        kwargs = {} if args.compile_mode == "default" else {"mode": args.compile_mode}
        decode = torch.compile(tt_gen.generate_next_token, fullgraph=True, **kwargs)

    def run(prompts, rng, clock):
        ctx = local_kv_cache(model, batch_size=args.batch, device=torch.device(args.device),
                             dtype=args.dtype,
                             decoder_max_seq_len=args.prompt_len + args.gen_len) if kv_cache \
            else nullcontext()
        original = tt_gen.generate_next_token
        tt_gen.generate_next_token = clock  # torchtune's prefill calls the module-level name
        clock.fn = original
        try:
            with ctx:
                tokens, _ = tt_gen.generate(
                    model, prompts, max_generated_tokens=args.gen_len, pad_id=PAD,
                    temperature=1.0, top_k=TOP_K, rng=rng, custom_generate_next_token=decode)
        finally:
            tt_gen.generate_next_token = original
        return tokens

    return run


def ours_runner(model, args, *, compiled: bool, group_size: int = 1) -> Callable:
    gen = Generator(model, batch_size=args.batch, max_prompt_len=args.prompt_len,
                    max_generated_tokens=args.gen_len, pad_id=PAD, stop_token_ids=[],
                    temperature=1.0, top_k=TOP_K, group_size=group_size, dtype=args.dtype,
                    steps=generation_steps(compiled=compiled, mode=args.compile_mode, device=torch.device(args.device)),
                    device=torch.device(args.device))
    # The one private reach (see the module docstring): Generator has no public prefill seam.
    # With groups the prefill ends once the cache is copied into the groups' rows.
    owner, attr = (gen.kv_cache, "copy_to_group") if group_size > 1 else (gen, "_prefill")
    prefill = getattr(owner, attr)

    def run(prompts, rng, clock):
        clock.fn = prefill
        setattr(owner, attr, clock)
        try:
            # make_prompts never draws PAD as a real token, so its real lengths are these
            return gen.generate(prompts, (prompts != PAD).sum(-1), rng=rng).query_responses
        finally:
            setattr(owner, attr, prefill)

    run.generator = gen
    return run


def timed_call(run: Callable, prompts, seed: int, device: torch.device):
    """(prefill seconds, whole-call seconds) of one call, device synced around it."""
    rng = torch.Generator(device=device).manual_seed(seed)
    clock = PrefillClock(None, device)
    sync(device)
    start = time.perf_counter()
    run(prompts, rng, clock)
    sync(device)
    return clock.stamp - start, time.perf_counter() - start


class Variant:
    """One variant as an interleaved row: each ``step()`` is one timed call, seeded in turn."""

    def __init__(self, run: Callable, prompts, device: torch.device, first_seed: int):
        self.run, self.prompts, self.device, self.seed = run, prompts, device, first_seed

    def step(self, timeout=None) -> Dict[str, float]:
        prefill, total = timed_call(self.run, self.prompts, self.seed, self.device)
        self.seed += 1
        return {"total_s": total, "prefill_s": prefill, "decode_s": total - prefill}


def fastest_torchtune(times: Dict[str, List[Dict]]) -> str:
    """The torchtune variant with the lowest median call so far (else the first variant)."""
    tt = [n for n in times if n.startswith("torchtune")]
    return min(tt or list(times)[:1], key=lambda n: statistics.median(t["total_s"] for t in times[n]))


def measure(runs: Dict[str, Callable], prompts, args, meter=None):
    """Warm-up calls per variant, then rounds of one timed call per variant, the order reversed
    every round, until the speed-ups' intervals are narrow or ``--max-steps`` rounds."""
    device = torch.device(args.device)
    first = {}
    for name, run in runs.items():
        first[name] = timed_call(run, prompts, 0, device)[1]
        for i in range(1, args.warmup):
            timed_call(run, prompts, i, device)
        print(f"{name}: warm, first call {first[name]:.2f} s", flush=True)
    graphs_after_warmup = graphs_compiled()
    variants = {name: Variant(run, prompts, device, args.warmup) for name, run in runs.items()}
    interleaved = run_interleaved(variants, warmup=0, max_steps=args.max_steps, min_steps=args.min_steps,
                                  target_width=args.target_width, key="total_s",
                                  reference=fastest_torchtune, meter=meter)
    recompiles = graphs_compiled() - graphs_after_warmup
    times = interleaved.steps
    baseline = fastest_torchtune(times)
    rows = []
    for name in runs:
        prefill = statistics.median(t["prefill_s"] for t in times[name])
        total = statistics.median(t["total_s"] for t in times[name])
        decode = statistics.median(t["decode_s"] for t in times[name])
        ratios = {k: summarize_ratios(pair_ratios(times[baseline], times[name], f"{k}_s"))
                  for k in ("total", "prefill", "decode")}
        rows.append({
            "name": name,
            "prefill_ms": 1e3 * prefill,
            "decode_tok_s": args.batch * (args.gen_len - 1) / decode if args.gen_len > 1
            else float("nan"),
            "total_ms": 1e3 * total,
            "tok_s": args.batch * args.gen_len / total,
            "first_call_s": first[name],
            "compile_s": first[name] - total,
            # Per-round ratios, the baseline's time over this variant's: the decode ratio is
            # the ratio of decode tokens/s.
            "ratios_vs_baseline": ratios,
            "calls": times[name],
        })
    return rows, recompiles, baseline, interleaved


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def profile_calls(runs: Dict[str, Callable], prompts, args, top: int = 12) -> Dict[str, Dict]:
    """torch.profiler over one call per variant: self time of the top ops, and the GEMM share."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    report = {}
    for name, run in runs.items():
        with profile(activities=activities) as prof:
            timed_call(run, prompts, 0, device)
        events = prof.key_averages()
        attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        total = sum(getattr(e, attr) for e in events)
        gemm = sum(getattr(e, attr) for e in events if e.key in GEMM_OPS)
        ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
        report[name] = {
            "total_ms": total / 1e3,
            "gemm_share": gemm / total if total else float("nan"),
            "top": [{"op": e.key[:70], "ms": getattr(e, attr) / 1e3, "calls": e.count}
                    for e in ranked],
        }
        print(f"\n{name}: profiled {total / 1e3:.1f} ms self time, GEMM {100 * gemm / total:.0f}%")
        for e in report[name]["top"]:
            print(f"  {e['ms']:8.2f} ms  {e['calls']:5d} calls  {e['op']}")
    return report


def bandwidth_floor(model, args) -> Optional[Dict[str, float]]:
    """Decode tokens/s if a step only had to read the weights and the KV cache once (CUDA)."""
    if torch.device(args.device).type != "cuda":
        return None
    n = 1 << 28  # 1 GiB of fp32
    src = torch.empty(n, device=args.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(torch.device(args.device))
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(torch.device(args.device))
    bandwidth = 10 * 2 * src.numel() * src.element_size() / (time.perf_counter() - start)
    del src, dst
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer = model.layers[0].attn
    seq = args.prompt_len + args.gen_len
    kv_bytes = (2 * len(model.layers) * args.batch * layer.num_kv_heads * seq * layer.head_dim
                * torch.finfo(args.dtype).bits // 8)
    step_s = (weight_bytes + kv_bytes) / bandwidth
    return {"bandwidth_GBs": bandwidth / 1e9, "weight_GB": weight_bytes / 1e9,
            "kv_GB": kv_bytes / 1e9, "floor_step_ms": 1e3 * step_s,
            "floor_decode_tok_s": args.batch / step_s}


def hardware(args) -> str:
    if torch.device(args.device).type == "cuda":
        return torch.cuda.get_device_name(args.device)
    from bench_common.machine import cpu_model

    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def table(rows: List[Dict], baseline: str) -> str:
    against = f"the fastest torchtune variant ({baseline})" if baseline.startswith("torchtune") else baseline
    lines = [
        f"Speed-ups against {against}: medians of per-round ratios, [95% interval].",
        "",
        "| variant | prefill (ms) | decode (tok/s) | whole call (ms) | first call (s) "
        "| speed-up, whole call | speed-up, prefill | speed-up, decode | calls |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratios = r["ratios_vs_baseline"]
        lines.append(
            f"| {r['name']} | {r['prefill_ms']:.2f} | {r['decode_tok_s']:.0f} "
            f"| {r['total_ms']:.2f} | {r['first_call_s']:.2f} "
            f"| {format_ratio(ratios['total'])} | {format_ratio(ratios['prefill'])} "
            f"| {format_ratio(ratios['decode'])} | {len(r['calls'])} |"
        )
    return "\n".join(lines)


def rows_by_name(rows):
    return {r["name"]: r for r in rows}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=40,
                   help="timed rounds at most (one call per variant a round)")
    p.add_argument("--min-steps", type=int, default=6,
                   help="timed rounds before the interval test may stop")
    p.add_argument("--target-width", type=float, default=0.05,
                   help="stop once every speed-up's 95%% interval is within ± this of its median")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls; the first compiles")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 (default: fp32, bf16 for --llama-1b)")
    p.add_argument("--compile-mode", default="default")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="inductor cpp_wrapper for every compiled variant (less Python per call)")
    p.add_argument("--llama-1b", action="store_true",
                   help="Llama-3.2-1B dims, random weights, bf16")
    p.add_argument("--variants", default="tt,tt-kv,tt-kv-compiled,ours,ours-compiled",
                   help="comma-separated subset of: tt, tt-kv, tt-kv-compiled, ours, ours-compiled, "
                        "ours-shared, ours-shared-compiled (the last two need --group)")
    p.add_argument("--group", type=int, default=1,
                   help="n: the batch is batch/n prompts, each n times in a row; the ours-shared "
                        "variants prefill each once")
    p.add_argument("--profile", action="store_true",
                   help="also run torch.profiler over one call per variant and print the top ops")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    if args.llama_1b:
        args.vocab = 128_256
    if args.group < 1 or args.batch % args.group:
        p.error(f"--group {args.group} must be >= 1 and divide --batch {args.batch}")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.llama_1b else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpp_wrapper:
        # The generated code calls its kernels from C++ rather than Python, which matters on
        # CPU where a decode step is ~50 small kernels (see RESULTS.md). Applies to every
        # compiled variant, torchtune's included.
        torch._inductor.config.cpp_wrapper = True
    return args


def main() -> None:
    args = parse_args()
    model = build_model(args)
    prompts = make_prompts(args)
    variants = {  # key: (table name, runner factory)
        "tt": ("torchtune generate, no cache",
               lambda: torchtune_runner(model, args, kv_cache=False, compiled=False)),
        "tt-kv": ("torchtune generate, KV cache",
                  lambda: torchtune_runner(model, args, kv_cache=True, compiled=False)),
        "tt-kv-compiled": ("torchtune generate, KV cache, compiled generate_next_token",
                           lambda: torchtune_runner(model, args, kv_cache=True, compiled=True)),
        "ours": ("Generator, eager", lambda: ours_runner(model, args, compiled=False)),
        "ours-compiled": ("Generator, compiled", lambda: ours_runner(model, args, compiled=True)),
        "ours-shared": (f"Generator, eager, one prefill per group of {args.group}",
                        lambda: ours_runner(model, args, compiled=False, group_size=args.group)),
        "ours-shared-compiled": (f"Generator, compiled, one prefill per group of {args.group}",
                                 lambda: ours_runner(model, args, compiled=True, group_size=args.group)),
    }
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    unknown = [k for k in keys if k not in variants]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; valid: {list(variants)}")
    runs = {variants[k][0]: variants[k][1]() for k in keys}
    before, meter = loadavg(), CpuMeter()
    rows, recompiles, baseline, interleaved = measure(runs, prompts, args, meter)
    threads = torch.get_num_threads()
    machine = {**machine_info(ROOT, threads), "loadavg_before": before, "loadavg_after": loadavg()}
    verdict = headline_verdict(meter.total(), interleaved.samples, threads)
    stop = interleaved.describe_stop(args.target_width, args.max_steps)
    report = {
        "hardware": hardware(args),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/generation/bench_generation.py", *sys.argv[1:]]),
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()},
        "machine": machine,
        "verdict": verdict,
        "stop": stop,
        "machine_per_round": interleaved.samples,
        "rows": rows,
        "recompiles_after_warmup": recompiles,
        "baseline": baseline,
        "bandwidth_floor": bandwidth_floor(model, args),
    }
    print()
    print(f"{report['hardware']}; torch {report['torch']}; batch {args.batch}"
          f"{f' ({args.batch // args.group} prompts x {args.group})' if args.group > 1 else ''}, prompt "
          f"{args.prompt_len}, {args.gen_len} generated tokens, {args.dtype}, top_k {TOP_K}"
          f"{', inductor cpp_wrapper' if args.cpp_wrapper else ''}")
    print("\n".join(verdict_lines(machine, verdict)))
    print(f"- {stop}")
    print()
    print(table(rows, baseline))
    print(f"\nGraphs compiled during the timed rounds (all variants): {recompiles}")
    if report["bandwidth_floor"]:
        f = report["bandwidth_floor"]
        print(f"\nMemory-bandwidth floor: {f['bandwidth_GBs']:.0f} GB/s measured copy; "
              f"{f['weight_GB']:.2f} GB weights + {f['kv_GB']:.3f} GB KV per step -> "
              f"{f['floor_step_ms']:.2f} ms/step, {f['floor_decode_tok_s']:.0f} decode tok/s")
    if args.profile:
        report["profile"] = profile_calls(runs, prompts, args)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
