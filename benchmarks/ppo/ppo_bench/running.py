"""Running the rows: one long-lived worker each, set up in turn, then stepped interleaved."""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from bench_common.interleave import InterleavedRun, RowFailed, run_interleaved
from bench_common.protocol import WorkerRow

from .configs import ours_config, torchtune_config
from .rows import row_of, split_name
from .summary import summarize

BENCH_DIR = Path(__file__).resolve().parents[1]  # benchmarks/ppo: ppo_bench
BENCHMARKS = BENCH_DIR.parent  # benchmarks: bench_common

# Set-up order: the anchors and our end point first, so that a time budget cuts the
# intermediate rows, and compile.rollout (one unrolled graph, the longest compile) last.
RUN_ORDER = ("tt_eager", "tt_kv", "ours_eager", "ours_all", "tt_compile", "ours_generate",
             "ours_trajectory", "ours_rollout", "ours_eager_shared", "ours_generate_shared",
             "ours_eager_segments", "ours_all_segments", "ours_layers")


def make_worker(name: str, spec_path: Path, work: Path, logs: Path,
                limit_s: Optional[float]) -> WorkerRow:
    """The row's worker process, with its own empty inductor cache (its compile is a cold start)."""
    cmd = [sys.executable, "-m", "ppo_bench.rows", "--spec", str(spec_path)]
    pythonpath = os.pathsep.join(p for p in (str(BENCH_DIR), str(BENCHMARKS), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath,
               TORCHINDUCTOR_CACHE_DIR=str(work / "inductor" / name.replace("@", "_")))
    return WorkerRow(name, [(cmd, env)], logs, limit_s=limit_s)


def fastest_torchtune(steps: Dict[str, List[Dict[str, Any]]], warmup: int) -> str:
    """The torchtune row with the lowest median measured step so far (else the first row):
    steps of rounds ``>= warmup`` that the driver did not mark as warm-up."""
    def median(name):
        measured = [s["step_s"] for s in steps[name]
                    if s["round"] >= warmup and not s.get("warmup")] or [float("inf")]
        return statistics.median(measured)

    torchtune_rows = [n for n in steps if row_of(n).recipe == "torchtune"]
    return min(torchtune_rows, key=median) if torchtune_rows else next(iter(steps))


def run_rows(args: argparse.Namespace, work: Path, models: Optional[Tuple[dict, dict]],
             meter: Optional[Any] = None
             ) -> Tuple[List[Dict[str, Any]], Dict[str, Any], InterleavedRun, int]:
    """Sets up ``args.row_names`` in ``RUN_ORDER``, then runs them interleaved.

    Args:
        args (argparse.Namespace): the parsed command line.
        work (Path): scratch folder (specs, inductor caches, row outputs).
        models (Optional[Tuple[dict, dict]]): the ``--gpu`` or ``--cpu-large`` policy and
            reward/value model blocks, replacing the config's.
        meter (Optional[Any]): ``bench_common.machine.CpuMeter`` for the measured rounds.

    Returns:
        Tuple: the row summaries in table order, our resolved config (for the report's
        setup), the interleaved run, and the most CPU threads a row ran.
    """
    start, results, workers = time.perf_counter(), {}, {}
    ours = None
    # Every worker starts at once (set-up is not timed); then each is waited for in turn.
    for name in sorted(args.row_names, key=lambda n: RUN_ORDER.index(split_name(n)[0])):
        row = row_of(name)
        ours = ours_config(args, work / name.replace("@", "_"), dtype=split_name(name)[1])
        if models:
            ours["policy_model"], ours["reward_and_value_model"] = models
        cfg = ours if row.recipe == "ours" else torchtune_config(ours, args)
        spec_path = work / f"{name.replace('@', '_')}.spec.json"
        spec_path.write_text(json.dumps({"recipe": row.recipe, "threads": args.threads,
                                         "cfg": {**cfg, **row.overrides}}))
        workers[name] = make_worker(name, spec_path, work, args.out / "logs", args.row_timeout_s)
        workers[name].start()
    print(f"[{time.perf_counter() - start:6.0f} s] setting up {', '.join(workers)}", flush=True)
    for name in list(workers):
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        try:
            if left is not None and left < 10:
                raise RowFailed("skipped (time budget)", "less than 10 s of the time budget left")
            workers[name].ready(timeout=left)
        except RowFailed as e:
            workers.pop(name).kill()
            results[name] = {"status": e.status, "reason": e.reason}
            print(f"    {name}: {e.status}: {e.reason}", flush=True)

    order = [n for n in args.row_names if n in workers]
    left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
    print(f"[{time.perf_counter() - start:6.0f} s] interleaving {', '.join(order)}: {args.warmup} "
          f"warm-up rounds (up to {args.settle} more while a row compiles), then up to "
          f"{args.max_steps} pairs", flush=True)
    run = run_interleaved({n: workers[n] for n in order}, warmup=args.warmup, max_steps=args.max_steps,
                          settle=args.settle, min_steps=args.min_steps, target_width=args.target_width, key="step_s",
                          reference=lambda steps: fastest_torchtune(steps, args.warmup),
                          budget_s=left, meter=meter)
    threads = max([w.info.get("threads") or 1 for w in workers.values()] or [1])
    for name in order:
        if name in run.failed:
            results[name] = run.failed[name]
            continue
        try:
            done = workers[name].stop()[0]
        except RowFailed as e:
            results[name] = {"status": e.status, "reason": e.reason}
            continue
        results[name] = {"status": "ok", "steps": run.steps[name], **done}
    rows = []
    for name in args.row_names:
        r = summarize(name, row_of(name).label, results[name], warmup=run.warmup,
                      batch_size=args.batch_size, gen_tokens=ours["max_generated_tokens"],
                      ppo_epochs=args.ppo_epochs)
        print(f"    {name}: {r['status']}" + (f": {r['step_s']:.3f} s/step, whole run {r['whole_run_s']:.1f} s"
                                              if r["status"] == "ok" else f" {r.get('reason', '')}"), flush=True)
        rows.append(r)
    return rows, ours, run, threads
