"""PPO and its critic-free relatives on tiny_arithmetic at the same wall-clock budget.

    python benchmarks/tasks/compare_algorithms.py --budget 60 --seeds 0 1 2 [--out bench_out/algos]

Each variant is the shipped config with a few overrides (``VARIANTS``), run through ``tune run``
(eager, fp32, the machine's threads). Its clock starts when step 1 is logged (start-up, model
loading and the first step are left out: the critic-free runs load one model less) and after
``--budget`` seconds the run gets SIGTERM: the recipe finishes the step in flight, saves and
exits. Then the held-out accuracy of the saved policy (``arithmetic_accuracy.py``: greedy, and
sampled at temperature 1, over the 500 problems no run trains on). Runs go one after another;
run it on a quiet machine. Prints one JSON line per run and a table of medians over the seeds.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PPO = "recipes/configs/tiny/ppo_tiny_arithmetic.yaml"
GRPO = "recipes/configs/tiny/grpo_tiny_arithmetic.yaml"

# name -> (config, overrides). 64 responses a step in every variant.
VARIANTS = {
    "ppo": (PPO, []),
    "ppo_orz": (PPO, ["gamma=1.0", "lmbda=1.0", "kl_coeff=0.0"]),
    "grpo_n4": (GRPO, []),
    "rloo_n4": (GRPO, ["advantage_estimator=rloo"]),
    "reinforce_pp": (GRPO, ["advantage_estimator=reinforce_plus_plus", "num_samples_per_prompt=1",
                            "batch_size=64", "forward_batch_size=32", "ppo_batch_size=32"]),
}


def _rows(log_dir: Path):
    sys.path.insert(0, str(ROOT))
    from torchtune_ppo.run.logs import read_disk_log

    try:
        return read_disk_log(log_dir)
    except (FileNotFoundError, ValueError, IndexError):
        return []


def run_one(name: str, seed: int, budget: float, out: Path) -> dict:
    config, overrides = VARIANTS[name]
    run_dir = out / f"{name}_seed{seed}"
    cmd = ["tune", "run", "ppo_full_finetune", "--config", str(ROOT / config), f"output_dir={run_dir}",
           f"seed={seed}", "num_ppo_steps=100000", "save_every_n_steps=null", "log_samples_every_n_steps=null",
           *overrides]
    log = open(out / f"{name}_seed{seed}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    started = None
    while proc.poll() is None:
        time.sleep(0.5)
        if started is None and _rows(run_dir / "logs"):
            started = time.monotonic()
        if started is not None and time.monotonic() - started >= budget:
            proc.send_signal(signal.SIGTERM)
            break
    proc.wait(timeout=300)
    rows = _rows(run_dir / "logs")
    if proc.returncode not in (0, 143) or not rows:
        raise RuntimeError(f"{name} seed {seed}: exit {proc.returncode}, see {log.name}")
    policy = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1])) / "policy"
    acc = subprocess.run([sys.executable, str(ROOT / "benchmarks/tasks/arithmetic_accuracy.py"), str(policy)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    accuracy = json.loads(acc.stdout.strip().splitlines()[-1])
    steps = sorted(r["time/step"] for r in rows[1:]) or [rows[0]["time/step"]]
    k = max(1, len(rows) // 5)
    return {"variant": name, "seed": seed, "steps": len(rows),
            "train_s_after_step_1": round(sum(r["time/step"] for r in rows[1:]), 1),
            "median_step_s": round(steps[len(steps) // 2], 4),
            "score_first_fifth": round(sum(r["scores"] for r in rows[:k]) / k, 4),
            "score_last_fifth": round(sum(r["scores"] for r in rows[-k:]) / k, 4),
            "greedy_accuracy": accuracy["greedy_accuracy"], "sampled_accuracy": accuracy["sampled_accuracy"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of training after step 1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="bench_out/algos")
    args = parser.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:  # seed-major: a slow spell of the machine hits every variant alike
        for name in args.variants:
            result = run_one(name, seed, args.budget, out)
            print(json.dumps(result), flush=True)
            results.append(result)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.budget:.0f} s of training after step 1; median over seeds {args.seeds}")
    print("| variant | steps | median step | held-out greedy | held-out sampled |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in args.variants:
        mine = [r for r in results if r["variant"] == name]
        med = {key: statistics.median(r[key] for r in mine)
               for key in ("steps", "median_step_s", "greedy_accuracy", "sampled_accuracy")}
        each = ", ".join(f"{100 * r['greedy_accuracy']:.1f}" for r in mine)
        print(f"| {name} | {med['steps']:.0f} | {med['median_step_s']:.3f} s | {100 * med['greedy_accuracy']:.1f}% "
              f"({each}) | {100 * med['sampled_accuracy']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
