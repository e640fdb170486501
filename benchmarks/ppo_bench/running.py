"""Launching the rows: one fresh process each, in a set order, within the time budgets."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .configs import ours_config, torchtune_config
from .rows import ROWS
from .summary import summarize

BENCH_DIR = Path(__file__).resolve().parents[1]

# Execution order: the anchors and our end point first, so that a time budget cuts the
# intermediate rows, and compile.rollout (one unrolled graph, the longest compile) last.
RUN_ORDER = ("tt_eager", "tt_kv", "ours_eager", "ours_all", "tt_compile", "ours_generate",
             "ours_trajectory", "ours_rollout")


def launch_row(name: str, spec_path: Path, work: Path, logs: Path,
               timeout: Optional[float]) -> Dict[str, Any]:
    """Runs one row in a child process with its own empty inductor cache.

    Args:
        name (str): the row's key in ``ROWS``.
        spec_path (Path): the row's spec (see ``ppo_bench.rows``).
        work (Path): scratch folder for the result and the inductor cache.
        logs (Path): where the row's stdout and stderr go, as ``<name>.log``.
        timeout (Optional[float]): seconds after which the row is killed.

    Returns:
        Dict[str, Any]: the row's result, or a ``status`` ("timed out", "error") and ``reason``.
    """
    out_path, log_path = work / f"{name}.json", logs / f"{name}.log"
    cmd = [sys.executable, "-m", "ppo_bench.rows", "--spec", str(spec_path), "--out", str(out_path)]
    pythonpath = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p)
    # An empty inductor cache per row: its compile time is a cold start.
    env = dict(os.environ, PYTHONPATH=pythonpath, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor" / name))
    with open(log_path, "w") as log:
        # Own process group: a timeout also ends the row's inductor compile workers.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "timed out", "reason": f"ran past its {timeout:.0f} s limit"}
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text().strip().splitlines()[-1:] or [""]
        return {"status": "error", "reason": f"exit {proc.returncode}: {tail[0]} (log: {log_path})"}
    return json.loads(out_path.read_text())


def _time_left(args: argparse.Namespace, elapsed: float) -> Optional[float]:
    left = None if args.budget_s is None else args.budget_s - elapsed
    if args.row_timeout_s is not None:
        left = args.row_timeout_s if left is None else min(left, args.row_timeout_s)
    return left


def run_rows(args: argparse.Namespace, work: Path,
             models: Optional[Tuple[dict, dict]]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Runs ``args.row_names`` in ``RUN_ORDER``, skipping rows once the budget is spent.

    Args:
        args (argparse.Namespace): the parsed command line.
        work (Path): scratch folder (specs, results, inductor caches, row outputs).
        models (Optional[Tuple[dict, dict]]): the ``--gpu`` or ``--cpu-large`` policy and
            reward/value model blocks, replacing the config's.

    Returns:
        Tuple[List[Dict[str, Any]], Dict[str, Any]]: the row summaries in table order, and
        our resolved config (for the report's setup).
    """
    order = sorted(args.row_names, key=RUN_ORDER.index)
    start, rows = time.perf_counter(), {}
    for name in order:
        row = ROWS[name]
        ours = ours_config(args, work / name)
        if models:
            ours["policy_model"], ours["reward_and_value_model"] = models
        cfg = ours if row.recipe == "ours" else torchtune_config(ours, args)
        spec = {"recipe": row.recipe, "threads": args.threads, "cfg": {**cfg, **row.overrides}}
        spec_path = work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        left = _time_left(args, time.perf_counter() - start)
        if left is not None and left < 10:
            result = {"status": "skipped (time budget)", "reason": "less than 10 s of the time budget left"}
        else:
            print(f"[{time.perf_counter() - start:6.0f} s] {name}: {row.label}", flush=True)
            result = launch_row(name, spec_path, work, args.out / "logs", left)
        r = rows[name] = summarize(name, row.label, result, warmup=args.warmup,
                                   batch_size=args.batch_size,
                                   gen_tokens=ours["max_generated_tokens"],
                                   ppo_epochs=args.ppo_epochs)
        r["loadavg_1min_after"] = round(os.getloadavg()[0], 2)
        print(f"    {r['status']}" + (f": {r['step_s']:.3f} s/step, whole run {r['whole_run_s']:.1f} s"
                                       if r["status"] == "ok" else f" {r.get('reason', '')}"), flush=True)
    return [rows[n] for n in args.row_names], ours
