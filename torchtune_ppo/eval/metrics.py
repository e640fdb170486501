"""The evaluation's numbers: pass@k, each process's share of the prompts, and the metrics from
sums that add up over processes.

Each process scores its own prompts and returns sums (:func:`tally`); the sums of every process
are added (an all-reduce) and only then turned into means (:func:`eval_metrics`), so several
processes log what one process over all the prompts would.
"""

import math
from fractions import Fraction
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

__all__ = ["eval_metrics", "part_names", "pass_at_k", "prompt_shard", "sum_over_processes", "tally"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt (Chen et al., 2021): ``1 - C(n - c, k) / C(n, k)``.

    The probability that ``k`` of the prompt's ``n`` responses, drawn without replacement, hold
    at least one of its ``c`` correct ones. Computed in exact rationals, so ``pass_at_k(n, c, 1)``
    is ``c / n`` to the last bit.

    Args:
        n (int): responses generated for the prompt.
        c (int): correct ones among them, ``0 <= c <= n``.
        k (int): ``1 <= k <= n``.

    Returns:
        float: in ``[0, 1]``.

    Raises:
        ValueError: on counts outside those ranges.
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int) and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def prompt_shard(num_prompts: int, rank: int, world_size: int) -> range:
    """The prompts process ``rank`` of ``world_size`` evaluates: a contiguous block, the blocks
    in rank order covering ``range(num_prompts)`` once, their sizes at most one apart."""
    return range(num_prompts * rank // world_size, num_prompts * (rank + 1) // world_size)


def tally(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_samples: int,
    correct_threshold: float,
    parts: Optional[Mapping[str, torch.Tensor]] = None,
) -> Dict[str, float]:
    """One process's sums over its prompts, each with ``num_samples`` responses in a row.

    Args:
        scores (torch.Tensor): ``[N * k]`` each response's score, the ``k = num_samples``
            responses of a prompt next to each other.
        lengths (torch.Tensor): ``[N * k]`` each response's valid tokens (stop token included).
        num_samples (int): ``k``.
        correct_threshold (float): a response is correct when its score is at least this.
        parts (Mapping[str, torch.Tensor]): ``[N * k]`` scores of each part of a combined reward.

    Returns:
        Dict[str, float]: ``prompts``, ``responses``, and the sums ``score``, ``length``,
        ``pass@1`` and ``pass@k`` (over prompts), ``part/<name>``; the same keys in the same
        order on every process.
    """
    k = num_samples
    correct = (scores.double() >= correct_threshold).view(-1, k).sum(1).tolist()  # [N]
    sums = {
        "prompts": float(len(correct)),
        "responses": float(scores.numel()),
        "score": scores.double().sum().item(),
        "length": lengths.double().sum().item(),
        "pass@1": math.fsum(pass_at_k(k, c, 1) for c in correct),
        "pass@k": math.fsum(pass_at_k(k, c, k) for c in correct),
    }
    sums.update({f"part/{name}": s.double().sum().item() for name, s in (parts or {}).items()})
    return sums


def sum_over_processes(sums: Mapping[str, float], all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                       device: Optional[torch.device] = None) -> Dict[str, float]:
    """Every process's :func:`tally` added up, through ``all_reduce_sum`` (float64, on ``device``:
    the one the process group communicates from, e.g. the GPU under NCCL)."""
    total = all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64, device=device))
    return dict(zip(sums, total.tolist()))


def eval_metrics(sums: Mapping[str, float], num_samples: int) -> Dict[str, float]:
    """The logged ``val/`` metrics from the summed tallies.

    ``val/reward_mean`` and ``val/response_length`` are means over responses, ``val/pass@1``
    (and ``val/pass@k`` for ``k > 1``) means over prompts of :func:`pass_at_k`,
    ``val/reward/<part>`` each part's mean score.
    """
    prompts, responses = sums["prompts"], sums["responses"]
    metrics = {
        "val/reward_mean": sums["score"] / responses,
        "val/pass@1": sums["pass@1"] / prompts,
    }
    if num_samples > 1:
        metrics[f"val/pass@{num_samples}"] = sums["pass@k"] / prompts
    metrics["val/response_length"] = sums["length"] / responses
    metrics.update({f"val/reward/{k[len('part/'):]}": v / responses for k, v in sums.items() if k.startswith("part/")})
    return metrics


def part_names(names: Sequence[str]) -> List[str]:
    """Metric names of a combined reward's parts: each part's name, numbered where two share one."""
    seen: Dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
    count: Dict[str, int] = {}
    out = []
    for name in names:
        count[name] = count.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{count[name]}")
    return out
