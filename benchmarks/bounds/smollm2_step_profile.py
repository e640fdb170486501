"""Where one PPO step of the SmolLM2 benchmark spends its time, phase by phase: torch.profiler's ops.

Builds the recipe exactly as a ``bench_ppo.py --smollm2`` row does (the same config, the row's
compile block, ``--workload``, ``--dtype``, a fixed policy), runs ``--warmup`` steps (the first
compiles), then profiles the next step and prints, for each phase the recipe times
(``phase/<name>`` ranges, :class:`torchtune_ppo.run.metrics.PhaseTimer`), its wall time and
the ops that took most of its self time. Compiled regions show inductor's own kernels
(``cpp.enable_kernel_profile``), named after the ops they fuse.

    python benchmarks/bounds/smollm2_step_profile.py --row ours_layers --dtype bf16 --workload long
    python benchmarks/bounds/smollm2_step_profile.py --row ours_eager --phases loss_step --top 25

One process, nothing else running (the profiler's own overhead is a few percent on these ops).
"""

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks/ppo"), str(ROOT / "recipes")]

from bench_ppo import LONG_DATASET, LONG_TOKENS, smollm2_assets  # noqa: E402
from ppo_bench.configs import ours_config  # noqa: E402
from ppo_bench.rows import ROWS  # noqa: E402

PHASES = ("generate", "score", "advantages", "loss_step", "optimizer")


def phase_tables(events, phases) -> Dict[str, dict]:
    """Self time per op name inside each ``phase/<name>`` range (summed over its entries)."""
    out = {}
    for phase in phases:
        ranges = [e for e in events if e.name == f"phase/{phase}"]
        if not ranges:
            continue
        self_us: Dict[str, float] = collections.defaultdict(float)
        calls: Dict[str, int] = collections.defaultdict(int)
        for r in ranges:  # the range's own time: Python between the ops
            self_us["(between ops)"] += r.self_cpu_time_total
            calls["(between ops)"] += 1
        stack = [c for r in ranges for c in r.cpu_children]
        while stack:
            e = stack.pop()
            name = f"{e.name} {e.input_shapes}" if e.input_shapes else e.name
            self_us[name] += e.self_cpu_time_total
            calls[name] += 1
            stack.extend(e.cpu_children)
        wall = sum(r.time_range.elapsed_us() for r in ranges)
        out[phase] = dict(wall_us=wall, self_us=dict(self_us), calls=dict(calls), entries=len(ranges))
    return out


def print_tables(tables: Dict[str, dict], top: int) -> None:
    for phase, t in tables.items():
        total = sum(t["self_us"].values())
        print(f"\n## {phase}: {t['wall_us'] / 1e6:.3f} s wall in {t['entries']} range(s), "
              f"{total / 1e6:.3f} s of op self time")
        print("| op | self (ms) | share | calls |")
        print("| --- | ---: | ---: | ---: |")
        for name, us in sorted(t["self_us"].items(), key=lambda kv: -kv[1])[:top]:
            print(f"| `{name[:90]}` | {us / 1e3:.1f} | {us / total:.1%} | {t['calls'][name]} |")


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="ours_layers", help="a bench_ppo.py row of ours (default ours_layers)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--workload", choices=("arithmetic", "long"), default="arithmetic")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the profiled one (the first compiles)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to print")
    ap.add_argument("--top", type=int, default=15, help="ops printed per phase")
    ap.add_argument("--shapes", action="store_true", help="name each op with its input shapes")
    ap.add_argument("--json", type=Path, default=None, help="also write the tables here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, as bench_ppo.py)")
    args = ap.parse_args(argv)
    row = ROWS.get(args.row)
    if row is None or row.recipe != "ours":
        ap.error(f"--row {args.row!r}: one of {', '.join(n for n, r in ROWS.items() if r.recipe == 'ours')}")

    import torch

    torch._inductor.config.cpp.enable_kernel_profile = True
    from ppo_bench.ours_row import OursRow

    extra, _ = smollm2_assets()
    sets = extra + ["optimizer.lr=1e-30"]  # a fixed policy, as bench_ppo.py --fixed-policy
    if args.workload == "long":
        sets += LONG_DATASET
    bench = argparse.Namespace(
        config=ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml", set=sets, warmup=args.warmup,
        max_steps=1, batch_size=16, forward_batch_size=16, ppo_batch_size=8, ppo_epochs=2,
        device="cpu", dtype=args.dtype, max_prompt_len=None,
        max_generated_tokens=LONG_TOKENS if args.workload == "long" else None)
    work = Path(tempfile.mkdtemp(prefix="step_profile_"))
    cfg = {**ours_config(bench, work / "run"), **row.overrides}
    # as bench_ppo.py's rows: torch's thread count (or --threads), not the config's auto
    cfg["cpu_threads"] = args.threads or torch.get_num_threads()
    ours = OursRow(cfg)
    tables, seen = {}, []

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=args.shapes)

    def on_step(step: dict) -> None:
        seen.append(step)
        print(f"step {step['step']}: {step['step_s']:.3f} s (generate {step['generate']:.3f}, score "
              f"{step['score']:.3f}, loss step {step['loss_step']:.3f}, optimizer {step['optimizer']:.3f}; "
              f"responses {step['response_len']:.1f}, longest {step['longest_response']:.0f})", flush=True)
        if step["step"] == args.warmup:
            profiler.__enter__()
        elif step["step"] == args.warmup + 1:
            profiler.__exit__(None, None, None)
            tables.update(phase_tables(profiler.events(), args.phases.split(",")))

    start = time.perf_counter()
    ours.run(on_step)
    ours.finish()
    print(f"\n{args.row}@{args.dtype}, {args.workload} workload, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; {len(seen)} steps in {time.perf_counter() - start:.1f} s; step {args.warmup + 1} profiled")
    print_tables(tables, args.top)
    if args.json:
        args.json.write_text(json.dumps(dict(row=args.row, dtype=args.dtype, workload=args.workload,
                                             threads=torch.get_num_threads(), steps=seen, tables=tables), indent=1))


if __name__ == "__main__":
    main()
