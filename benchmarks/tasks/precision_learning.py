"""Does bf16 with fp32 master weights learn as well as fp32? SmolLM2-135M-Instruct on chat
arithmetic, several seeds of each dtype, full fine-tuning and LoRA, with evaluation during training.

    python benchmarks/tasks/precision_learning.py                          # full and LoRA, bf16 and fp32, seeds 0 1 2
    python benchmarks/tasks/precision_learning.py --configs full --parallel 2 --out bench_out/precision

Each run is a shipped SmolLM2 config (``recipes/configs/smollm2/``: ``full`` is
``135M_ppo_arithmetic.yaml``, ``lora`` is ``135M_lora_ppo_arithmetic.yaml``, ``full_mixed`` and
``lora_mixed`` their ``_mixed`` configs) as a user runs it
(``tune run``, its compile block, its evaluation every 10 steps on the 200 held-out questions),
with ``dtype`` and ``seed`` set and the ``ood`` evaluation set left out (``--keep-ood`` keeps it),
one CPU thread a run. ``--parallel N`` runs N at once, each pinned to its own core
(``taskset``), so that two runs never share a core's threads; runs start seed-major and dtypes
alternate, so a slow spell of the machine meets both dtypes.

Reported per run, from the run's metric log: held-out greedy accuracy (``val/heldout/pass@1``) at
every evaluation, at the last step and the best; the first evaluation at 50% or more and the
minutes of the PPO loop until it (``time/step`` and ``time/eval`` summed from the first step,
the evaluation before step 1 included; model loading left out); mean training reward over the
first and last 10 steps; where the run evaluates the ``ood`` set, its accuracy too. Then per config and dtype: the mean and the spread (min-max) over the
seeds. Prints one JSON line per run and a markdown table; writes ``results.json`` to ``--out``.
Prepare the model first (``python tools/prepare_smollm2.py``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "full": "recipes/configs/smollm2/135M_ppo_arithmetic.yaml",
    "lora": "recipes/configs/smollm2/135M_lora_ppo_arithmetic.yaml",
    "full_mixed": "recipes/configs/smollm2/135M_ppo_arithmetic_mixed.yaml",
    "lora_mixed": "recipes/configs/smollm2/135M_lora_ppo_arithmetic_mixed.yaml",
}
OOD = "val/ood/pass@1"
METRIC = "val/heldout/pass@1"
TARGET = 0.5


def config_file(config: str, out: Path, keep_ood: bool) -> Path:
    """The shipped config, or a copy without the ``ood`` evaluation set (torchtune's ``~key``
    removes top-level keys only)."""
    if keep_ood:
        return ROOT / CONFIGS[config]
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / CONFIGS[config])
    del cfg.eval.datasets["ood"]
    path = out / f"{config}_heldout_only.yaml"
    OmegaConf.save(cfg, path)
    return path


def command(config_path: Path, dtype: str, seed: int, run_dir: Path, extra: List[str]) -> List[str]:
    return ["tune", "run", "ppo_full_finetune", "--config", str(config_path), f"output_dir={run_dir}",
            f"dtype={dtype}", f"seed={seed}", "log_samples_every_n_steps=null", *extra]


def read_logs(log_dir: Path) -> "tuple[List[Dict[str, float]], List[tuple]]":
    """Every step's row and every evaluation's ``(step, row)`` over all of a run's metric logs,
    oldest first: a run resumed after an interruption writes a new ``log_*.txt`` from the step
    it resumed at, whose rows replace the first log's rows of the same steps."""
    steps: Dict[int, Dict[str, float]] = {}
    evals: Dict[int, Dict[str, float]] = {}
    for log in sorted(log_dir.glob("log_*.txt"), key=lambda f: f.stat().st_mtime):
        for line in log.read_text().splitlines():
            if line.startswith("Step "):
                head, payload = line.split(" | ", 1)
                row = {k: float(v) for k, v in (item.split(":", 1) for item in payload.split())}
                (evals if any(k.startswith("val/") for k in row) else steps)[int(head.split()[1])] = row
    return [steps[k] for k in sorted(steps)], [(k, evals[k]) for k in sorted(evals)]


