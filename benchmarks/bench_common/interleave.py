"""The interleaved driver: one step of every row per round, the order reversed each round.

Round 0 runs A B C, round 1 C B A, round 2 A B C, ...: each round's steps meet nearly the same
machine state, and a row is as often first as last, so an order effect (a cache another row
left cold, the clock ramping up) cancels over rounds. The first ``warmup`` rounds are left out
of the ratios (they compile); with ``settle`` > 0, warm-up goes on, up to ``settle`` more
rounds, while a row still compiled graphs in the last round (a row that recompiles for a
while, torchtune's compiled recipe for one, changes speed as it does, and measuring it then
mixes two regimes). The steps of the warm-up rounds carry ``warmup: True``. After each
measured round the driver computes, for every row against the reference row, the median of
the per-pair ratios of ``key`` and its 95% interval, and stops once every interval lies within ``± target_width`` of its median (at least
``min_steps`` pairs, and a full 95% coverage), or at ``max_steps`` measured rounds, or when the
time budget is spent.

A row is any object with ``step(timeout=None) -> Dict[str, float]`` (one step's seconds, by
phase, ``key`` among them) that raises :class:`RowFailed` when it cannot go on. A failed row
leaves the schedule; the others go on.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .stats import CONFIDENCE, pair_ratios, summarize_ratios


class RowFailed(Exception):
    """A row stopped: ``status`` ("error", "timed out") and ``reason``, for the report."""

    def __init__(self, status: str, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


def round_order(names: List[str], round_index: int) -> List[str]:
    """The rows' order in a round: as given on even rounds, reversed on odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


@dataclass
class InterleavedRun:
    """What the driver did: every step of every row, and why it stopped."""

    steps: Dict[str, List[Dict[str, Any]]]
    failed: Dict[str, Dict[str, str]] = field(default_factory=dict)
    rounds: int = 0
    measured: int = 0
    stop: str = ""  # "target width", "max steps", "time budget", "too few rows"
    widths: Dict[str, float] = field(default_factory=dict)  # last check: half-width by row
    coverage: float = 0.0  # last check: the intervals' coverage (the same for every row)
    reference: Optional[str] = None
    warmup: int = 0  # warm-up rounds run, the settling ones included
    settling: List[str] = field(default_factory=list)  # rows that compiled in the last warm-up round
    samples: List[Dict[str, Any]] = field(default_factory=list)  # machine, per measured round
    measure_start: Optional[float] = None  # clock when the first measured round began
    measure_end: Optional[float] = None

    def describe_stop(self, target_width: float, max_steps: int) -> str:
        """One sentence: how many pairs, and whether the interval target or a cap ended it."""
        widest = max(self.widths.items(), key=lambda kv: kv[1]) if self.widths else None
        width = f"widest interval ±{100 * widest[1]:.1f}% ({widest[0]})" if widest else "no interval"
        if widest and self.coverage < CONFIDENCE:
            width += (f"; {self.measured} pairs give only a {100 * self.coverage:.0f}% interval, "
                      f"a 95% one needs 6")
        if self.stop == "target width":
            return (f"stopped after {self.measured} measured pairs: every interval within "
                    f"±{100 * target_width:.0f}% ({width})")
        if self.stop == "max steps":
            return (f"CAP HIT: --max-steps {max_steps} reached before every interval was within "
                    f"±{100 * target_width:.0f}% ({width})")
        if self.stop == "time budget":
            return f"CAP HIT: time budget spent after {self.measured} measured pairs ({width})"
        return f"stopped after {self.measured} measured pairs: {self.stop} ({width})"


def compiled_in_last_step(steps: List[Dict[str, Any]], key: str) -> bool:
    """Whether the row's last step compiled a graph: ``key`` (graphs compiled since the row
    began) grew over its previous step, or is above 0 after one step. Rows without ``key``
    never count as compiling."""
    if not steps or key not in steps[-1]:
        return False
    before = steps[-2][key] if len(steps) > 1 else 0
    return steps[-1][key] > before


def check_widths(steps: Dict[str, List[Dict[str, Any]]], reference: str, key: str,
                 first_round: int) -> Dict[str, Dict[str, Any]]:
    """Ratio summaries of ``key`` against ``reference``, for every other row."""
    out = {}
    for name, row_steps in steps.items():
        if name != reference:
            out[name] = summarize_ratios(pair_ratios(steps[reference], row_steps, key, first_round))
    return out


