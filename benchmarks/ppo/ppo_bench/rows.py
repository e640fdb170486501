"""What each row runs, and the worker process that runs one.

Each row runs in its own long-lived process (clean dynamo state, clean peak memory), started by
``running`` as ``python -m ppo_bench.rows --spec SPEC.json`` and driven one PPO step at a time
(``bench_common.protocol``). The spec holds everything the row needs (``recipe``, ``device``,
``threads``, ``cfg``). Each "step" reply holds one dict with ``step_s``, the phase seconds,
``prompt_len``, ``recompiles`` (graphs compiled since the end of step 1), ``graphs`` (graphs
compiled since ``train()`` began), ``response_len`` (the batch's mean valid response tokens), ``longest_response`` (its longest),
``slots_per_token`` (loss-step token slots per real token) and ``active_s`` (from the driver's
command to the step's end); the "done" reply adds ``whole_run_s``, ``policy_params``,
``threads`` and the peak memory.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple


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
    # with groups, these two are the reference of the _shared rows: each row its own prompt
    "ours_eager": Row("ours, eager", "ours", {"share_group_prefill": False, "compile": {
        "generate": False, "trajectory": False, "loss_step": False, "rollout": False}}),
    "ours_generate": Row("ours, + compile.generate", "ours", {"share_group_prefill": False, "compile": {
        "generate": True, "trajectory": False, "loss_step": False, "rollout": False}}),
    "ours_trajectory": Row("ours, + compile.trajectory", "ours", {"compile": {
        "generate": True, "trajectory": True, "loss_step": False, "rollout": False}}),
    "ours_all": Row("ours, + compile.loss_step (all)", "ours", {"compile": {
        "generate": True, "trajectory": True, "loss_step": True, "rollout": False}}),
    # compile.layers: one layer compiled per use, the regions compiled around the layer stack.
    "ours_layers": Row("ours, all compiled, compile.layers", "ours", {"compile": {
        "generate": True, "trajectory": True, "loss_step": True, "rollout": False, "layers": True}}),
    # share_group_prefill: a group's prompt computed once (generation, scoring, loss step; a GRPO config).
    "ours_eager_shared": Row("ours, eager, share_group_prefill", "ours", {"share_group_prefill": True, "compile": {
        "generate": False, "trajectory": False, "loss_step": False, "rollout": False}}),
    "ours_generate_shared": Row("ours, + compile.generate, share_group_prefill", "ours", {
        "share_group_prefill": True, "compile": {
            "generate": True, "trajectory": False, "loss_step": False, "rollout": False}}),
    # segment_attention on: packed rows attend by sequence (the A/B of the default masks).
    "ours_eager_segments": Row("ours, eager, segment_attention=True", "ours", {
        "share_group_prefill": False, "segment_attention": True, "compile": {
            "generate": False, "trajectory": False, "loss_step": False, "rollout": False}}),
    "ours_all_segments": Row("ours, all compiled, segment_attention=True", "ours", {
        "segment_attention": True, "compile": {
            "generate": True, "trajectory": True, "loss_step": True, "rollout": False}}),
    # compile.rollout replaces generate + trajectory: steps 1-6 are one compiled region.
    "ours_rollout": Row("ours, compile.rollout + loss_step", "ours", {"compile": {
        "generate": False, "trajectory": False, "loss_step": True, "rollout": True}}),
}
QUICK_ROWS = ("tt_eager", "ours_eager")
# --cpu-large: every row but compile.rollout, whose one graph unrolls all T = 64 decode steps
# (on the tiny task, T = 24, it already took 435 s to compile); --rows still runs it.
CPU_LARGE_ROWS = tuple(name for name in ROWS if name != "ours_rollout"
                       and not name.endswith(("_shared", "_segments", "_layers")))
# The default rows: the _shared ones only differ on a config with num_samples_per_prompt > 1, the
# _segments ones are an A/B of segment_attention (--rows).
DEFAULT_ROWS = tuple(name for name in ROWS if not name.endswith(("_shared", "_segments", "_layers")))


# A row name may carry a dtype, ``<row>@fp32`` or ``<row>@bf16``: the same row in that dtype
# (``--dtype`` for rows without one), so one run can set fp32 and bf16 rows side by side.
DTYPES = ("fp32", "bf16")


def split_name(name: str) -> Tuple[str, Optional[str]]:
    """``"tt_kv@bf16"`` -> ``("tt_kv", "bf16")``; ``"tt_kv"`` -> ``("tt_kv", None)``."""
    base, _, dtype = name.partition("@")
    return base, dtype or None


def check_name(name: str) -> Optional[str]:
    """What is wrong with a ``--rows`` name, or None."""
    base, dtype = split_name(name)
    if base not in ROWS:
        return f"unknown row {base!r}; valid: {list(ROWS)}"
    if dtype is not None and dtype not in DTYPES:
        return f"unknown dtype {dtype!r} in {name!r}; valid: {list(DTYPES)} (e.g. {base}@bf16)"
    return None


def row_of(name: str) -> Row:
    """The row a (possibly dtype-suffixed) name runs, its label naming the dtype when given."""
    base, dtype = split_name(name)
    row = ROWS[base]
    return row if dtype is None else Row(f"{row.label}, {dtype}", row.recipe, row.overrides)


# --gpu: every row of a run stays in memory while the rows take turns (four 1B-body models and
# their optimizer state each, ~25 GB), so two rows by default: torchtune's fastest, ours.
GPU_ROWS = ("tt_compile", "ours_all")


class _Row:
    """A row for ``protocol.serve``: the recipe's row, then its peak memory and threads."""

    def __init__(self, spec: Dict[str, Any]):
        import torch

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        if spec["recipe"] != "torchtune":
            # Our recipe sets its own thread count (cpu_threads, default: all cores but one);
            # every row runs with the same count as torchtune's.
            spec["cfg"]["cpu_threads"] = torch.get_num_threads()
        if spec["recipe"] == "torchtune":
            from .torchtune_row import TorchtuneRow as Recipe
        else:
            from .ours_row import OursRow as Recipe
        self.device = spec["cfg"]["device"]
        self.row = Recipe(spec["cfg"])
        self.info = {"threads": torch.get_num_threads()}

    def run(self, on_step) -> None:
        self.row.run(on_step)

    def finish(self) -> Dict[str, Any]:
        import torch

        from .device import peak_memory

        return {**self.row.finish(), "threads": torch.get_num_threads(), **peak_memory(self.device)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run one row of the PPO step benchmark as a worker.")
    parser.add_argument("--spec", type=Path, required=True)
    cli = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: bench_common
    from bench_common.protocol import serve

    serve(lambda: _Row(json.loads(cli.spec.read_text())))
