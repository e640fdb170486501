"""What each row runs, and the child process that runs one.

Each row runs in a fresh process (clean dynamo state, clean peak memory), started by
``running.launch_row`` as ``python -m ppo_bench.rows --spec SPEC.json --out RESULT.json``.
The spec holds everything the row needs (``recipe``, ``device``, ``threads``, ``cfg``); the
result is ``{"status": "ok", "steps": [...], "whole_run_s": ..., "policy_params": ...,
"peak_memory_mib": ...}``, one dict per step with ``step_s``, the phase seconds,
``prompt_len``, ``recompiles`` (graphs compiled since the end of step 1), ``graphs`` (graphs
compiled since ``train()`` began), ``response_len`` (the batch's mean valid response tokens)
and ``slots_per_token`` (loss-step token slots per real token).
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict


@dataclass(frozen=True)
class Row:
    """One row of the table: which recipe runs, and what its config changes."""

    label: str
    recipe: str  # "torchtune" or "ours"
    overrides: Dict[str, Any]


# Our rows name every compile region: the config refuses a block that leaves one out.
ROWS = {
    "tt_eager": Row("torchtune, eager, no KV cache", "torchtune",
                    {"compile": False, "enable_kv_cache": False}),
    "tt_kv": Row("torchtune, eager, KV cache", "torchtune",
                 {"compile": False, "enable_kv_cache": True}),
    "tt_compile": Row("torchtune, compile=True, KV cache", "torchtune",
                      {"compile": True, "enable_kv_cache": True}),
    "ours_eager": Row("ours, eager", "ours", {"compile": {
        "generate": False, "trajectory": False, "loss_step": False, "rollout": False}}),
    "ours_generate": Row("ours, + compile.generate", "ours", {"compile": {
        "generate": True, "trajectory": False, "loss_step": False, "rollout": False}}),
    "ours_trajectory": Row("ours, + compile.trajectory", "ours", {"compile": {
        "generate": True, "trajectory": True, "loss_step": False, "rollout": False}}),
    "ours_all": Row("ours, + compile.loss_step (all)", "ours", {"compile": {
        "generate": True, "trajectory": True, "loss_step": True, "rollout": False}}),
    # compile.rollout replaces generate + trajectory: steps 1-6 are one compiled region.
    "ours_rollout": Row("ours, compile.rollout + loss_step", "ours", {"compile": {
        "generate": False, "trajectory": False, "loss_step": True, "rollout": True}}),
}
QUICK_ROWS = ("tt_eager", "ours_eager")
# --cpu-large: every row but compile.rollout, whose one graph unrolls all T = 64 decode steps
# (on the tiny task, T = 24, it already took 435 s to compile); --rows still runs it.
CPU_LARGE_ROWS = tuple(name for name in ROWS if name != "ours_rollout")


def run_row(spec_path: Path, out_path: Path) -> None:
    """Runs the row described by the spec at ``spec_path``; writes its result to ``out_path``."""
    from .device import peak_memory

    spec = json.loads(Path(spec_path).read_text())
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if spec["recipe"] != "torchtune":
        # Our recipe sets its own thread count (cpu_threads, default: all cores but one);
        # every row runs with the same count as torchtune's.
        spec["cfg"]["cpu_threads"] = torch.get_num_threads()
    if spec["recipe"] == "torchtune":
        from .torchtune_row import run_torchtune_row as run
    else:
        from .ours_row import run_ours_row as run
    result = run(spec["cfg"])
    result.update(status="ok", threads=torch.get_num_threads(), **peak_memory(spec["cfg"]["device"]))
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run one row of the PPO step benchmark.")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    run_row(cli.spec, cli.out)
