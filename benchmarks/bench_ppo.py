"""PPO step benchmark: the RFC's plan, step by step, against torchtune's own PPO recipe.

Every row runs full PPO steps on the same models, prompts, batch sizes, lengths and sampling
settings, in a fresh process (clean dynamo state, clean peak memory):

    1-3  torchtune 0.6.1 ``ppo_full_finetune_single_device``: eager; + KV cache; + compile=True
    4-7  ours (``recipes/ppo_full_finetune.py``): eager; + compile.generate; + compile.trajectory;
         + compile.loss_step (everything on)
    8    ours with compile.rollout (steps 1-6 of the RFC as one compiled region) + compile.loss_step

Per row: median seconds per step over the measured steps (warm-up steps left out) split into
generate / score / advantages / loss+backward / optimizer / other, tokens/s, compile time,
recompiles after the first step, peak memory, and speedups over row 1 and over the fastest
torchtune row.

    python benchmarks/bench_ppo.py                      # tiny demo task, CPU, fp32
    python benchmarks/bench_ppo.py --quick              # rows 1 and 4, two tiny steps
    python benchmarks/bench_ppo.py --gpu                # CUDA, bf16, Llama-3.2-1B body

``--gpu`` builds random-weight HF checkpoints with the Llama-3.2-1B body (16 layers, dim 2048,
32/8 heads, MLP 8192) but the tiny tokenizer's vocabulary of 512, since the prompts and token
ids come from the tiny task; P = 16, T = 64. It keeps to a budget (450 s for all rows, 120 s a
row, compile included) and reports the rows it had to cut as timed out or skipped.

Writes ``ppo_bench.md``, ``ppo_bench.json``, ``ppo_bench.png`` (matplotlib, optional) and one
log per row to ``--out``.
"""

import argparse
import functools
import json
import math
import os
import platform
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
PHASES = ("generate", "score", "advantages", "loss_step", "optimizer", "other")
PHASE_LABELS = {
    "generate": "generate",
    "score": "score",
    "advantages": "advantages",
    "loss_step": "loss+backward",
    "optimizer": "optimizer",
    "other": "other",
}

ROWS = {
    "tt_eager": ("torchtune, eager, no KV cache", {"compile": False, "enable_kv_cache": False}),
    "tt_kv": ("torchtune, eager, KV cache", {"compile": False, "enable_kv_cache": True}),
    "tt_compile": ("torchtune, compile=True, KV cache", {"compile": True, "enable_kv_cache": True}),
    "ours_eager": ("ours, eager", {"compile": False}),
    "ours_generate": ("ours, + compile.generate", {"compile": {"generate": True}}),
    "ours_trajectory": (
        "ours, + compile.trajectory",
        {"compile": {"generate": True, "trajectory": True}},
    ),
    "ours_all": (
        "ours, + compile.loss_step (all)",
        {"compile": {"generate": True, "trajectory": True, "loss_step": True}},
    ),
    "ours_rollout": (
        "ours, compile.rollout + loss_step",
        {"compile": {"rollout": True, "loss_step": True}},
    ),
}
QUICK_ROWS = ("tt_eager", "ours_eager")

# Llama-3.2-1B body. The vocabulary is the tiny tokenizer's (512), not Llama-3's 128,256:
# token ids must index the embedding, and the prompts come from the tiny task.
LLAMA_1B = dict(num_heads=32, num_kv_heads=8, embed_dim=2048, intermediate_dim=8192, norm_eps=1e-5)
GPU_VOCAB = 512
GPU_MAX_SEQ_LEN = 512


# --------------------------------------------------------------------------- timing helpers


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def compile_counts() -> Dict[str, int]:
    """Dynamo's counters: frames it converted and graphs it compiled, first compiles included.

    torch 2.13 counts ``frames.total`` only for ``fullgraph=False`` compiles, so
    ``stats.unique_graphs`` is the count that sees every compiled region.
    """
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["total"]), "graphs": int(counters["stats"]["unique_graphs"])}