def summarize(run_dir: Path) -> Dict[str, Any]:
    """The run's accuracies, minutes and rewards, from its metric logs."""
    steps, evals = read_logs(run_dir / "logs")
    if not steps or not evals:
        raise RuntimeError(f"{run_dir}: no step or no evaluation logged")
    # PPO loop time up to the end of each evaluation: evaluations and steps in the order they ran
    # (the evaluation of step N after step N; step 0's before step 1).
    step_s = {i + 1: row["time/step"] for i, row in enumerate(steps)}
    curve, reached = [], None
    for step, row in evals:
        minutes = (sum(t for s, t in step_s.items() if s <= step)
                   + sum(r.get("time/eval", 0.0) for s, r in evals if s <= step)) / 60
        curve.append({"step": step, "accuracy": row[METRIC], "minutes": round(minutes, 2)})
        if reached is None and row[METRIC] >= TARGET:
            reached = {"step": step, "accuracy": row[METRIC], "minutes": round(minutes, 2)}
    k = min(10, len(steps))
    ood = [(step, row[OOD]) for step, row in evals if OOD in row]
    return {
        "steps": len(steps),
        "accuracy_start": curve[0]["accuracy"], "accuracy_end": curve[-1]["accuracy"],
        "accuracy_best": max(c["accuracy"] for c in curve),
        "first_at_50": reached,
        "reward_first_10": round(statistics.fmean(r["scores"] for r in steps[:k]), 4),
        "reward_last_10": round(statistics.fmean(r["scores"] for r in steps[-k:]), 4),
        "median_step_s": round(statistics.median(r["time/step"] for r in steps[1:] or steps), 3),
        "eval_s": [round(r.get("time/eval", 0.0), 1) for _, r in evals],
        "curve": curve,
        **({"ood_start": ood[0][1], "ood_end": ood[-1][1], "ood_curve": ood} if ood else {}),
    }


def table(results: List[Dict[str, Any]]) -> str:
    lines = ["| config | dtype | seeds | held-out at the last step: mean (min-max) | each seed | best, mean | "
             "first evaluation at 50%: step, minutes (each seed) | reward, steps 1-10 -> last 10 (mean) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for config in dict.fromkeys(r["config"] for r in results):
        for dtype in dict.fromkeys(r["dtype"] for r in results):
            mine = [r for r in results if r["config"] == config and r["dtype"] == dtype]
            if not mine:
                continue
            ends = [100 * r["accuracy_end"] for r in mine]
            firsts = ", ".join("never" if r["first_at_50"] is None else
                               f"{r['first_at_50']['step']} ({r['first_at_50']['minutes']:.1f} min)" for r in mine)
            lines.append(
                f"| {config} | {dtype} | {', '.join(str(r['seed']) for r in mine)} | "
                f"**{statistics.fmean(ends):.1f}%** ({min(ends):.1f}-{max(ends):.1f}) | "
                f"{', '.join(f'{e:.1f}' for e in ends)} | "
                f"{statistics.fmean(100 * r['accuracy_best'] for r in mine):.1f}% | {firsts} | "
                f"{statistics.fmean(r['reward_first_10'] for r in mine):.2f} -> "
                f"{statistics.fmean(r['reward_last_10'] for r in mine):.2f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=1, help="runs at once, one core each")
    p.add_argument("--cores", type=int, nargs="+", default=None,
                   help="the cores to pin runs to (default: 0 .. parallel-1)")
    p.add_argument("--keep-ood", action="store_true", help="evaluate the ood set too, as the config does")
    p.add_argument("--out", default="bench_out/precision_learning")
    p.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every run")
    p.add_argument("--summarize-only", action="store_true", help="read the runs already in --out")
    args = p.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = args.cores or list(range(args.parallel))
    if len(cores) < args.parallel:
        p.error("--cores needs at least --parallel cores")
    todo = [(c, d, s) for s in args.seeds for c in args.configs for d in args.dtypes]
    running: Dict[int, Any] = {}  # core -> (proc, (config, dtype, seed), log)
    results: List[Dict[str, Any]] = []

    def finish(core: int) -> None:
        proc, (config, dtype, seed), log = running.pop(core)
        log.close()
        name = f"{config}_{dtype}_seed{seed}"
        if proc.returncode != 0:
            print(json.dumps({"run": name, "error": f"exit {proc.returncode}, see {log.name}"}), flush=True)
            return
        result = {"config": config, "dtype": dtype, "seed": seed, **summarize(out / name)}
        print(json.dumps(result), flush=True)
        results.append(result)

    if args.summarize_only:
        for config, dtype, seed in todo:
            name = f"{config}_{dtype}_seed{seed}"
            if (out / name / "logs").is_dir():
                results.append({"config": config, "dtype": dtype, "seed": seed, **summarize(out / name)})
        todo = []
    while todo or running:
        for core in [c for c, (proc, _, _) in running.items() if proc.poll() is not None]:
            finish(core)
        free = [c for c in cores[:args.parallel] if c not in running]
        while todo and free:
            core, (config, dtype, seed) = free.pop(0), todo.pop(0)
            name = f"{config}_{dtype}_seed{seed}"
            log = open(out / f"{name}.log", "w")
            cmd = command(config_file(config, out, args.keep_ood), dtype, seed, out / name, list(args.set))
            # this checkout's recipe and library, whatever copy is installed
            path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "recipes"), os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
            proc = subprocess.Popen(["taskset", "-c", str(core), *cmd], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
            running[core] = (proc, (config, dtype, seed), log)
        time.sleep(2)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
