"""PPO step benchmark: the RFC's plan, step by step, against torchtune's own PPO recipe.

Every row runs full PPO steps on the same models, prompts, batch sizes, lengths and sampling
settings, each in its own long-lived process (clean dynamo state, clean peak memory, one
compile), and the rows take turns one PPO step at a time, A B, B A, A B, ..., so that each pair
of steps meets the same machine state:

    1-3  torchtune 0.6.1 ``ppo_full_finetune_single_device``: eager; + KV cache; + compile=True
    4-7  ours (``recipes/ppo_full_finetune.py``): eager; + compile.generate; + compile.trajectory;
         + compile.loss_step (everything on)
    8    ours with compile.rollout (steps 1-6 of the RFC as one compiled region) + compile.loss_step

After the warm-up rounds (``--warmup``, then up to ``--settle`` more while a row still compiled
graphs in the last round), rounds go on until every row's ratio to the fastest torchtune row
(the median of its per-pair step-time ratios) has a 95% interval within ``--target-width``
(default ±5%), or until ``--max-steps`` measured rounds (the report says which). The machine
state goes with the result (``bench_common.machine``), and a run during which another process
used the CPU is marked "NOT A HEADLINE".

Per row: median seconds per step over the measured steps (warm-up steps left out) split into
generate / score / advantages / loss+backward / optimizer / other; the whole run (every step,
compiles and recompiles included, waits for other rows left out); tokens/s, compile time,
recompiles after the first step, peak memory; speedups over row 1 and over the fastest
torchtune row as medians of per-pair ratios, per step and per phase, with 95% intervals.

Our recipe runs through its public seam, ``train(on_step=...)``, its times read from the step
metrics; torchtune's, which has none, through a subclass that times its public methods.

    python benchmarks/ppo/bench_ppo.py                      # tiny demo task, CPU, fp32
    python benchmarks/ppo/bench_ppo.py --quick              # rows 1 and 4, two tiny steps
    python benchmarks/ppo/bench_ppo.py --cpu-large          # CPU, fp32, 8-layer dim-256 policy, T = 64
    python benchmarks/ppo/bench_ppo.py --cpu-large --quick  # the same models, two tiny steps
    python benchmarks/ppo/bench_ppo.py --gpu                # CUDA, bf16, Llama-3.2-1B body
    python benchmarks/ppo/bench_ppo.py --smollm2            # CPU, fp32, SmolLM2-135M-Instruct, vocab 49152
    python benchmarks/ppo/bench_ppo.py --smollm2 --fixed-policy --workload long \
        --rows tt_compile@fp32,tt_compile@bf16,ours_all@bf16   # fp32 and bf16 rows side by side, T = 128

``--gpu`` builds random-weight HF checkpoints with the Llama-3.2-1B body (16 layers, dim 2048,
32/8 heads, MLP 8192) but the tiny tokenizer's vocabulary of 512, since the prompts and token
ids come from the tiny task; P = 16, T = 64. It keeps to a budget (450 s for all rows, 120 s a
row's own time, compile included) and reports the rows it had to cut as timed out or skipped.
Every row stays in GPU memory while the rows take turns, so its default rows are the two that
the headline compares (``rows.GPU_ROWS``).

``--cpu-large`` builds random-weight checkpoints the same way, for CPU and fp32: an 8-layer
dim-256 llama3_2 policy (8/4 heads, MLP 768, 6.4M parameters) and a 4-layer dim-128 llama
classifier as the reward/value model (4/2 heads, MLP 384), on the tiny task's prompts with
P = 12 and T = 64. A random-weight policy almost never samples eos, so both recipes stop
responses on the same 13 token ids (``random_model.CPU_LARGE``): lengths spread over 1-64,
about half of T at the first step and ~3/8 of T after it (the report's *response len*). Its
default rows leave out ``ours_rollout``, whose one unrolled graph grows with T (ask for it
with ``--rows``).

Two more rows, not run by default, measure ``share_group_prefill`` on a config with groups
(``num_samples_per_prompt`` > 1): ``ours_eager_shared`` and ``ours_generate_shared`` are
``ours_eager`` and ``ours_generate`` prefilling each prompt once per group, e.g.

    python benchmarks/ppo/bench_ppo.py --config recipes/configs/tiny/grpo_tiny_arithmetic.yaml \
        --rows ours_eager,ours_eager_shared --batch-size 16 --forward-batch-size 32 \
        --ppo-batch-size 32 --set num_samples_per_prompt=4

``--fixed-policy`` sets ``optimizer.lr=1e-30`` in every row: each step still generates, scores,
runs the PPO epochs and steps the optimizer, but the weights do not move, so the distribution of
response lengths stays that of step 1. While a policy learns, the work of a step changes with
its responses' lengths, and differently for each recipe (torchtune's generates and pads to the
batch's longest response, ours stops and packs at each row's), so the per-pair ratio drifts
over a run: on ``--cpu-large`` from 1.9x at step 2 (mean response 25 of 64 tokens) to ~4x once
responses averaged 6 tokens. A fixed policy measures one workload, the one of step 1.

``--smollm2`` runs the SmolLM2-135M-Instruct config (``recipes/configs/smollm2/135M_ppo_arithmetic.yaml``:
real pretrained weights, the real tokenizer and its vocabulary of 49152, chat prompts) for
every row. torchtune's recipe has no function rewards, so the reward model is a SmolLM2
classifier (the prepared checkpoint with a random head, ``value_head_init: normal``) in both
recipes; the value model starts from the policy with a zero head, as in the config. Prepare the
model first (``python tools/prepare_smollm2.py``).

Writes ``ppo_bench.md``, ``ppo_bench.json``, ``ppo_bench.png`` (matplotlib, optional) and one
log per row to ``--out``. The parts live in ``benchmarks/ppo/ppo_bench/``: ``rows`` (what each
row runs, in its worker process), ``running`` (starting the workers, budgets, timeouts,
interleaving), ``summary`` and ``report`` (medians, per-pair ratios, markdown, JSON, chart);
the interleaved driver, the worker protocol and the machine state are ``benchmarks/bench_common``.
"""

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

