"""GRPO steps with a group's prompt computed once (``share_group_prefill``) against each
response with its own prompt copy, on prompts long enough for the prompt to be most of the work.

Two rows per case, each our recipe in its own long-lived worker process, stepped in turns one
PPO step at a time (A B, B A, ...; ``bench_common.interleave``), warm-up steps left out:

- ``unshared``: ``share_group_prefill: false``: n prefills of each prompt, and every response
  scored and trained on with its own copy of its prompt; minibatches drawn row by row;
- ``shared``: ``share_group_prefill: true``: one prefill per group, one prompt copy per packed
  row in scoring (reference policy, reward model) and in the loss step; minibatches drawn by
  whole groups.

Each case runs GRPO (no value model) with ``num_samples_per_prompt`` = n on prompts of exactly
``P`` real tokens: each prompt is built from the task's own prompts (worked examples, then the
question) and cut to its last ``P`` tokens (``long_prompts: truncate``). The policy is fixed
(``optimizer.lr`` 1e-30): each step still generates, scores, runs the loss step, backward and
the optimizer, but both rows sample the same responses at every step, so both run one workload.
Reported per case: the median step and phase times (generate, score, loss step) of each row,
the speedup as the median of per-pair ratios (unshared / shared) with its 95% interval, the
loss step's slots per real token, and each row's peak memory (max RSS on CPU, setup included;
max allocated on CUDA).

    python benchmarks/ppo/bench_shared_prompt.py --tiny     # tiny sentiment models, under a minute
    python benchmarks/ppo/bench_shared_prompt.py --smollm2  # SmolLM2-135M-Instruct: P=256, n=8; P=96, n=4
    python benchmarks/ppo/bench_shared_prompt.py --smollm2-prefix --dtype bf16   # share_prompt_prefix

``--smollm2-prefix`` compares ``share_prompt_prefix: false`` (``unshared``) with ``true``
(``shared``: the prefix every prompt of a batch begins with, once per packed row in scoring and
the loss step) on the SmolLM2 arithmetic config itself (PPO with its value model and reward
function, its chat prompts, T = 12 unless ``--max-generated-tokens``), fixed policy as above.

``--smollm2`` reads the prepared model (``python tools/prepare_smollm2.py``; the folder
``$TORCHTUNE_PPO_SMOLLM2_DIR``, default ``~/.cache/torchtune_ppo/SmolLM2-135M-Instruct``) with
the arithmetic task's exact-match reward (a function: no reward model), fp32 on the CPU (``--device
cuda --dtype bf16`` on a GPU). ``--compile`` compiles every region (inductor; the default is
eager). Writes ``shared_prompt.md`` and ``shared_prompt.json`` and one log per row to ``--out``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent  # benchmarks/ppo: ppo_bench
BENCHMARKS = BENCH_DIR.parent  # benchmarks: bench_common
ROOT = BENCHMARKS.parent
sys.path[:0] = [str(BENCH_DIR), str(BENCHMARKS)]

from bench_common.interleave import RowFailed, run_interleaved  # noqa: E402
from bench_common.machine import machine_info  # noqa: E402
from bench_common.protocol import WorkerRow, serve  # noqa: E402
from bench_common.stats import format_ratio, pair_ratios, summarize_ratios  # noqa: E402

ROWS = {"unshared": False, "shared": True}
PHASES = ("step_s", "generate", "score", "loss_step", "optimizer")
# (prompt tokens P, responses per prompt n, prompts per step) of each case
SMOLLM2_CASES = [(256, 8, 4), (96, 4, 8)]
TINY_CASES = [(96, 8, 4)]  # one case, to stay under a minute


# --- the workload ---------------------------------------------------------------------------


def _asset(path: str) -> str:
    from omegaconf import OmegaConf

    import torchtune_ppo  # noqa: F401  registers ${ppo_asset:...}

    return OmegaConf.to_container(OmegaConf.create({"p": f"${{ppo_asset:{path}}}"}), resolve=True)["p"]


def write_prompts(kind: str, path: Path, count: int = 64, per_prompt: int = 40) -> None:
    """``count`` long prompts from the task's own: ``per_prompt`` earlier ones (with their answers,
    worked examples for the arithmetic task) and then a question; the recipe keeps the last ``P``
    tokens of each, so every prompt has exactly ``P`` real tokens."""
    if kind == "smollm2":
        problems = json.loads(Path(_asset("chat_arithmetic/problems.json")).read_text())["train"]
        records = []
        for i in range(count):
            shots = [problems[(i * per_prompt + j) % len(problems)] for j in range(per_prompt)]
            question = problems[(i * 7919 + 13) % len(problems)]
            context = "\n".join(f"{p['prompt']} {p['answer']}" for p in shots)
            records.append({"prompt": f"{context}\n{question['prompt']}", "answer": question["answer"]})
        path.write_text(json.dumps({"train": records}))
    else:
        openers = [r["prompt"] for r in json.loads(Path(_asset("tiny_sentiment/prompts.json")).read_text())]
        records = [{"prompt": " . ".join(openers[(i * per_prompt + j) % len(openers)] for j in range(per_prompt))}
                   for i in range(count)]
        path.write_text(json.dumps(records))


def case_config(args: argparse.Namespace, prompt_len: int, n: int, prompts: int, data: Path,
                out: Path, shared: bool) -> Dict[str, Any]:
    """A row's resolved recipe config."""
    from omegaconf import OmegaConf

    import torchtune_ppo  # noqa: F401

    responses = prompts * n
    common = {
        "output_dir": str(out), "advantage_estimator": "grpo", "num_samples_per_prompt": n,
        "share_group_prefill": shared, "batch_size": prompts, "forward_batch_size": responses,
        "ppo_batch_size": responses, "gradient_accumulation_steps": 1, "ppo_epochs": 1,
        "max_prompt_len": prompt_len, "long_prompts": "truncate",
        "max_generated_tokens": args.max_generated_tokens, "num_ppo_steps": args.warmup + args.max_steps,
        "kl_coeff": 0.0, "seed": 0, "device": args.device, "dtype": args.dtype,
        "save_every_n_steps": None, "log_every_n_steps": 1, "log_samples_every_n_steps": None,
        "compile": bool(args.compile), "optimizer": {"lr": 1e-30},  # a fixed policy: one workload
        "clip_grad_norm": None,
    }
    if args.kind == "prefix":  # the arithmetic config as shipped, n = 1, the prefix shared or not
        cfg = OmegaConf.load(ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml")
        for key in ("eval", "value_pretrain"):
            cfg.pop(key, None)
        cfg = OmegaConf.merge(cfg, {key: common[key] for key in (
            "output_dir", "num_ppo_steps", "seed", "device", "dtype", "save_every_n_steps", "log_every_n_steps",
            "log_samples_every_n_steps", "compile")}, {"share_prompt_prefix": shared, "batch_size": prompts,
                                                       "max_generated_tokens": args.max_generated_tokens})
        cfg.optimizer = OmegaConf.merge(cfg.optimizer, {"lr": 1e-30})
        return OmegaConf.to_container(cfg, resolve=True)
    if args.kind == "smollm2":
        cfg = OmegaConf.load(ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml")
        rows = prompt_len + n * args.max_generated_tokens  # room for a whole group's row
        specific = {
            "dataset": {"_component_": "torchtune_ppo.data.prompt_dataset", "source": "json",
                        "data_files": str(data), "field": "train", "column": "prompt",
                        "reference_column": "answer", "split": "train", "chat": False},
            "policy_model": {"max_seq_len": max(1024, rows)},
            "reward_and_value_model": None, "value_checkpointer": None,
            "temperature": 0.7, "top_k": None,
        }
    else:
        cfg = OmegaConf.load(ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml")
        specific = {"dataset": {"data_files": str(data)}}
    for key in ("eval", "value_pretrain", *(["dataset"] if args.kind == "smollm2" else [])):
        cfg.pop(key, None)  # evaluation and value pretraining off; the dataset replaced whole
    cfg = OmegaConf.merge(cfg, common, specific)
    cfg.optimizer = OmegaConf.merge(cfg.optimizer, {"lr": 1e-30})
    return OmegaConf.to_container(cfg, resolve=True)


# --- the worker -----------------------------------------------------------------------------


class _Row:
    def __init__(self, cfg: Dict[str, Any]):
        from ppo_bench.ours_row import OursRow

        self.device = cfg["device"]
        self.ours = OursRow(cfg)
        self.info = {"share": self.ours.recipe._group > 1 or self.ours.recipe._prefix}

    def run(self, on_step) -> None:
        self.ours.run(on_step)

    def finish(self) -> Dict[str, Any]:
        from ppo_bench.device import peak_memory

        return {**self.ours.finish(), **peak_memory(self.device)}


def worker(spec: Path) -> None:
    cfg = json.loads(spec.read_text())
    serve(lambda: _Row(cfg))


# --- the driver -----------------------------------------------------------------------------


def _median(steps: List[Dict[str, Any]], key: str) -> Optional[float]:
    values = [s[key] for s in steps if not s.get("warmup") and s.get(key) is not None]
    return statistics.median(values) if values else None


def run_case(args: argparse.Namespace, prompt_len: int, n: int, prompts: int, work: Path) -> Dict[str, Any]:
    name = "arithmetic" if args.kind == "prefix" else f"P{prompt_len}_n{n}"
    case_dir = work / name
    case_dir.mkdir(parents=True, exist_ok=True)
    data = case_dir / "prompts.json"
    if args.kind != "prefix":
        write_prompts(args.kind, data)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(p for p in (str(BENCH_DIR), str(BENCHMARKS), os.environ.get("PYTHONPATH"))
                                          if p))
    rows = {}
    for row, shared in ROWS.items():
        spec = case_dir / f"{row}.json"
        spec.write_text(json.dumps(case_config(args, prompt_len, n, prompts, data, case_dir / row, shared)))
        env_row = dict(env, TORCHINDUCTOR_CACHE_DIR=str(case_dir / "inductor" / row))
        rows[row] = WorkerRow(f"{name}_{row}", [([sys.executable, __file__, "--worker", str(spec)], env_row)],
                              args.out, limit_s=args.row_limit)
    print(f"{name}: {prompts} prompts x {n} responses, P = {prompt_len}, T = {args.max_generated_tokens}",
          flush=True)
    ready = {}
    for row, w in rows.items():  # one at a time: set-up and first compiles do not overlap
        w.start()
        ready[row] = w.ready()
    assert ready["shared"].get("share") and not ready["unshared"].get("share"), ready
    run = run_interleaved(rows, warmup=args.warmup, max_steps=args.max_steps, min_steps=args.min_steps,
                          target_width=args.target_width, reference=lambda steps: "unshared",
                          settle=1 if args.compile else 0)
    done = {}
    for row, w in rows.items():
        try:
            done[row] = w.stop()[0]
        except RowFailed as e:
            done[row] = {"error": str(e)}
    result = {"case": name, "prompt_len": prompt_len, "n": n, "prompts": prompts,
              "max_generated_tokens": args.max_generated_tokens, "stop": run.describe_stop(args.target_width,
                                                                                           args.max_steps),
              "failed": run.failed, "rows": {}}
    for row in rows:
        steps = run.steps[row]
        result["rows"][row] = {
            **{key: _median(steps, key) for key in PHASES},
            "slots_per_token": _median(steps, "slots_per_token"),
            "response_len": _median(steps, "response_len"),
            "recompiles_after_step_1": max((s.get("recompiles", 0) for s in steps[1:]), default=0),
            "peak_memory_mib": done[row].get("peak_memory_mib"),
            "peak_memory_kind": done[row].get("peak_memory_kind"),
            "steps": steps,
        }
    result["speedup"] = {key: summarize_ratios(pair_ratios(run.steps["unshared"], run.steps["shared"], key,
                                                           run.warmup))
                         for key in PHASES}
    return result


def markdown(results: List[Dict[str, Any]], args: argparse.Namespace, machine: Dict[str, Any]) -> str:
    title = ("The prefix every prompt shares computed once: PPO steps, SmolLM2 arithmetic" if args.kind == "prefix"
             else f"A group's prompt computed once: GRPO steps, {args.kind}")
    lines = [f"# {title}", "",
             f"{machine.get('cpu', '')}, {args.threads} thread(s), device {args.device}, {args.dtype}, "
             f"{'compiled' if args.compile else 'eager'}, commit {machine.get('commit', '?')}; rows interleaved, "
             f"{args.warmup} warm-up step(s) left out; speedups are medians of per-pair ratios (unshared / "
             "shared) with 95% intervals.", "",
             "| case | row | step s | generate s | score s | loss step s | slots/token | peak MiB | step speedup |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def f(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    for r in results:
        for row, m in r["rows"].items():
            speed = format_ratio(r["speedup"]["step_s"]) if row == "shared" else ""
            case = "the config's prompts" if args.kind == "prefix" else f"P={r['prompt_len']}, n={r['n']}"
            lines.append(f"| {case}, {r['prompts']} prompts | {row} | {f(m['step_s'])} | "
                         f"{f(m['generate'])} | {f(m['score'])} | {f(m['loss_step'])} | "
                         f"{f(m['slots_per_token'], '.2f')} | {f(m['peak_memory_mib'], '.0f')} | {speed} |")
    lines.append("")
    for r in results:
        phases = ", ".join(f"{k} {format_ratio(v)}" for k, v in r["speedup"].items() if v)
        lines.append(f"- {r['case']}: {phases}; {r['stop']}"
                     + (f"; failed: {r['failed']}" if r["failed"] else ""))
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--tiny", dest="kind", action="store_const", const="tiny")
    kind.add_argument("--smollm2", dest="kind", action="store_const", const="smollm2")
    kind.add_argument("--smollm2-prefix", dest="kind", action="store_const", const="prefix")
    kind.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench_shared_prompt"))
    parser.add_argument("--cases", default=None, help="e.g. 256x8x4,96x4x8: P x n x prompts per step")
    parser.add_argument("--max-generated-tokens", type=int, default=None, help="T (default 32; --tiny 8)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="measured steps at most (default 20; --tiny 3)")
    parser.add_argument("--min-steps", type=int, default=None, help="(default 6; --tiny 2)")
    parser.add_argument("--target-width", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--compile", action="store_true", help="compile every region (inductor)")
    parser.add_argument("--row-limit", type=float, default=None, help="a row's own seconds at most")
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    tiny = args.kind == "tiny"
    args.max_generated_tokens = args.max_generated_tokens or (8 if tiny else 12 if args.kind == "prefix" else 32)
    args.max_steps = args.max_steps if args.max_steps is not None else (3 if tiny else 20)
    args.min_steps = args.min_steps if args.min_steps is not None else (2 if tiny else 6)
    cases = TINY_CASES if tiny else [(None, 1, 16)] if args.kind == "prefix" else SMOLLM2_CASES
    if args.cases:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.kind in ("smollm2", "prefix"):
        folder = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR", Path.home() / ".cache/torchtune_ppo/SmolLM2-135M-Instruct"))
        if not (folder / "model.safetensors").is_file():
            raise SystemExit(f"no prepared SmolLM2 in {folder}: run python tools/prepare_smollm2.py first.")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    start = time.perf_counter()
    results = [run_case(args, p, n, prompts, work) for p, n, prompts in cases]
    machine = machine_info(ROOT, args.threads)
    text = markdown(results, args, machine)
    (args.out / "shared_prompt.md").write_text(text)
    (args.out / "shared_prompt.json").write_text(json.dumps(
        {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
         "wall_s": time.perf_counter() - start}, indent=1))
    print(text)
    return 0 if all(not r["failed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
