"""The gap between the rollout's numerics and the trainer's, and the corrections for it.

The generator's logprobs are PPO's old logprobs unless they are recomputed by the trainer. In
bf16 the compiled decode step (one token at a time, KV cache, bf16 logits) and the trainer's
forward over packed rows do not agree bit for bit, so the sampling distribution ``mu`` (the
rollout's) and the trainer's ``pi_old`` differ a little. :func:`mismatch_stats` measures that
gap on the sampled tokens; :func:`correction_weights` turns it into per-token weights on the
policy loss, the standard corrections (verl's ``rollout_is``, Yao et al. 2025,
https://fengyao.notion.site/off-policy-rl):

- TIS, truncated importance sampling: ``w = min(pi_old / mu, C)``;
- MIS, masked importance sampling: ``w = 1`` where ``pi_old / mu`` is within ``[1 / C, C]``,
  else 0 (the token, or the whole sequence, leaves the policy loss).

At ``level`` ``token`` the ratio is each token's; at ``sequence`` it is the sequence's
(the product of its tokens' ratios) and every token of a sequence gets its weight. The weights
multiply the advantages, which scales the clipped policy loss of each token by ``w`` (``w >= 0``
commutes with the max of the clipped and unclipped terms); the value loss is not weighted.
Pure functions on ``[b, T]`` tensors.
"""

import math
from typing import Dict, NamedTuple

import torch

CORRECTION_MODES = ("tis", "mis")
CORRECTION_LEVELS = ("token", "sequence")


class MismatchStats(NamedTuple):
    """Sums over the valid tokens of a batch, to be added over processes before
    :meth:`metrics` divides: ``[5]`` = count, sum of ``|d|``, sum of the k3 KL, sum of ``d``,
    and (apart, a max) the largest ``|d|``; ``d = log pi_train - log mu``."""

    sums: torch.Tensor  # [4]: count, sum |d|, sum k3, sum d
    max_abs: torch.Tensor  # 0-dim

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
    k3 = torch.exp(d) - d - 1.0
    sums = torch.stack([valid.sum().float(), d.abs().sum(), k3.sum(), d.sum()])
    return MismatchStats(sums, d.abs().amax() if d.numel() else d.new_zeros(()))


def correction_weights(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, valid: torch.Tensor,
                       *, mode: str, level: str = "token", threshold: float = 2.0
                       ) -> "CorrectionWeights":
    """Per-token weights of the policy loss that correct for sampling from ``mu``.

    Args:
        train_logprobs (torch.Tensor): ``log pi_old`` by the trainer ``[b, T]``.
        rollout_logprobs (torch.Tensor): ``log mu`` by the generator ``[b, T]``.
        valid (torch.Tensor): bool ``[b, T]``, True where a token is valid.
        mode (str): ``tis`` (truncate at ``threshold``) or ``mis`` (mask outside
            ``[1 / threshold, threshold]``).
        level (str): ``token``, or ``sequence`` (each row's ratio is the product of its tokens').
        threshold (float): ``C > 1``.

    Returns:
        CorrectionWeights: ``weights [b, T]`` (0 at invalid tokens) and the fraction of
        tokens (``level`` token) or sequences whose weight was truncated or masked.
    """
    if mode not in CORRECTION_MODES or level not in CORRECTION_LEVELS or not threshold > 1:
        raise ValueError(f"rollout correction: mode must be one of {list(CORRECTION_MODES)}, level one of "
                         f"{list(CORRECTION_LEVELS)} and threshold > 1; got {mode!r}, {level!r}, {threshold!r}.")
    log_ratio = (train_logprobs.float() - rollout_logprobs.float()).masked_fill(~valid, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)  # [b, 1]
        units = valid.any(-1, keepdim=True)  # a row with a valid token is one sequence
    else:
        units = valid
    log_c = math.log(threshold)
    if mode == "tis":
        hit = log_ratio > log_c
        weights = torch.exp(log_ratio.clamp(max=log_c))
    else:
        hit = (log_ratio > log_c) | (log_ratio < -log_c)
        weights = (~hit).float()
    hit = hit & units
    weights = (weights * valid).detach()  # [b, T] (a sequence's weight on each of its tokens)
    return CorrectionWeights(weights, hit.sum().float(), units.sum().float())


class CorrectionWeights(NamedTuple):
    """:func:`correction_weights`' result: ``weights [b, T]``, and how many tokens or sequences
    (``units``) were truncated or masked (``hits``), 0-dim each, to be summed over processes."""

    weights: torch.Tensor
    hits: torch.Tensor
    units: torch.Tensor