from bench_common.machine import CpuMeter, headline_verdict, loadavg, machine_info  # noqa: E402
from ppo_bench.random_model import CPU_LARGE, build_assets, gpu_preset  # noqa: E402
from ppo_bench.report import hardware, write_report  # noqa: E402
from ppo_bench.rows import CPU_LARGE_ROWS, DEFAULT_ROWS, DTYPES, GPU_ROWS, QUICK_ROWS, check_name  # noqa: E402
from ppo_bench.running import run_rows  # noqa: E402
from ppo_bench.summary import add_ratios  # noqa: E402

DEFAULT_CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
SMOLLM2_CONFIG = ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml"
TINY_MODEL = "tiny demo task (4-layer policy, 2-layer reward model)"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, with the defaults of the chosen mode (default, ``--quick``, ``--gpu``,
    ``--cpu-large``, ``--cpu-large --quick``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of our config (also carried into torchtune's), e.g. tokenizer.path=...")
    p.add_argument("--max-steps", "--steps", dest="max_steps", type=int, default=None,
                   help="measured steps per row at most (the cap on pairs; default 40, --gpu 10)")
    p.add_argument("--min-steps", type=int, default=None,
                   help="measured steps before the interval test may stop the run (default 6)")
    p.add_argument("--target-width", type=float, default=0.05,
                   help="stop once every ratio's 95%% interval is within ± this of its median")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (not measured)")
    p.add_argument("--settle", type=int, default=None,
                   help="warm-up steps added at most while a row still compiles (default 10; --quick 0)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--forward-batch-size", type=int, default=None)
    p.add_argument("--ppo-batch-size", type=int, default=None)
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--max-prompt-len", type=int, default=None, help="default: the config's")
    p.add_argument("--max-generated-tokens", type=int, default=None, help="default: the config's")
    p.add_argument("--fixed-policy", action="store_true",
                   help="optimizer.lr=1e-30 in every row: full PPO steps whose weights do not move, so "
                        "the response lengths, and with them each step's work, stay those of step 1")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every row (CPU)")
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    p.add_argument("--quick", action="store_true", help="rows 1 and 4, two tiny steps")
    models = p.add_mutually_exclusive_group()
    models.add_argument("--gpu", action="store_true",
                        help="CUDA, bf16, Llama-3.2-1B body (vocab 512), random weights")
    models.add_argument("--cpu-large", action="store_true",
                        help="CPU, fp32, 8-layer dim-256 policy and 4-layer dim-128 reward/value "
                             "model (vocab 512), random weights, T = 64, 13 stop token ids")
    models.add_argument("--smollm2", action="store_true",
                        help="CPU, fp32, SmolLM2-135M-Instruct (real weights, vocab 49152), "
                             "its chat arithmetic prompts, a SmolLM2 reward model with a random head")
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="every row's dtype (default fp32, --gpu bf16); a row named <row>@bf16 or "
                        "<row>@fp32 in --rows runs in that dtype instead")
    p.add_argument("--workload", choices=("arithmetic", "long"), default="arithmetic",
                   help="--smollm2: the arithmetic config's short answers (T = 12), or long answers "
                        "(T = 128: its other phrasings of the questions, no system line and no reply "
                        "prefix, which SmolLM2 answers at length, each of its own length)")
    p.add_argument("--layers", type=int, default=16, help="layers of the --gpu model (16: Llama-3.2-1B)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget for all rows; later rows are skipped (default: 450 with --gpu)")
    p.add_argument("--row-timeout-s", type=float, default=None,
                   help="limit of one row, compile included (default: 120 with --gpu)")
    args = p.parse_args(argv)
    if args.quick:
        defaults = dict(max_steps=1, min_steps=1, warmup=1, batch_size=4, forward_batch_size=4,
                        ppo_batch_size=4, max_generated_tokens=16 if args.cpu_large else 8)
    elif args.cpu_large:
        defaults = dict(max_steps=40, warmup=2, batch_size=32, forward_batch_size=16,
                        ppo_batch_size=16, max_generated_tokens=64)
    elif args.smollm2:
        # 16 prompts of the config, 12 tokens each: one step of torchtune's eager row takes
        # tens of seconds here, so fewer pairs, and the cap is what usually ends the run.
        defaults = dict(max_steps=8, warmup=2, batch_size=16, forward_batch_size=16,
                        ppo_batch_size=8)
        if args.workload == "long":
            defaults["max_generated_tokens"] = LONG_TOKENS
    elif args.gpu:
        defaults = dict(max_steps=10, warmup=2, batch_size=32, forward_batch_size=16,
                        ppo_batch_size=16, max_prompt_len=16, max_generated_tokens=64,
                        budget_s=450.0, row_timeout_s=120.0)
    else:
        defaults = dict(max_steps=40, warmup=2, batch_size=32, forward_batch_size=16, ppo_batch_size=16)
    defaults.setdefault("min_steps", 6)
    defaults.setdefault("settle", 0 if args.quick else 10)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smollm2 and args.config == DEFAULT_CONFIG:
        args.config = SMOLLM2_CONFIG
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    args.dtype = args.dtype or ("bf16" if args.gpu else "fp32")
    if args.rows:
        names = args.rows.split(",")
    else:
        names = list(QUICK_ROWS if args.quick else CPU_LARGE_ROWS if args.cpu_large or args.smollm2
                     else GPU_ROWS if args.gpu else DEFAULT_ROWS)
    problems = [e for e in map(check_name, names) if e]
    if problems:
        p.error("; ".join(problems))
    if len(set(names)) != len(names):
        p.error(f"--rows names a row twice: {names}")
    if args.workload != "arithmetic" and not args.smollm2:
        p.error("--workload is a --smollm2 option")
    args.row_names = names
    return args


LONG_TOKENS = 128
# --workload long: the questions asked otherwise (variants.json's ood split), with neither the
# config's system line ("Answer with the number only.") nor its reply prefix: SmolLM2 then
# explains before it answers, in replies of widely varying length, some past T.
LONG_DATASET = [
    "dataset.data_files=${ppo_asset:chat_arithmetic/variants.json}",
    "dataset.field=ood",
    "dataset.system_prompt=null",
    "dataset.response_prefix=null",
]


def smollm2_assets() -> "tuple[List[str], str]":
    """``--smollm2``: the overrides that swap the config's function reward for a SmolLM2 reward
    model with a random head (torchtune's recipe needs a reward model), and the model's words."""
    sys.path.insert(0, str(ROOT / "tools"))
    from prepare_smollm2 import DEFAULT_OUTPUT_DIR

    folder = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR") or DEFAULT_OUTPUT_DIR)
    if not (folder / "model.safetensors").exists():
        raise SystemExit(f"--smollm2 needs the prepared model in {folder}: run "
                         "`python tools/prepare_smollm2.py` (or set TORCHTUNE_PPO_SMOLLM2_DIR).")
    reward = [
        "reward=null",
        # A reward model reads no reference answers (torchtune's collate would tensorize them).
        "dataset.reference_column=null",
        "reward_checkpointer._component_=torchtune_ppo.models.ClassifierHFCheckpointer",
        f"reward_checkpointer.checkpoint_dir={folder}",
        "reward_checkpointer.checkpoint_files=[model.safetensors]",
        "reward_checkpointer.model_type=LLAMA3_2",
        "reward_checkpointer.value_head_init=normal",
        "reward_checkpointer.output_dir=${output_dir}/reward",
    ]
    words = ("SmolLM2-135M-Instruct (30 layers, dim 576, 9/3 heads, MLP 1536, vocab 49152, real "
             "weights) as policy, reference and value model (zero head); reward: the same body "
             "with a random head; chat arithmetic prompts")
    return reward, words


def setup_block(args: argparse.Namespace, ours: Dict[str, Any], model: str) -> Dict[str, Any]:
    """What every row shared, for the report's header."""
    return {
        "model": model, "device": args.device,
        # rows named <row>@<dtype> run in their own dtype
        "dtype": args.dtype if all("@" not in n for n in args.row_names) else f"{args.dtype} unless a row says",
        "batch_size": args.batch_size, "forward_batch_size": args.forward_batch_size,
        "ppo_batch_size": args.ppo_batch_size, "ppo_epochs": args.ppo_epochs,
        "max_prompt_len": ours["max_prompt_len"], "max_generated_tokens": ours["max_generated_tokens"],
        "temperature": ours["temperature"], "top_k": ours["top_k"],
        "stop_token_ids": list(ours["stop_token_ids"]),
        "warmup": args.warmup, "settle": args.settle, "max_steps": args.max_steps, "min_steps": args.min_steps,
        "target_width": args.target_width,
    }


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the benchmark and writes its report; returns the exit status."""
    args = parse_args(argv)
    import torch
    import torchtune

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; none is visible to torch.")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ppo_bench_"))
    model, models = TINY_MODEL, None
    if args.gpu or args.cpu_large:
        preset = gpu_preset(args.layers) if args.gpu else CPU_LARGE
        print(f"building random-weight checkpoints ({preset.describe()}) in {work}", flush=True)
        extra, policy, reward = build_assets(preset, work / "assets", args.dtype)
        # The user's --set comes last: it may change what the preset sets (stop_token_ids).
        args.set = extra + list(args.set)
        model, models = preset.describe(), (policy, reward)
    elif args.smollm2:
        extra, model = smollm2_assets()
        if args.workload == "long":
            extra += LONG_DATASET
            model += (f"; long answers: variants.json's ood questions, no system line or reply prefix, "
                      f"T = {args.max_generated_tokens}")
        args.set = extra + list(args.set)
    if args.fixed_policy:
        args.set = list(args.set) + ["optimizer.lr=1e-30"]
        model += "; fixed policy (optimizer.lr=1e-30 in every row: the weights do not move)"
    before, meter = loadavg(), CpuMeter()
    rows, ours, run, threads = run_rows(args, work, models, meter)
    fastest = add_ratios(rows, run.warmup)
    machine = {**machine_info(ROOT, threads), "loadavg_before": before, "loadavg_after": loadavg()}
    report = {
        "hardware": hardware(args.device),
        "torch": torch.__version__,
        "torchtune": torchtune.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/ppo/bench_ppo.py",
                                                     *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "verdict": headline_verdict(meter.total(), run.samples, threads),
        "stop": run.describe_stop(args.target_width, args.max_steps),
        "rounds": run.rounds,
        "warmup_rounds": run.warmup,
        "still_compiling_after_warmup": run.settling,
        "machine_per_round": run.samples,
        "setup": setup_block(args, ours, model),
        "fastest_torchtune": fastest,
        "rows": rows,
    }
    shutil.rmtree(work, ignore_errors=True)
    md = write_report(report, args.out)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