def peak_memory_mib(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class StepClock:
    """Phase seconds of the open step; time outside a step (setup, the first zero_grad) is dropped."""

    def __init__(self, device: str):
        self.device = device
        self.steps: List[Dict[str, float]] = []
        self.current: Optional[Dict[str, float]] = None

    def add(self, phase: str, seconds: float) -> None:
        if self.current is not None:
            self.current[phase] = self.current.get(phase, 0.0) + seconds

    def timed(self, fn: Callable, phase: str) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.add(phase, time.perf_counter() - start)
            return out

        return wrapper


class _ModuleProxy:
    """A module as seen by the recipe, with some functions swapped for timed ones."""

    def __init__(self, module, **overrides):
        self._module, self._overrides = module, overrides

    def __getattr__(self, name):
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


class _TimedContext:
    """Times entering and leaving a context manager (KV-cache set-up and teardown)."""

    def __init__(self, ctx, clock: StepClock, phase: str):
        self.ctx, self.clock, self.phase = ctx, clock, phase

    def __enter__(self):
        start = time.perf_counter()
        out = self.ctx.__enter__()
        sync(self.clock.device)
        self.clock.add(self.phase, time.perf_counter() - start)
        return out

    def __exit__(self, *exc):
        start = time.perf_counter()
        out = self.ctx.__exit__(*exc)
        sync(self.clock.device)
        self.clock.add(self.phase, time.perf_counter() - start)
        return out


# --------------------------------------------------------------------------- rows (child processes)


def run_torchtune_row(spec: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """torchtune's recipe, driven through its own ``train()`` with its methods timed in place."""
    import runpy

    import torchtune
    from omegaconf import OmegaConf

    path = Path(torchtune.__file__).parents[1] / "recipes/ppo_full_finetune_single_device.py"
    recipe_cls = runpy.run_path(str(path))["PPOFullFinetuneRecipeSingleDevice"]
    cfg = OmegaConf.create({**spec["torchtune_cfg"], **overrides})
    recipe = recipe_cls(cfg=cfg)
    recipe.setup(cfg=cfg)

    device = cfg.device
    clock = StepClock(device)
    marks = {}
    # run_path hands back a copy of the module globals; the methods read the live ones.
    module_globals = recipe_cls.train.__globals__
    generation, rlhf = module_globals["generation"], module_globals["rlhf"]
    module_globals["generation"] = _ModuleProxy(
        generation, generate=clock.timed(generation.generate, "generate")
    )
    module_globals["rlhf"] = _ModuleProxy(
        rlhf,
        get_rewards_ppo=clock.timed(rlhf.get_rewards_ppo, "advantages"),
        estimate_advantages=clock.timed(rlhf.estimate_advantages, "advantages"),
    )
    cache_ctx = recipe.cache_ctx_manager
    recipe.cache_ctx_manager = lambda *a, **k: _TimedContext(cache_ctx(*a, **k), clock, "generate")
    recipe.ppo_step = clock.timed(recipe.ppo_step, "loss_step")
    recipe._optimizer.step = clock.timed(recipe._optimizer.step, "optimizer")
    recipe._optimizer.zero_grad = clock.timed(recipe._optimizer.zero_grad, "optimizer")
    recipe.save_checkpoint = lambda *a, **k: None  # writing weights is not part of a PPO step

    trajectory_fn, cleanup_fn = recipe.generate_trajectory_batched, recipe.cleanup_after_step

    def generate_trajectory_batched(input_ids):
        sync(device)
        marks["start"] = time.perf_counter()
        clock.current = {"prompt_len": input_ids.shape[1]}
        return clock.timed(trajectory_fn, "trajectory")(input_ids)

    def cleanup_after_step(*args, **kwargs):
        cleanup_fn(*args, **kwargs)
        sync(device)
        step = clock.current
        step["wall"] = time.perf_counter() - marks["start"]
        step["score"] = step.pop("trajectory") - step["generate"]
        step.update(compile_counts())
        clock.steps.append(step)
        clock.current = None

    recipe.generate_trajectory_batched = generate_trajectory_batched
    recipe.cleanup_after_step = cleanup_after_step
    recipe.train()
    recipe.cleanup()
    return {"steps": clock.steps}


def run_ours_row(spec: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """Our recipe class: ``setup()`` then ``train_step(prompts)`` per batch, metrics read back."""
    from omegaconf import OmegaConf

    from torchtune_ppo.config import validate_config

    cfg = OmegaConf.create(spec["ours_cfg"])
    cfg.compile = overrides["compile"]  # a bool or a block, replacing the config's
    try:
        cfg = validate_config(cfg)
    except ValueError as err:
        if "rollout" in str(err):
            return {"status": "n/a (not supported)", "reason": str(err)}
        raise
    from ppo_full_finetune import PPOFullFinetuneRecipe

    recipe = PPOFullFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    device, steps, epoch = cfg.device, [], 0
    while len(steps) < cfg.num_steps:
        recipe._sampler.set_epoch(epoch)
        for batch in recipe._dataloader:
            # _step_metrics reads the truncation count that train() normally stores.
            recipe._collate_truncated = int(batch["num_truncated"])
            prompts = batch["tokens"].to(device)
            sync(device)
            start = time.perf_counter()
            metrics = recipe.train_step(prompts)
            sync(device)
            wall = time.perf_counter() - start
            step = {p: metrics[f"time/{p}"] for p in PHASES if f"time/{p}" in metrics}
            step.update(wall=wall, prompt_len=prompts.shape[1], **compile_counts(),
                        recipe_recompiles=metrics["recompiles"])
            steps.append(step)
            if len(steps) == 1:
                recipe._recompiles.mark()
            if len(steps) == cfg.num_steps:
                break
        epoch += 1
    recipe.cleanup()
    return {"steps": steps}


def run_row(name: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    overrides = ROWS[name][1]
    device = spec["device"]
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    runner = run_torchtune_row if name.startswith("tt_") else run_ours_row
    result = runner(spec, dict(overrides))
    result.setdefault("status", "ok")
    if result["status"] == "ok":
        result["peak_memory_mib"] = peak_memory_mib(device)
        result["peak_memory_kind"] = "max allocated (CUDA)" if device.startswith("cuda") else "max RSS"
    Path(out_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------- configs (parent)


def ours_config(args, output_dir: Path) -> Dict[str, Any]:
    """Our recipe's config for the benchmark, resolved to plain values."""
    from omegaconf import OmegaConf

    import torchtune_ppo  # noqa: F401  registers the ${ppo_asset:...} resolver

    cfg = OmegaConf.load(args.config)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(args.set)))
    sizes = {
        "output_dir": str(output_dir),
        "num_steps": args.warmup + args.steps,
        "batch_size": args.batch_size,
        "forward_batch_size": args.forward_batch_size,
        "ppo_batch_size": args.ppo_batch_size,
        "ppo_epochs": args.ppo_epochs,
        "gradient_accumulation_steps": 1,
        "device": args.device,
        "dtype": args.dtype,
        "seed": 0,
        # torchtune's recipe clips nothing: both do the same optimizer work.
        "clip_grad_norm": None,
        "save_every_n_steps": None,
        "log_every_n_steps": 1,
        "compile": False,
    }
    if args.max_prompt_len:
        sizes["max_prompt_len"] = args.max_prompt_len
    if args.max_generated_tokens:
        sizes["max_generated_tokens"] = args.max_generated_tokens
    cfg = OmegaConf.merge(cfg, sizes)
    if cfg.get("top_p") is not None:
        raise SystemExit("top_p is set, but torchtune's recipe has no top_p: the rows would differ.")
    return OmegaConf.to_container(cfg, resolve=True)


def torchtune_config(ours: Dict[str, Any], args) -> Dict[str, Any]:
    """The same run as a ``ppo_full_finetune_single_device`` config."""
    same = (
        "output_dir tokenizer dataset policy_model reward_and_value_model checkpointer "
        "ref_policy_checkpointer value_checkpointer reward_checkpointer seed shuffle device dtype "
        "batch_size forward_batch_size ppo_epochs ppo_batch_size gradient_accumulation_steps "
        "optimizer max_generated_tokens temperature top_k stop_token_ids penalise_no_eos "
        "min_response_length reward_penalty kl_coeff gamma lmbda metric_logger log_every_n_steps"
    ).split()
    cfg = {k: ours[k] for k in same}
    loss = ours.get("loss") or {}
    cfg.update(
        num_steps=(args.warmup + args.steps) * args.batch_size,  # torchtune counts samples
        loss={
            "_component_": "torchtune.rlhf.loss.PPOLoss",
            "epsilon": loss.get("epsilon", 0.2),
            "value_clip_range": loss.get("value_clip_range", 0.2),
            "value_coeff": loss.get("value_coeff", 0.1),
        },
        resume_from_checkpoint=False,
        optimizer_in_bwd=False,
        enable_activation_checkpointing=False,
        whiten_rewards=False,
        log_peak_memory_stats=False,
        compile=False,
        enable_kv_cache=False,
    )
    return cfg


def build_gpu_assets(args, folder: Path) -> Tuple[List[str], Dict[str, Any], Dict[str, Any]]:
    """Random-weight HF checkpoints with a Llama-3.2-1B body.

    Returns the checkpointer overrides and the policy and reward/value model blocks.
    """
    import torch
    from safetensors.torch import save_file
    from torchtune.models import convert_weights
    from torchtune.models.llama2._component_builders import llama2_classifier
    from torchtune.models.llama3_2._component_builders import llama3_2
    from torchtune.rlhf.utils import reward_tune_to_hf

    dims = dict(LLAMA_1B, vocab_size=GPU_VOCAB, num_layers=args.layers, max_seq_len=GPU_MAX_SEQ_LEN)
    # torchtune 0.6.1 has no llama3.2 classifier builder: the reward/value model is the llama2
    # classifier with the same body (it differs only in RoPE scaling, moot with random weights).
    policy = {"_component_": "torchtune.models.llama3_2._component_builders.llama3_2", **dims}
    reward = {"_component_": "torchtune.models.llama2._component_builders.llama2_classifier",
              "num_classes": 1, **dims}
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    heads = dict(num_heads=LLAMA_1B["num_heads"], num_kv_heads=LLAMA_1B["num_kv_heads"],
                 dim=LLAMA_1B["embed_dim"])
    for name, build, to_hf in (
        ("policy", llama3_2, convert_weights.tune_to_hf),
        ("reward", lambda **d: llama2_classifier(num_classes=1, **d), reward_tune_to_hf),
    ):
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in build(**dims).state_dict().items()}
        state = {
            k: torch.ones(s, dtype=dtype) if k.endswith("scale")
            else (torch.randn(s, generator=gen) * 0.02).to(dtype)
            for k, s in shapes.items()
        }
        (folder / name).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in to_hf(state, **heads).items()},
                  str(folder / name / "model.safetensors"))
        hf_config = {
            "hidden_size": LLAMA_1B["embed_dim"], "num_attention_heads": LLAMA_1B["num_heads"],
            "num_key_value_heads": LLAMA_1B["num_kv_heads"], "num_hidden_layers": args.layers,
            "intermediate_size": LLAMA_1B["intermediate_dim"], "vocab_size": GPU_VOCAB,
            "tie_word_embeddings": name == "policy",
        }
        (folder / name / "config.json").write_text(json.dumps(hf_config))
    model_type = {"checkpointer": "LLAMA3_2", "ref_policy_checkpointer": "LLAMA3_2",
                  "value_checkpointer": "REWARD", "reward_checkpointer": "REWARD"}
    out = []
    for key, kind in model_type.items():
        sub = "policy" if kind == "LLAMA3_2" else "reward"
        out += [f"{key}.checkpoint_dir={folder / sub}", f"{key}.model_type={kind}",
                f"{key}.checkpoint_files=[model.safetensors]"]
    return out, policy, reward


