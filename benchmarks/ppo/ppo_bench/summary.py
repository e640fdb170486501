"""Per-row summaries: steady-state medians, the whole run, compile cost, per-pair ratios."""

import statistics
from typing import Any, Dict, List, Optional

from bench_common.stats import pair_ratios, summarize_ratios

# The phases a step is split into; "other" is the step time the others leave.
PHASES = ("generate", "score", "advantages", "loss_step", "optimizer", "other")
TIMED_PHASES = PHASES[:-1]
# What the ratio tables compare, per pair of steps: the whole step, each timed phase, and the
# trajectory (generate + score: the RFC's steps 1-6).
RATIO_KEYS = ("step_s",) + TIMED_PHASES + ("trajectory",)


def summarize(name: str, label: str, result: Dict[str, Any], *, warmup: int, batch_size: int,
              gen_tokens: int, ppo_epochs: int) -> Dict[str, Any]:
    """Summarizes one row's result: medians over the measured steps (warm-up steps left out).

    Args:
        name (str): the row's key in ``ROWS``.
        label (str): the row's label.
        result (Dict[str, Any]): the row's steps as its worker replied them (see
            ``ppo_bench.rows``) and its "done" reply, or a ``status`` other than ``"ok"`` with
            a ``reason``.
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
        step["trajectory"] = step["generate"] + step["score"]
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
        # Mean over the measured steps of each batch's longest response (what generation decoded).
        longest_response=_mean_or_none([s.get("longest_response") for s in measured]),
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


def _mean_or_none(values: List[Optional[float]]) -> Optional[float]:
    return None if not values or None in values else statistics.mean(values)


def _max_or_none(values: List[Optional[float]]) -> Optional[float]:
    return None if not values or None in values else max(values)


def add_ratios(rows: List[Dict[str, Any]], warmup: int) -> Optional[str]:
    """Adds each row's per-pair ratios against row 1 (the first ``tt_eager`` row in any dtype,
    else the first row) and the fastest torchtune row.

    For every key of ``RATIO_KEYS``: the summary of ``reference / row`` over the measured
    rounds both ran (``bench_common.stats.summarize_ratios``: median, 95% interval, min-max),
    as ``ratios_vs_row1`` and ``ratios_vs_fastest_torchtune``; ``speedup_vs_row1`` and
    ``speedup_vs_fastest_torchtune`` are the step's median ratio. The fastest torchtune row is
    the one with the lowest median step.

    Args:
        rows (List[Dict[str, Any]]): summaries from ``summarize``, in table order.
        warmup (int): the leading rounds left out.

    Returns:
        Optional[str]: the name of the fastest torchtune row, if any ran.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    # without tt_eager (e.g. --rows ours_eager,ours_eager_shared) row 1 is the first row run
    first = next((r for r in ok if r["name"].partition("@")[0] == "tt_eager"), ok[0] if ok else None)
    torchtune_rows = [r for r in ok if r["name"].startswith("tt_")]
    fastest = min(torchtune_rows, key=lambda r: r["step_s"]) if torchtune_rows else None
    for r in ok:
        for suffix, ref in (("row1", first), ("fastest_torchtune", fastest)):
            ratios = None if ref is None else {
                k: summarize_ratios(pair_ratios(ref["steps"], r["steps"], k, warmup)) for k in RATIO_KEYS}
            r[f"ratios_vs_{suffix}"] = ratios
            r[f"speedup_vs_{suffix}"] = ratios["step_s"]["median"] if ratios and ratios["step_s"] else None
    return fastest["name"] if fastest else None
