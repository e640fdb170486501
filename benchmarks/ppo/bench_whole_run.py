"""Whole-run benchmark: from the command to the last step, compile included, ours against
torchtune 0.6.1's ``ppo_full_finetune_single_device`` on the same models, prompts and settings.

A benchmark row's steady step is not what a user waits for: a run is. Each row here is one
``tune run`` of the SmolLM2 arithmetic config (``recipes/configs/smollm2/135M_ppo_arithmetic.yaml``,
``--steps`` PPO steps of 16 prompts, as shipped) through its recipe, timed from outside, with
its own inductor cache folder: ``cold`` runs start from an empty one, ``warm`` runs reuse the
folder of that row's cold run (a second run on the same machine). The rows run one after
another, never together (each uses every core).

Both recipes get the config that ``bench_ppo.py --smollm2`` gives its rows
(``ppo_bench.configs``): torchtune's recipe has no reward functions, so both score with a
SmolLM2 reward model (the prepared body with a random head); evaluation off (torchtune's recipe
has none); no gradient clipping and no checkpoint before the end (torchtune's clips nothing and
saves per epoch); our rows' ``cpu_threads`` is torch's default thread count, which torchtune's
recipe runs (``--threads`` sets another; the shipped ``auto`` would leave out a core another process keeps busy). Rows:

    ours          the config's compile setting (its shipped fast path), --dtype
    ours_eager    ours with compile=False
    ours_eval     ours with the config's own evaluation block (its seconds: time/eval)
    tt_compile    torchtune's fastest configuration: compile=True, enable_kv_cache=True
    tt_kv         torchtune eager with its KV cache

Reported per run: the wall clock of the whole command, and for ours the first step's and the
median later step's seconds and the evaluations' seconds (from its metrics log); torchtune logs
no step time. ``ours_eval`` evaluates as the shipped config does (every 10 steps and before
step 1, greedy, its held-out sets; scored here by the benchmark's reward model, so its accuracy
means nothing, its seconds do).

    python benchmarks/ppo/bench_whole_run.py                         # ours, tt_compile; cold then warm
    python benchmarks/ppo/bench_whole_run.py --rows ours,ours_eager,tt_compile --starts cold --steps 60
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
sys.path.insert(0, str(ROOT / "benchmarks/ppo"))  # ppo_bench, bench_ppo

from bench_common.machine import loadavg, machine_info  # noqa: E402
from bench_ppo import SMOLLM2_CONFIG, smollm2_assets  # noqa: E402
from ppo_bench.configs import ours_config, torchtune_config  # noqa: E402

ROWS = {
    "ours": ("ours", None),
    "ours_eager": ("ours", {"compile": False}),
    "ours_eval": ("ours", {"eval": "shipped"}),
    "tt_compile": ("torchtune", {"compile": True, "enable_kv_cache": True}),
    "tt_kv": ("torchtune", {"compile": False, "enable_kv_cache": True}),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/whole_run"))
    p.add_argument("--config", type=Path, default=SMOLLM2_CONFIG)
    p.add_argument("--steps", type=int, default=60, help="PPO steps of each run (the config's 60)")
    p.add_argument("--rows", default="ours,tt_compile", help=f"comma-separated, of {list(ROWS)}")
    p.add_argument("--starts", default="cold,warm", help="cold, warm or both (warm reuses the cold run's cache)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                   help="both recipes' dtype (default: what dtype=auto picks on this machine)")
    p.add_argument("--threads", type=int, default=None,
                   help="our rows' cpu_threads (default: torch's default thread count, which torchtune's recipe runs)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides of our config")
    args = p.parse_args(argv)
    args.row_names = args.rows.split(",")
    bad = [r for r in args.row_names if r not in ROWS]
    if bad:
        p.error(f"unknown row(s) {bad}; valid: {list(ROWS)}")
    args.start_names = args.starts.split(",")
    if any(s not in ("cold", "warm") for s in args.start_names):
        p.error(f"--starts takes cold and/or warm, got {args.starts!r}")
    return args


def configs(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    """Ours and torchtune's resolved configs (bench_ppo's --smollm2 rows, at the config's sizes)."""
    from omegaconf import OmegaConf

    from torchtune_ppo.config.precision import machine_dtype

    shipped = OmegaConf.load(args.config)
    dtype = args.dtype or (machine_dtype("cpu")[0] if shipped.get("dtype") == "auto" else shipped.dtype)
    extra, _ = smollm2_assets()
    sizes = argparse.Namespace(
        config=args.config, set=extra + list(args.set), warmup=0, max_steps=args.steps,
        batch_size=shipped.batch_size, forward_batch_size=shipped.forward_batch_size,
        ppo_batch_size=shipped.ppo_batch_size, ppo_epochs=shipped.ppo_epochs, device="cpu", dtype=dtype,
        max_prompt_len=None, max_generated_tokens=None)
    ours = ours_config(sizes, work / "ours_out", dtype=dtype)
    ours["compile"] = OmegaConf.to_container(shipped).get("compile", False)
    ours["compile_cache"] = False  # a second run's cache is the inductor folder, as for torchtune
    # torchtune's recipe runs torch's default threads (every core); ours gets the same count, as in
    # bench_ppo, whatever the machine's load at start-up (what `cpu_threads: auto` reads)
    ours["cpu_threads"] = args.threads
    tt = torchtune_config(ours, sizes)
    return {"ours": ours, "torchtune": tt, "dtype": dtype, "eval": OmegaConf.to_container(shipped).get("eval")}


