"""The gap between the rollout's numerics and the trainer's, measured on the sampled tokens.

The generator's logprobs are PPO's old logprobs. In bf16 the compiled decode step (one token at
a time, KV cache, bf16 logits) and the trainer's forward over packed rows do not agree bit for
bit, so the sampling distribution ``mu`` (the rollout's) and the trainer's ``pi_old`` differ a
little, and PPO's ratio starts away from 1. :func:`mismatch_stats` measures that gap at a step's
first minibatch, where the trainer still has the rollout's weights; the recipe logs it every
step as ``rollout_corr/*`` (verl's name for the family). With ``rollout_correction`` the trainer
recomputes ``pi_old`` for every token and :func:`correction_weights` weights the policy loss by
TIS or MIS. Pure functions on tensors.
"""

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch


class MismatchStats(NamedTuple):
    """Sums over the valid tokens of a batch, to be added over processes before
    :meth:`metrics` divides (``sums``: the count, the sums of ``|d|``, of the k3 KL and of ``d``),
    and the largest ``|d|`` (``max_abs``, a max over processes); ``d = log pi_train - log mu``."""

    sums: torch.Tensor  # [4]: count, sum |d|, sum k3, sum d
    max_abs: torch.Tensor  # 0-dim

    @staticmethod
    def keys() -> Tuple[str, ...]:
        return ("rollout_corr/abs_diff_mean", "rollout_corr/abs_diff_max", "rollout_corr/kl_k3",
                "rollout_corr/log_ratio_mean")

    def metrics(self) -> Dict[str, float]:
        """The logged ``rollout_corr/*`` metrics (NaN when no token was valid)."""
        count, abs_sum, k3_sum, d_sum = self.sums.tolist()
        n = count if count else float("nan")
        return {
            "rollout_corr/abs_diff_mean": abs_sum / n,
            "rollout_corr/abs_diff_max": float(self.max_abs) if count else float("nan"),
            "rollout_corr/kl_k3": k3_sum / n,
            "rollout_corr/log_ratio_mean": d_sum / n,
        }


def mismatch_metrics(stats: Optional[MismatchStats]) -> Dict[str, float]:
    """The logged ``rollout_corr/*`` metrics of a step: the rollout's logprobs against the
    trainer's (:meth:`MismatchStats.metrics`), NaN for a step with no update."""
    if stats is None:
        return dict.fromkeys(MismatchStats.keys(), float("nan"))
    return stats.metrics()


def mismatch_stats(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                   valid: torch.Tensor) -> MismatchStats:
    """The trainer's against the rollout's logprobs of the same sampled tokens.

    Args:
        train_logprobs (torch.Tensor): ``log pi_train`` of the sampled tokens, any shape.
        rollout_logprobs (torch.Tensor): ``log mu``, the generator's, same shape.
        valid (torch.Tensor): bool, same shape, True where a token counts.

    Returns:
        MismatchStats: with ``d = train - rollout`` over valid tokens: the mean and max of
        ``|d|``, the mean of ``d``, and the k3 estimate of ``KL(mu || pi_train)`` from samples of
        ``mu``, ``exp(d) - d - 1``.
    """
    d = (train_logprobs.float() - rollout_logprobs.float()).masked_fill(~valid, 0.0)
    # expm1, not exp(d) - 1: in float32 exp(d) rounds to 1 +- 6e-8, so for the |d| < 1e-4 of a
    # rollout and trainer that nearly agree the difference cancels and can come out negative
    # where the true value is ~d**2 / 2 >= 0.
    k3 = torch.expm1(d) - d
    sums = torch.stack([valid.sum().float(), d.abs().sum(), k3.sum(), d.sum()])
    return MismatchStats(sums, d.abs().amax() if d.numel() else d.new_zeros(()))


# Corrections for sampling from mu rather than pi_old (verl's ``rollout_is``; Yao et al. 2025,
# "Your efficient RL framework secretly brings you off-policy RL training"):
# TIS, truncated importance sampling, w = min(pi_old / mu, C); MIS, masked importance sampling,
# w = 1 where pi_old / mu is within [1 / C, C], else 0.
CORRECTION_MODES = ("tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


class CorrectionWeights(NamedTuple):
    """:func:`correction_weights`' result: ``weights [b, T]`` (0 at invalid tokens); how many
    tokens or sequences (``units``) had their weight truncated or masked (``hits``); the sum of
    the weights and the count of valid tokens, 0-dim each, to be added over processes."""

    weights: torch.Tensor
    hits: torch.Tensor
    units: torch.Tensor
    weight_sum: torch.Tensor
    tokens: torch.Tensor


def correction_weights(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, valid: torch.Tensor,
                       *, mode: str, level: str = "token", threshold: float = 2.0) -> CorrectionWeights:
    """Per-token weights of the policy loss that correct for sampling from ``mu``.

    At ``level`` ``token`` the ratio ``pi_old / mu`` is each token's; at ``sequence`` it is the
    row's (the product of its tokens' ratios) and each of its tokens gets the row's weight.
    Multiplying the advantages by ``w >= 0`` scales each token's clipped policy loss by ``w``
    (the max of the clipped and unclipped terms commutes with it); the value loss is not weighted.

    Args:
        train_logprobs (torch.Tensor): ``log pi_old``, the trainer's ``[b, T]``.
        rollout_logprobs (torch.Tensor): ``log mu``, the generator's ``[b, T]``.
        valid (torch.Tensor): bool ``[b, T]``, True where a token is valid.
        mode (str): ``tis`` or ``mis``.
        level (str): ``token`` or ``sequence``.
        threshold (float): ``C > 1``.

    Returns:
        CorrectionWeights: the weights (detached) and their counts.
    """
    if mode not in CORRECTION_MODES or level not in CORRECTION_LEVELS or not threshold > 1:
        raise ValueError(f"rollout_correction: mode must be one of {list(CORRECTION_MODES)}, level one of "
                         f"{list(CORRECTION_LEVELS)} and threshold > 1; got {mode!r}, {level!r}, {threshold!r}.")
    log_ratio = (train_logprobs.float() - rollout_logprobs.float()).masked_fill(~valid, 0.0)
    units = valid
    if level == "sequence":
        log_ratio, units = log_ratio.sum(-1, keepdim=True), valid.any(-1, keepdim=True)  # [b, 1]
    log_c = math.log(threshold)
    if mode == "tis":
        hit = log_ratio > log_c
        weights = torch.exp(log_ratio.clamp(max=log_c))
    else:
        hit = log_ratio.abs() > log_c
        weights = (~hit).float()
    weights = (weights * valid).detach()  # [b, T]: a sequence's weight on each of its tokens
    return CorrectionWeights(weights, (hit & units).sum().float(), units.sum().float(), weights.sum(),
                             valid.sum().float())
