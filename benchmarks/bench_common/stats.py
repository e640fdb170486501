"""Ratios of paired measurements and the interval of their median.

Two rows measured step by step in alternation give one ratio per pair of steps; the pair met
the same machine state, so a load that slows both cancels in the ratio. The reported ratio is
the median of those per-pair ratios, with a distribution-free 95% interval from order
statistics (no assumption on how the noise is distributed, and deterministic: the same pairs
give the same interval).
"""

import math
import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

CONFIDENCE = 0.95


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Tuple[float, float, float]:
    """The order-statistics interval of the median: ``[x_(j), x_(n+1-j)]`` of the sorted values.

    ``j`` is the largest index whose interval covers the true median with probability at least
    ``confidence`` (for any continuous distribution: ``1 - 2 P(Binomial(n, 1/2) < j)``). Below
    6 values even min-max covers less than 95%; then min-max is returned with its coverage.

    Args:
        values (Sequence[float]): the sample, at least one value.
        confidence (float): the coverage wanted, in (0, 1).

    Returns:
        Tuple[float, float, float]: ``(low, high, coverage)``.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval: no values")

    def coverage(j: int) -> float:
        below = sum(math.comb(n, i) for i in range(j)) / 2**n  # P(Binomial(n, 1/2) <= j - 1)
        return 1.0 - 2.0 * below

    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(j + 1) >= confidence:
        j += 1
    return xs[j - 1], xs[n - j], coverage(j)


def summarize_ratios(ratios: Sequence[float], confidence: float = CONFIDENCE) -> Optional[Dict[str, Any]]:
    """Median, interval, spread and half-width of per-pair ratios; None without any.

    ``half_width`` is the interval's larger distance from the median, relative to it: 0.05
    means the interval lies within ±5% of the median.
    """
    ratios = [r for r in ratios if r is not None and math.isfinite(r)]
    if not ratios:
        return None
    med = statistics.median(ratios)
    lo, hi, cov = median_interval(ratios, confidence)
    half = max(hi / med - 1.0, 1.0 - lo / med) if med > 0 else float("inf")
    return {"median": med, "low": lo, "high": hi, "min": min(ratios), "max": max(ratios),
            "n": len(ratios), "coverage": cov, "half_width": half}


def pair_ratios(reference: Iterable[Dict[str, Any]], candidate: Iterable[Dict[str, Any]],
                key: str, first_round: int = 0) -> List[float]:
    """``reference[key] / candidate[key]`` for every round both rows ran, from ``first_round`` on.

    Steps are matched by their ``round`` (the pairs of an interleaved run); a round where
    either value is missing or not positive (a phase a row does not have) gives no ratio.
    Above 1: the candidate took less time than the reference.
    """
    ref = {s["round"]: s.get(key) for s in reference if s["round"] >= first_round}
    out = []
    for s in candidate:
        a, b = ref.get(s["round"]), s.get(key)
        if s["round"] >= first_round and a is not None and b is not None and a > 0 and b > 0:
            out.append(a / b)
    return out


def format_ratio(summary: Optional[Dict[str, Any]], spread: bool = False) -> str:
    """``1.34x [1.30-1.38]`` (median and 95% interval), with ``(min-max)`` when ``spread``."""
    if not summary:
        return "-"
    text = f"{summary['median']:.2f}x [{summary['low']:.2f}-{summary['high']:.2f}]"
    if spread:
        text += f" ({summary['min']:.2f}-{summary['max']:.2f})"
    return text