# --------------------------------------------------------------------------- aggregation


def summarize(name: str, result: Dict[str, Any], warmup: int, batch_size: int,
              gen_tokens: int, ppo_epochs: int) -> Dict[str, Any]:
    """Steady-state medians of one row; warm-up steps are left out."""
    row = {"name": name, "label": ROWS[name][0], "status": result.get("status", "ok")}
    if row["status"] != "ok":
        row["reason"] = result.get("reason", "")
        return row
    steps = result["steps"]
    for step in steps:
        step["other"] = max(0.0, step["wall"] - sum(step.get(p, 0.0) for p in PHASES[:-1]))
        positions = batch_size * (step["prompt_len"] + gen_tokens)
        step["trajectory_tok_s"] = positions / (step["generate"] + step["score"])
        step["ppo_tok_s"] = ppo_epochs * positions / (step["loss_step"] + step["optimizer"])
    measured = steps[warmup:] or steps[-1:]
    med = lambda key: statistics.median(s.get(key, 0.0) for s in measured)  # noqa: E731
    row.update({p: med(p) for p in PHASES})
    row.update(
        step_s=med("wall"),
        slowest_measured_step_s=max(s["wall"] for s in measured),
        graphs_in_measured_steps=steps[-1]["graphs"] - steps[len(steps) - len(measured) - 1]["graphs"]
        if len(measured) < len(steps) else 0,
        first_step_s=steps[0]["wall"],
        compile_s=max(0.0, steps[0]["wall"] - med("wall")),
        trajectory_tok_s=med("trajectory_tok_s"),
        ppo_tok_s=med("ppo_tok_s"),
        prompt_len=med("prompt_len"),
        recompiles=steps[-1]["graphs"] - steps[0]["graphs"],
        recompiled_frames=steps[-1]["frames"] - steps[0]["frames"],
        peak_memory_mib=result["peak_memory_mib"],
        peak_memory_kind=result["peak_memory_kind"],
        steps=steps,
    )
    row["generate_share"] = row["generate"] / row["step_s"]
    return row