def run_one(name: str, start: str, cfgs: Dict[str, Any], work: Path, logs: Path) -> Dict[str, Any]:
    """One whole run of row ``name``; its wall clock, and ours' step times."""
    import torchtune
    from omegaconf import OmegaConf

    recipe, overrides = ROWS[name]
    cfg = dict(cfgs[recipe], **(overrides or {}))
    if cfg.get("eval") == "shipped":
        cfg["eval"] = cfgs["eval"]
    out = work / f"{name}_{start}"
    cfg["output_dir"] = str(out)
    if recipe == "torchtune":
        for key in ("checkpointer", "ref_policy_checkpointer", "value_checkpointer", "reward_checkpointer"):
            cfg[key] = {**cfg[key], "output_dir": str(out / key)}
        cfg["metric_logger"] = {**cfg["metric_logger"], "log_dir": str(out / "logs")}
        cmd = [sys.executable, str(Path(torchtune.__file__).parents[1] / "recipes/ppo_full_finetune_single_device.py")]
    else:
        cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", "ppo_full_finetune"]
    config_path = work / f"{name}_{start}.yaml"
    OmegaConf.save(OmegaConf.create(cfg), config_path)
    cmd += ["--config", str(config_path)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor" / name),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "benchmarks/ppo"), os.environ.get("PYTHONPATH")) if p))
    print(f"[{time.strftime('%H:%M:%S')}] {name}, {start}: {' '.join(map(shlex.quote, cmd))}", flush=True)
    begin = time.perf_counter()
    with open(logs / f"{name}_{start}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - begin
    result = {"row": name, "start": start, "wall_s": round(wall, 1), "returncode": proc.returncode}
    if recipe == "ours" and proc.returncode == 0:
        from torchtune_ppo.run.logs import read_disk_log, read_eval_log

        records = read_disk_log(out / "logs")  # the training steps' rows
        steps = [r["time/step"] for r in records if "time/step" in r]
        evals = [r["time/eval"] for _, r in read_eval_log(out / "logs") if "time/eval" in r]
        result.update(steps=len(steps), first_step_s=round(steps[0], 1),
                      later_step_median_s=round(statistics.median(steps[1:]), 3) if len(steps) > 1 else None,
                      evaluations=len(evals), eval_s=[round(e, 1) for e in evals])
    print(f"    {result}", flush=True)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    args.threads = args.threads or torch.get_num_threads()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="whole_run_"))
    cfgs = configs(args, work)
    before = loadavg()
    results = [run_one(name, start, cfgs, work, args.out / "logs")
               for start in args.start_names for name in args.row_names]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/ppo/bench_whole_run.py",
                                                     *(sys.argv[1:] if argv is None else argv)]),
        "machine": {**machine_info(ROOT, torch.get_num_threads()), "loadavg_before": before,
                    "loadavg_after": loadavg()},
        "dtype": cfgs["dtype"], "steps": args.steps, "ours_cpu_threads": args.threads,
        "ours_compile": cfgs["ours"]["compile"], "runs": results,
    }
    (args.out / "whole_run.json").write_text(json.dumps(report, indent=2))
    lines = ["| row | start | whole run (s) | ours: first step (s) | ours: later step, median (s) | ours: evaluations (s) |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in results:
        evals = (f"{len(r['eval_s'])}, {sum(r['eval_s']):.1f} in all ({min(r['eval_s'])}-{max(r['eval_s'])} each)"
                 if r.get("eval_s") else "")
        lines.append(f"| {r['row']} | {r['start']} | {r['wall_s']} | {r.get('first_step_s', '')} | "
                     f"{r.get('later_step_median_s', '')} | {evals} |")
    for start in args.start_names:
        wall = {r["row"]: r["wall_s"] for r in results if r["start"] == start and r["returncode"] == 0}
        for row in ("ours", "ours_eager"):
            if row in wall and "tt_compile" in wall:
                lines.append(f"\n{start}: torchtune compiled / {row} = {wall['tt_compile'] / wall[row]:.2f}x")
    (args.out / "whole_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
