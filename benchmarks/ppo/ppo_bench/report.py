"""The report: markdown table and notes, JSON, and a stacked-bar chart of the phases."""

import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench_common.machine import verdict_lines
from bench_common.stats import format_ratio

from .summary import PHASES, RATIO_KEYS

PHASE_LABELS = {
    "generate": "generate",
    "score": "score",
    "advantages": "advantages",
    "loss_step": "loss+backward",
    "optimizer": "optimizer",
    "other": "other",
    "trajectory": "generate+score",
}


def hardware(device: str) -> str:
    """The accelerator (when ``device`` is CUDA) and the host CPU, in words."""
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name()} (host: {cpu_name()})"
    return cpu_name()


def cpu_name() -> str:
    """The CPU model name from ``lscpu`` and the core count."""
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
    """One line per row; rows that did not run show their status."""
    fastest_idx = next((i + 1 for i, r in enumerate(rows) if r["name"] == fastest), None)
    vs_fastest = f"vs fastest torchtune (row {fastest_idx})" if fastest_idx else "vs fastest torchtune"
    head = (
        "| # | row | step (s) | whole run (s) | generate | score | advantages | loss+backward "
        "| optimizer | other | generate share | trajectory tok/s | PPO tok/s | compile (s) "
        "| recompiles | response len (longest) | loss slots/token | peak mem (MiB) "
        f"| vs row 1 | {vs_fastest} |"
    )
    ncols = head.count("|") - 1
    lines = [head, "|---:|---|" + "---:|" * (ncols - 2)]
    for i, r in enumerate(rows, 1):
        if r["status"] != "ok":
            lines.append(f"| {i} | {r['label']} | {r['status']} |" + " |" * (ncols - 3))
            continue
        lines.append(
            f"| {i} | {r['label']} | {_f(r['step_s'])} | {_f(r['whole_run_s'], '.1f')} | "
            + " | ".join(_f(r[p]) for p in PHASES)
            + f" | {r['generate_share']:.0%} | {_f(r['trajectory_tok_s'], '.0f')} "
            f"| {_f(r['ppo_tok_s'], '.0f')} | {_f(r['compile_s'], '.1f')} "
            f"| {r['recompiles']} | {_f(r['response_len'], '.1f')}{_longest(r)} "
            f"| {_f(r['slots_per_token'], '.2f')} | {_f(r['peak_memory_mib'], '.0f')} "
            f"| {_x(r['speedup_vs_row1'])} | {_x(r['speedup_vs_fastest_torchtune'])} |"
        )
    return "\n".join(lines)


def _longest(row: Dict[str, Any]) -> str:
    """`` (L)``: the mean over measured steps of each batch's longest response, where known."""
    longest = row.get("longest_response")
    return "" if longest is None else f" ({longest:.1f})"


def ratio_table(rows: List[Dict[str, Any]], fastest: Optional[str]) -> str:
    """Per-pair ratios against the fastest torchtune row: step and phases, each the median over
    pairs with its 95% interval; the step also with min-max and the number of pairs."""
    fastest_idx = next((i + 1 for i, r in enumerate(rows) if r["name"] == fastest), None)
    if fastest_idx is None:
        return ""
    head = ["#", "row", "pairs", "step: median [95% interval] (min-max)"]
    head += [PHASE_LABELS[k] for k in RATIO_KEYS[1:]]
    lines = [
        f"Per-pair ratios, row {fastest_idx}'s time over each row's (above 1: faster than row "
        f"{fastest_idx}), medians over the measured pairs with their 95% interval:",
        "",
        "| " + " | ".join(head) + " |",
        "|---:|---|---:|" + "---:|" * (len(head) - 3),
    ]
    for i, r in enumerate(rows, 1):
        ratios = r.get("ratios_vs_fastest_torchtune")
        if r["status"] != "ok" or not ratios:
            continue
        step = ratios["step_s"]
        lines.append(f"| {i} | {r['label']} | {step['n'] if step else 0} | {format_ratio(step, spread=True)} | "
                     + " | ".join(format_ratio(ratios[k]) for k in RATIO_KEYS[1:]) + " |")
    return "\n".join(lines)


def _notes(rows: List[Dict[str, Any]]) -> List[str]:
    notes = [f"- row {i}: {r['reason'].splitlines()[0][:300] if r['reason'] else r['status']}"
             for i, r in enumerate(rows, 1) if "reason" in r]
    notes += [f"- row {i}: steps 1-6 are one compiled region, timed as *generate* (score is 0)."
              for i, r in enumerate(rows, 1) if r["name"].partition("@")[0] == "ours_rollout" and r["status"] == "ok"]
    notes += [f"- row {i}: {r['graphs_in_measured_steps']} graphs compiled during the measured "
              f"steps; the slowest measured step took {r['slowest_measured_step_s']:.1f} s (the "
              "median leaves it out, the whole run does not)."
              for i, r in enumerate(rows, 1) if r["status"] == "ok" and r["graphs_in_measured_steps"]]
    threads = sorted({r["threads"] for r in rows if "threads" in r})
    if threads:
        notes.append(f"- CPU threads in every row: {', '.join(map(str, threads))} "
                     "(torch.set_num_threads; our rows' cpu_threads set to match torchtune's)")
    return notes


