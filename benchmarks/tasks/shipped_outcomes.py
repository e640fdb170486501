"""What each shipped config does when run as shipped: its reward curve and held-out accuracy.

    python benchmarks/tasks/shipped_outcomes.py                        # the five tiny configs, one after another
    python benchmarks/tasks/shipped_outcomes.py --configs smollm2/135M_ppo_tools.yaml --core 1

Each config (a path under ``recipes/configs/``) runs through ``tune run ppo_full_finetune`` with
only ``output_dir`` set (``--set key=value`` adds overrides for every run), one CPU thread,
pinned to ``--core``, this checkout's recipe and library first on ``PYTHONPATH``. Reported per
run, from its metric log: steps run, the mean training score over the first and the last fifth
of the steps, each evaluation set's ``pass@1`` at its first and last evaluation (greedy, as the
config evaluates), the median step time after the first, the whole run's minutes (model loading
and compiling included) and the recompiles after step 1. Prints one JSON line per run and a
markdown table; writes ``results.json`` to ``--out``. The SmolLM2 configs need the prepared model
(``python tools/prepare_smollm2.py``).
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
TINY = ["tiny/ppo_tiny_sentiment.yaml", "tiny/ppo_tiny_sentiment_lora.yaml", "tiny/ppo_tiny_arithmetic.yaml",
        "tiny/grpo_tiny_arithmetic.yaml", "tiny/ppo_tiny_tools.yaml"]


def summarize(run_dir: Path) -> Dict[str, Any]:
    from torchtune_ppo.run.logs import read_disk_log, read_eval_log

    rows, evals = read_disk_log(run_dir / "logs"), read_eval_log(run_dir / "logs")
    if not rows:
        raise RuntimeError(f"{run_dir}: no step logged")
    k = max(1, len(rows) // 5)
    scores = [r["scores"] for r in rows]
    accuracy: Dict[str, List[float]] = {}
    for _, row in evals:
        for key, value in row.items():
            if key == "val/pass@1" or (key.startswith("val/") and key.endswith("/pass@1")):
                accuracy.setdefault(key, []).append(value)
    return {
        "steps": len(rows),
        "score_first_fifth": round(statistics.fmean(scores[:k]), 4),
        "score_last_fifth": round(statistics.fmean(scores[-k:]), 4),
        "pass_at_1": {key: [round(v[0], 4), round(v[-1], 4)] for key, v in accuracy.items()},
        "median_step_s": round(statistics.median(r["time/step"] for r in rows[1:] or rows), 3),
        "recompiles": int(rows[-1].get("recompiles", 0)),
    }


def table(results: List[Dict[str, Any]]) -> str:
    lines = ["| config | steps | mean score, first fifth -> last fifth | held-out pass@1, first -> last evaluation | "
             "median step (s) | run (min) | recompiles |", "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in results:
        acc = "; ".join(f"`{k}` {100 * a:.1f}% -> {100 * b:.1f}%" for k, (a, b) in r["pass_at_1"].items()) or "not evaluated"
        lines.append(f"| `{r['config']}` | {r['steps']} | {r['score_first_fifth']:.3f} -> {r['score_last_fifth']:.3f} | "
                     f"{acc} | {r['median_step_s']:.3f} | {r['minutes']:.1f} | {r['recompiles']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=TINY, help="paths under recipes/configs/")
    p.add_argument("--core", type=int, default=0, help="the CPU core every run is pinned to")
    p.add_argument("--out", default="bench_out/shipped_outcomes")
    p.add_argument("--set", nargs="*", default=[], help="key=value overrides for every run")
    args = p.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(x for x in (str(ROOT), str(ROOT / "recipes"), os.environ.get("PYTHONPATH")) if x)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    results = []
    for config in args.configs:
        name = config.replace("/", "_").removesuffix(".yaml")
        run_dir = out / name
        cmd = ["taskset", "-c", str(args.core), "tune", "run", "ppo_full_finetune", "--config",
               str(ROOT / "recipes/configs" / config), f"output_dir={run_dir}", *args.set]
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            print(json.dumps({"config": config, "error": f"exit {rc}, see {out / f'{name}.log'}"}), flush=True)
            continue
        result = {"config": config, **summarize(run_dir), "minutes": round((time.perf_counter() - start) / 60, 2)}
        print(json.dumps(result), flush=True)
        results.append(result)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