def add_speedups(rows: List[Dict[str, Any]]) -> Optional[str]:
    ok = [r for r in rows if r["status"] == "ok"]
    first = next((r for r in ok if r["name"] == "tt_eager"), None)
    torchtune_rows = [r for r in ok if r["name"].startswith("tt_")]
    fastest = min(torchtune_rows, key=lambda r: r["step_s"]) if torchtune_rows else None
    for r in ok:
        r["speedup_vs_row1"] = first["step_s"] / r["step_s"] if first else None
        r["speedup_vs_fastest_torchtune"] = fastest["step_s"] / r["step_s"] if fastest else None
    return fastest["name"] if fastest else None


# --------------------------------------------------------------------------- report


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name()} (host: {cpu_name()})"
    return cpu_name()


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def _f(x: Optional[float], fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown_table(rows: List[Dict[str, Any]], fastest: Optional[str]) -> str:
    fastest_idx = next((i + 1 for i, r in enumerate(rows) if r["name"] == fastest), None)
    vs_fastest = f"vs fastest torchtune (row {fastest_idx})" if fastest_idx else "vs fastest torchtune"
    head = (
        "| # | row | step (s) | generate | score | advantages | loss+backward | optimizer | other "
        "| generate share | trajectory tok/s | PPO tok/s | compile (s) | recompiles: graphs (frames) "
        f"| peak mem (MiB) | vs row 1 | {vs_fastest} |"
    )
    lines = [head, "|---:|---|" + "---:|" * 15]
    for i, r in enumerate(rows, 1):
        if r["status"] != "ok":
            lines.append(f"| {i} | {r['label']} | {r['status']} |" + " |" * 14)
            continue
        lines.append(
            f"| {i} | {r['label']} | {_f(r['step_s'])} | "
            + " | ".join(_f(r[p]) for p in PHASES)
            + f" | {r['generate_share']:.0%} | {_f(r['trajectory_tok_s'], '.0f')} "
            f"| {_f(r['ppo_tok_s'], '.0f')} | {_f(r['compile_s'], '.1f')} "
            f"| {r['recompiles']} ({r['recompiled_frames']}) | {_f(r['peak_memory_mib'], '.0f')} "
            f"| {_x(r['speedup_vs_row1'])} | {_x(r['speedup_vs_fastest_torchtune'])} |"
        )
    return "\n".join(lines)


def report_markdown(report: Dict[str, Any]) -> str:
    s = report["setup"]
    mem = "max allocated CUDA memory" if s["device"].startswith("cuda") else "max RSS of the row's process"
    lines = [
        "# PPO step benchmark",
        "",
        f"- hardware: {report['hardware']}",
        f"- torch {report['torch']}, torchtune {report['torchtune']}; {report['date']}",
        f"- command: `{report['command']}`",
        f"- load average (1/5/15 min) at start: {report['loadavg_start']}, at end: {report['loadavg_end']}",
        f"- task: {s['model']}; {s['device']}, {s['dtype']}; batch_size {s['batch_size']}, "
        f"forward_batch_size {s['forward_batch_size']}, ppo_batch_size {s['ppo_batch_size']}, "
        f"ppo_epochs {s['ppo_epochs']}, P = {s['max_prompt_len']} (ours; torchtune pads each batch "
        f"to its longest prompt), T = {s['max_generated_tokens']}, temperature {s['temperature']}, "
        f"top_k {s['top_k']}; {s['warmup']} warm-up + {s['steps']} measured steps per row",
        "",
        markdown_table(report["rows"], report["fastest_torchtune"]),
        "",
        "Seconds are medians over the measured steps; each phase column is seconds per step. "
        "*other* is the rest of the step (minibatch indexing, metrics, logging). "
        "*trajectory tok/s* = batch_size × (P + T) positions / (generate + score) seconds; "
        "*PPO tok/s* = ppo_epochs × batch_size × (P + T) / (loss+backward + optimizer) seconds, "
        "with P the prompt width the row used. *compile* = first-step time minus the steady-state "
        "median (compilation plus other first-call costs; each row starts with an empty inductor "
        "cache). *recompiles* = graphs dynamo compiled "
        "after the first step (`counters[\"stats\"][\"unique_graphs\"]`); in brackets the frames it "
        "converted (`counters[\"frames\"][\"total\"]`, which torch 2.13 leaves unchanged for "
        f"`fullgraph=True` compiles). *peak mem* = {mem}, setup included. Speedups are ratios of step "
        "times measured in this run.",
    ]
    notes = [f"- row {i}: {r['reason'].splitlines()[0][:300]}"
             for i, r in enumerate(report["rows"], 1) if r.get("reason")]
    notes += [f"- row {i}: steps 1-6 are one compiled region, timed as *generate* (score is 0)."
              for i, r in enumerate(report["rows"], 1)
              if r["name"] == "ours_rollout" and r["status"] == "ok"]
    notes += [f"- row {i}: {r['graphs_in_measured_steps']} graphs compiled during the measured steps; "
              f"the slowest measured step took {r['slowest_measured_step_s']:.1f} s (the median leaves it out)."
              for i, r in enumerate(report["rows"], 1)
              if r["status"] == "ok" and r["graphs_in_measured_steps"]]
    loads = [f"{i}: {r['loadavg_1min_after']}" for i, r in enumerate(report["rows"], 1)
             if "loadavg_1min_after" in r]
    if loads:
        notes.append("- 1-min load average when each row ended (row: load): " + ", ".join(loads))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def write_chart(rows: List[Dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); skipping the chart.")
        return
    ok = [(i, r) for i, r in enumerate(rows, 1) if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(ok) + 1.5))
    labels = [f"{i}. {r['label']}" for i, r in ok]
    left = [0.0] * len(ok)
    for phase in PHASES:
        widths = [r[phase] for _, r in ok]
        ax.barh(labels, widths, left=left, label=PHASE_LABELS[phase])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per PPO step (median)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- driver


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides of our config (also carried into torchtune's), e.g. tokenizer.path=...")
    p.add_argument("--steps", type=int, default=None, help="measured steps per row")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (not measured)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--forward-batch-size", type=int, default=None)
    p.add_argument("--ppo-batch-size", type=int, default=None)
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--max-prompt-len", type=int, default=None, help="default: the config's")
    p.add_argument("--max-generated-tokens", type=int, default=None, help="default: the config's")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every row (CPU)")
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    p.add_argument("--quick", action="store_true", help="rows 1 and 4, two tiny steps")
    p.add_argument("--gpu", action="store_true",
                   help="CUDA, bf16, Llama-3.2-1B body (vocab 512), random weights")
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=16, help="layers of the --gpu model (16: Llama-3.2-1B)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget for all rows; later rows are skipped (default: 450 with --gpu)")
    p.add_argument("--row-timeout-s", type=float, default=None,
                   help="limit of one row, compile included (default: 120 with --gpu)")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        defaults = dict(steps=1, warmup=1, batch_size=4, forward_batch_size=4, ppo_batch_size=4,
                        max_generated_tokens=8)
    elif args.gpu:
        defaults = dict(steps=3, warmup=2, batch_size=32, forward_batch_size=16, ppo_batch_size=16,
                        max_prompt_len=16, max_generated_tokens=64, budget_s=450.0,
                        row_timeout_s=120.0)
    else:
        defaults = dict(steps=4, warmup=2, batch_size=32, forward_batch_size=16, ppo_batch_size=16)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    args.dtype = args.dtype or ("bf16" if args.gpu else "fp32")
    names = args.rows.split(",") if args.rows else list(QUICK_ROWS if args.quick else ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; valid: {list(ROWS)}")
    args.row_names = names
    return args


def launch_row(name: str, spec_path: Path, work: Path, logs: Path, timeout: Optional[float]) -> Dict[str, Any]:
    out_path, log_path = work / f"{name}.json", logs / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", name,
           "--spec", str(spec_path), "--row-out", str(out_path)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor" / name))
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


# Execution order: the anchors and our end point first, so that a time budget cuts the
# intermediate rows, and compile.rollout (one unrolled graph, the longest compile) last.
RUN_ORDER = ("tt_eager", "tt_kv", "ours_eager", "ours_all", "tt_compile", "ours_generate",
             "ours_trajectory", "ours_rollout")


def run_rows(args, work: Path, gpu_models) -> List[Dict[str, Any]]:
    """Each row in its own process, with its own empty inductor cache (so that its compile time
    is a cold start); rows come back in table order."""
    order = sorted(args.row_names, key=RUN_ORDER.index)
    start, rows = time.perf_counter(), {}
    for name in order:
        ours = ours_config(args, work / name)
        if gpu_models:
            ours["policy_model"], ours["reward_and_value_model"] = gpu_models
        spec = {"device": args.device, "threads": args.threads, "ours_cfg": ours,
                "torchtune_cfg": torchtune_config(ours, args)}
        spec_path = work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        if args.row_timeout_s is not None:
            left = args.row_timeout_s if left is None else min(left, args.row_timeout_s)
        if left is not None and left < 10:
            result = {"status": "skipped (time budget)", "reason": f"budget of {args.budget_s:.0f} s spent"}
        else:
            print(f"[{time.perf_counter() - start:6.0f} s] {name}: {ROWS[name][0]}", flush=True)
            result = launch_row(name, spec_path, work, args.out / "logs", left)
        r = rows[name] = summarize(name, result, args.warmup, args.batch_size,
                                   ours["max_generated_tokens"], args.ppo_epochs)
        r["loadavg_1min_after"] = round(os.getloadavg()[0], 2)
        print(f"    {r['status']}" + (f": {r['step_s']:.3f} s/step" if r["status"] == "ok"
                                       else f" {r.get('reason', '')}"), flush=True)
    args.resolved = ours
    return [rows[n] for n in args.row_names]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.row:
        run_row(args.row, args.spec, args.row_out)
        return 0
    import torch
    import torchtune

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; none is visible to torch.")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ppo_bench_"))
    model = "tiny demo task (4-layer policy, 2-layer reward model)"
    gpu_models = None
    if args.gpu:
        print(f"building random Llama-3.2-1B-body checkpoints ({args.layers} layers) in {work}", flush=True)
        extra, policy, reward = build_gpu_assets(args, work / "assets")
        args.set = list(args.set) + extra
        gpu_models = (policy, reward)
        model = (f"Llama-3.2-1B body ({args.layers} layers, dim 2048, 32/8 heads, MLP 8192), "
                 f"vocab {GPU_VOCAB} (the tiny tokenizer's), random weights; reward/value: same body")
    loadavg_start = "%.2f / %.2f / %.2f" % os.getloadavg()
    rows = run_rows(args, work, gpu_models)
    fastest = add_speedups(rows)
    ours = args.resolved
    report = {
        "hardware": hardware(args.device),
        "torch": torch.__version__,
        "torchtune": torchtune.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_ppo.py",
                                                     *(sys.argv[1:] if argv is None else argv)]),
        "loadavg_start": loadavg_start,
        "loadavg_end": "%.2f / %.2f / %.2f" % os.getloadavg(),
        "setup": {
            "model": model, "device": args.device, "dtype": args.dtype,
            "batch_size": args.batch_size, "forward_batch_size": args.forward_batch_size,
            "ppo_batch_size": args.ppo_batch_size, "ppo_epochs": args.ppo_epochs,
            "max_prompt_len": ours["max_prompt_len"], "max_generated_tokens": ours["max_generated_tokens"],
            "temperature": ours["temperature"], "top_k": ours["top_k"],
            "warmup": args.warmup, "steps": args.steps,
        },
        "fastest_torchtune": fastest,
        "rows": rows,
    }
    shutil.rmtree(work, ignore_errors=True)
    (args.out / "ppo_bench.json").write_text(json.dumps(report, indent=2))
    md = report_markdown(report)
    (args.out / "ppo_bench.md").write_text(md)
    write_chart(rows, args.out / "ppo_bench.png")
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