def run_interleaved(
    rows: Dict[str, Any],
    *,
    warmup: int,
    max_steps: int,
    settle: int = 0,
    settle_key: str = "graphs",
    min_steps: int = 6,
    target_width: float = 0.05,
    key: str = "step_s",
    reference: Callable[[Dict[str, List[Dict[str, Any]]]], str],
    budget_s: Optional[float] = None,
    meter: Optional[Any] = None,
    clock: Callable[[], float] = time.perf_counter,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> InterleavedRun:
    """Runs ``warmup (+ settle) + max_steps`` rounds at most, one step of each row per round.

    Args:
        rows (Dict[str, Any]): the rows in table order, each with ``step(timeout=None)``.
        warmup (int): leading rounds left out of the ratios.
        max_steps (int): measured rounds at most (the cap on pairs).
        settle (int): warm-up rounds added at most, one at a time, while a row's last step
            compiled (``compiled_in_last_step``); ``run.warmup`` is the number of warm-up
            rounds run, and ``run.settling`` the rows still compiling when warm-up ended.
        settle_key (str): the steps' count of graphs compiled since the row began.
        min_steps (int): measured rounds before the width test may stop the run.
        target_width (float): stop once every ratio's interval is within ± this of its median.
        key (str): the step's value that the ratios and the stop test use.
        reference (Callable): picks the reference row from the steps so far (alive rows only).
        budget_s (Optional[float]): seconds after which no new round starts (and the step in
            progress gets what is left as its timeout).
        meter (Optional[Any]): machine meter with ``start()`` and ``sample() -> dict``, started
            when the first measured round begins and sampled after every measured round.
        clock (Callable[[], float]): the time source (tests pass a fake one).
        log (Callable[[str], None]): progress lines.

    Returns:
        InterleavedRun: the steps, the failed rows and the reason the run stopped.
    """
    start = clock()
    run = InterleavedRun(steps={name: [] for name in rows}, warmup=warmup)
    alive = list(rows)
    run.stop = "max steps"
    r = -1
    while r + 1 < run.warmup + max_steps:
        r += 1
        left = None if budget_s is None else budget_s - (clock() - start)
        if left is not None and left <= 0:
            run.stop = "time budget"
            break
        if len(alive) < 2 and len(rows) >= 2:
            run.stop = "too few rows"
            break
        if r == run.warmup:
            run.measure_start = clock()
            if meter is not None:
                meter.start()
        for position, name in enumerate(round_order(alive, r)):
            left = None if budget_s is None else max(1.0, budget_s - (clock() - start))
            try:
                times = rows[name].step(timeout=left)
            except RowFailed as e:
                run.failed[name] = {"status": e.status, "reason": e.reason}
                alive.remove(name)
                log(f"    {name}: {e.status}: {e.reason}")
                continue
            run.steps[name].append({**times, "round": r, "position": position,
                                    "warmup": r < run.warmup})
        run.rounds = r + 1
        run.measured = max(0, run.rounds - run.warmup)
        if r < run.warmup:
            run.settling = [n for n in alive if compiled_in_last_step(run.steps[n], settle_key)]
            extend = r + 1 == run.warmup and run.settling and run.warmup < warmup + settle
            log(f"  warm-up round {r + 1}/{run.warmup}: " + ", ".join(
                f"{n} {run.steps[n][-1][key]:.3f} s" for n in alive if run.steps[n])
                + (f"; {', '.join(run.settling)} compiled: one more warm-up round" if extend else ""))
            if extend:
                run.warmup += 1
            continue
        run.measure_end = clock()
        if meter is not None:
            run.samples.append({"round": r, "t": run.measure_end - run.measure_start, **meter.sample()})
        alive_steps = {n: run.steps[n] for n in alive}
        if len(alive) < 2:
            continue
        run.reference = reference(alive_steps)
        summaries = check_widths(alive_steps, run.reference, key, run.warmup)
        run.widths = {n: s["half_width"] for n, s in summaries.items() if s}
        run.coverage = min([s["coverage"] for s in summaries.values() if s] or [0.0])
        log(f"  measured round {run.measured}: " + ", ".join(
            f"{n} {s['median']:.3f}x ±{100 * s['half_width']:.1f}%"
            for n, s in summaries.items() if s) + f" (vs {run.reference})")
        narrow = all(s and s["coverage"] >= CONFIDENCE and s["half_width"] <= target_width
                     for s in summaries.values())
        if run.measured >= min_steps and narrow:
            run.stop = "target width"
            break
    return run