def report_markdown(report: Dict[str, Any]) -> str:
    """The whole report as markdown: setup, table, what each column means, notes."""
    s = report["setup"]
    mem = "max allocated CUDA memory" if s["device"].startswith("cuda") else "max RSS of the row's process"
    lines = [
        "# PPO step benchmark",
        "",
        f"- hardware: {report['hardware']}",
        f"- command: `{report['command']}`",
        *verdict_lines(report["machine"], report["verdict"]),
        f"- {report['stop']}",
        f"- task: {s['model']}; {s['device']}, {s['dtype']}; batch_size {s['batch_size']}, "
        f"forward_batch_size {s['forward_batch_size']}, ppo_batch_size {s['ppo_batch_size']}, "
        f"ppo_epochs {s['ppo_epochs']}, P = {s['max_prompt_len']} (ours; torchtune pads each batch "
        f"to its longest prompt), T = {s['max_generated_tokens']}, temperature {s['temperature']}, "
        f"top_k {s['top_k']}, stop_token_ids {s['stop_token_ids']}; {s['warmup']} warm-up + "
        f"up to {s['max_steps']} measured steps per row, interleaved",
        f"- warm-up: {report.get('warmup_rounds', s['warmup'])} rounds run ({s['warmup']} planned, up to "
        f"{s.get('settle', 0)} more while a row compiled)"
        + (f"; still compiling when measuring began: {', '.join(report['still_compiling_after_warmup'])}"
           if report.get("still_compiling_after_warmup") else "; no row compiled in the last warm-up round"),
        "",
        markdown_table(report["rows"], report["fastest_torchtune"]),
        "",
        ratio_table(report["rows"], report["fastest_torchtune"]),
        "",
        "*step* is the median over the measured steps of one PPO step's wall time (trajectory, "
        "advantages, PPO epochs; computing and logging the metrics is left out): our recipe's "
        "`time/step`; for torchtune, from `generate_trajectory_batched` to `log_metrics`. "
        "*whole run* = the row's own wall time from the call of `train()` to the end of its last "
        "step, the waits for the other rows' steps left out: every step, the first step's "
        "compiles and any recompiles included, and the data loading and logging between steps "
        "(model loading and checkpoint writing left out). Each phase column "
        "is a median in seconds per step; *other* is the rest of the step (minibatch indexing, and "
        "torchtune's `zero_grad`). torchtune's *advantages* is the time between its trajectory "
        "and its first `ppo_step` (`get_rewards_ppo`, `estimate_advantages`, a `randperm` and one "
        "micro-batch's gather). "
        "*trajectory tok/s* = batch_size × (P + T) positions / (generate + score) seconds; "
        "*PPO tok/s* = ppo_epochs × batch_size × (P + T) / (loss+backward + optimizer) seconds, "
        "with P the prompt width the row used. *compile* = first-step time minus the steady-state "
        "median (compilation plus other first-call costs; each row starts with an empty inductor "
        "cache). *recompiles* = graphs dynamo compiled after the first step. "
        "*response len* = valid response tokens per row (stop token included), the mean over "
        "the measured steps (torchtune's recipe always generates T tokens and masks what follows "
        "the first stop token; ours stops once every row has stopped). *loss slots/token* = token "
        "slots the loss step ran on per real token it needed (a row's prompt tokens and its "
        "response up to the last valid token, less that one), the median over the measured "
        "steps: ours logs it (`loss_step_slots_per_token`, packed rows); torchtune's is its "
        "padded width, rows × (P' + T), over the same count of real tokens. "
        f"*peak mem* = {mem}, setup included. "
        "The rows ran interleaved, each in its own long-lived process: one step of each row a "
        "round, the order reversed every round, so each pair of steps met the same machine "
        "state. Speedups are medians over the measured rounds of per-pair ratios (the reference "
        "row's step over this row's step in the same round), not ratios of the medians; the "
        "95% interval is the order-statistics interval of that median.",
    ]
    notes = _notes(report["rows"])
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def write_chart(rows: List[Dict[str, Any]], path: Path) -> None:
    """A horizontal stacked bar per row, one segment per phase; skipped without matplotlib."""
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


def write_report(report: Dict[str, Any], out: Path) -> str:
    """Writes ``ppo_bench.json``, ``ppo_bench.md`` and ``ppo_bench.png`` to ``out``.

    Returns:
        str: the markdown.
    """
    (out / "ppo_bench.json").write_text(json.dumps(report, indent=2))
    md = report_markdown(report)
    (out / "ppo_bench.md").write_text(md)
    write_chart(report["rows"], out / "ppo_bench.png")
    return md
