"""Per-row summaries: steady-state medians, the whole run, compile cost, speedups."""

import statistics
from typing import Any, Dict, List, Optional

# The phases a step is split into; "other" is the step time the others leave.
PHASES = ("generate", "score", "advantages", "loss_step", "optimizer", "other")
TIMED_PHASES = PHASES[:-1]


def summarize(name: str, label: str, result: Dict[str, Any], *, warmup: int, batch_size: int,
              gen_tokens: int, ppo_epochs: int) -> Dict[str, Any]:
    """Summarizes one row's result: medians over the measured steps (warm-up steps left out).

    Args:
        name (str): the row's key in ``ROWS``.
        label (str): the row's label.
        result (Dict[str, Any]): what the row's process wrote (see ``ppo_bench.rows``), or a
            ``status`` other than ``"ok"`` with a ``reason``.
        warmup (int): the leading steps left out of the medians.
        batch_size (int): prompts per step.
        gen_tokens (int): generated tokens per prompt (T).
        ppo_epochs (int): passes over the batch per step.

    Returns:
        Dict[str, Any]: the row's table entry; ``steps`` keeps every step, with ``other``
        and the throughputs added.
    """
    row = {"name": name, "label": label, "status": result.get("status", "ok")}
    if row["status"] != "ok":
        row["reason"] = result.get("reason", "")
        return row
    steps = result["steps"]
    for step in steps:
        step["other"] = step["step_s"] - sum(step[p] for p in TIMED_PHASES)
        positions = batch_size * (step["prompt_len"] + gen_tokens)
        step["trajectory_tok_s"] = positions / (step["generate"] + step["score"])
        step["ppo_tok_s"] = ppo_epochs * positions / (step["loss_step"] + step["optimizer"])
    measured = steps[warmup:] or steps[-1:]
    first_measured = len(steps) - len(measured)
    med = lambda key: statistics.median(s[key] for s in measured)  # noqa: E731
    row.update({p: med(p) for p in PHASES})
    row.update(
        step_s=med("step_s"),
        whole_run_s=result["whole_run_s"],
        num_steps=len(steps),
        slowest_measured_step_s=max(s["step_s"] for s in measured),
        # "recompiles" counts from the end of step 1, so step i's minus step j's is what
        # steps j+1..i compiled.
        graphs_in_measured_steps=(steps[-1]["recompiles"] - steps[first_measured - 1]["recompiles"]
                                  if first_measured else 0),
        first_step_s=steps[0]["step_s"],
        first_step_graphs=steps[0]["graphs"],
        compile_s=max(0.0, steps[0]["step_s"] - med("step_s")),
        trajectory_tok_s=med("trajectory_tok_s"),
        ppo_tok_s=med("ppo_tok_s"),
        prompt_len=med("prompt_len"),
        recompiles=steps[-1]["recompiles"],
        # Mean over the measured steps of each batch's mean response length (stop token included).
        response_len=statistics.mean(s["response_len"] for s in measured),
        slots_per_token=_median_or_none([s.get("slots_per_token") for s in measured]),
        max_slots_per_token=_max_or_none([s.get("slots_per_token") for s in steps]),
        policy_params=result.get("policy_params"),
        peak_memory_mib=result["peak_memory_mib"],
        peak_memory_kind=result["peak_memory_kind"],
        steps=steps,
    )
    row["generate_share"] = row["generate"] / row["step_s"]
    return row


def _median_or_none(values: List[Optional[float]]) -> Optional[float]:
    return None if not values or None in values else statistics.median(values)


def _max_or_none(values: List[Optional[float]]) -> Optional[float]:
    return None if not values or None in values else max(values)


def add_speedups(rows: List[Dict[str, Any]]) -> Optional[str]:
    """Adds ``speedup_vs_row1`` and ``speedup_vs_fastest_torchtune`` (ratios of median step times).

    Args:
        rows (List[Dict[str, Any]]): summaries from ``summarize``, in table order.

    Returns:
        Optional[str]: the name of the fastest torchtune row, if any ran.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    first = next((r for r in ok if r["name"] == "tt_eager"), None)
    torchtune_rows = [r for r in ok if r["name"].startswith("tt_")]
    fastest = min(torchtune_rows, key=lambda r: r["step_s"]) if torchtune_rows else None
    for r in ok:
        r["speedup_vs_row1"] = first["step_s"] / r["step_s"] if first else None
        r["speedup_vs_fastest_torchtune"] = fastest["step_s"] / r["step_s"] if fastest else None
    return fastest["name"] if fastest else None
