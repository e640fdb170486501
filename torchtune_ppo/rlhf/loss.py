"""The PPO loss per token: clipped policy and value losses, their statistics, and how token
losses are weighted into a minibatch's loss.

Pure functions on tensors of one shape (``[b, T]`` rows or the ``[C, K]`` packed reads), with
static shapes and no graph breaks.
"""

from typing import NamedTuple, Optional

import torch

# How token losses make the minibatch loss (verl's ``loss_agg_mode`` names); the weights are
# :func:`loss_weight`'s.
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class PPOStats(NamedTuple):
    """Statistics of one PPO loss step, each a 0-dim tensor (torchtune's ``PPOStats`` fields)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    ratios: torch.Tensor
    clipfrac: torch.Tensor
    approx_policy_kls: torch.Tensor
    # Which side clipped (ratio below 1 - epsilon_low with A < 0, above 1 + epsilon_high with
    # A > 0) and where dual-clip bounded the loss; they add up to more than ``clipfrac`` only
    # through ``dualclip_frac``.
    clipfrac_low: torch.Tensor
    clipfrac_high: torch.Tensor
    dualclip_frac: torch.Tensor
    # Token means over the micro-batch, like ``ratios``: the policy's entropy over the full
    # vocabulary at the response positions, and the loss's per-token KL estimate to the
    # reference policy (``loss.kl_estimator``), both computed whatever their loss weights.
    entropy: torch.Tensor
    kl_loss: torch.Tensor


class TokenLosses(NamedTuple):
    """Per-token PPO losses and clip indicators, each with the shape of the inputs.

    Attributes:
        policy_losses (torch.Tensor): clipped (and dual-clipped) policy losses.
        value_losses (torch.Tensor): clipped value losses, without the 0.5.
        ratios (torch.Tensor): ``exp(pi_logprobs - pi_old_logprobs)``.
        clipped (torch.Tensor): 1.0 where the clipped policy loss is the larger.
        clipped_low (torch.Tensor): 1.0 where it is, with the ratio below ``1 - epsilon_low``.
        clipped_high (torch.Tensor): 1.0 where it is, with the ratio above ``1 + epsilon_high``.
        dual_clipped (torch.Tensor): 1.0 where ``-dual_clip * A`` bounded the loss (A < 0).
    """

    policy_losses: torch.Tensor
    value_losses: torch.Tensor
    ratios: torch.Tensor
    clipped: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor


def ppo_token_losses(
    pi_old_logprobs: torch.Tensor,
    pi_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    phi_old_values: torch.Tensor,
    phi_values: torch.Tensor,
    returns: torch.Tensor,
    epsilon: float,
    value_clip_range: float,
    epsilon_low: Optional[float] = None,
    epsilon_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
) -> TokenLosses:
    """Per-token clipped PPO policy and value losses, before any averaging.

    The policy loss is ``max(-A r, -A clip(r, 1 - epsilon_low, 1 + epsilon_high))`` (clip-higher,
    DAPO https://arxiv.org/abs/2503.14476, when the two differ); with ``dual_clip`` ``c`` it is
    further bounded by ``-c A`` where ``A < 0`` (dual-clip PPO, https://arxiv.org/abs/1912.09729),
    so a very large ratio on a bad action cannot make the loss unbounded.

    Every argument has one shape, ``[b, response_len]`` or the ``[N]`` of packed reads.

    Args:
        pi_old_logprobs (torch.Tensor): logprobs at trajectory time.
        pi_logprobs (torch.Tensor): logprobs of the current policy.
        advantages (torch.Tensor): advantages.
        phi_old_values (torch.Tensor): values at trajectory time.
        phi_values (torch.Tensor): values of the current value model.
        returns (torch.Tensor): returns.
        epsilon (float): policy ratio clip range, both sides unless overridden.
        value_clip_range (float): value clip range around the old values.
        epsilon_low (Optional[float]): lower clip range; None: ``epsilon``.
        epsilon_high (Optional[float]): upper clip range; None: ``epsilon``.
        dual_clip (Optional[float]): the dual-clip constant ``c > 1``; None: off.

    Returns:
        TokenLosses: each with the shape of the inputs.
    """
    low = epsilon if epsilon_low is None else epsilon_low
    high = epsilon if epsilon_high is None else epsilon_high
    ratios = torch.exp(pi_logprobs - pi_old_logprobs)
    clipped_ratios = torch.clamp(ratios, 1.0 - low, 1.0 + high)
    policy_losses_clipped = -advantages * clipped_ratios
    policy_losses_unclipped = -advantages * ratios
    is_clipped = policy_losses_clipped > policy_losses_unclipped
    policy_losses = torch.maximum(policy_losses_clipped, policy_losses_unclipped)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        is_dual = (advantages < 0) & (policy_losses > bound)
        policy_losses = torch.where(is_dual, bound, policy_losses)
    else:
        is_dual = torch.zeros_like(is_clipped)

    values_clipped = torch.clamp(
        phi_values, phi_old_values - value_clip_range, phi_old_values + value_clip_range
    )
    value_losses = torch.maximum((phi_values - returns) ** 2, (values_clipped - returns) ** 2)
    dtype = ratios.dtype
    return TokenLosses(
        policy_losses, value_losses, ratios, is_clipped.to(dtype),
        (is_clipped & (ratios < 1.0)).to(dtype), (is_clipped & (ratios > 1.0)).to(dtype), is_dual.to(dtype),
    )


def loss_weight(
    aggregation: str, *, grad_accum: int, micro_batch_tokens: int, num_sequences: int,
    sequence_tokens: int, response_len: int,
) -> float:
    """The weight of each valid token loss of one sequence in its minibatch's loss.

    - ``token-mean``: ``1 / (grad_accum * micro_batch_tokens)``, the mean over each micro-batch's
      valid tokens, averaged over its ``grad_accum`` micro-batches (torchtune's PPO).
    - ``seq-mean-token-mean``: ``1 / (num_sequences * sequence_tokens)``, each sequence's token
      mean, averaged over the minibatch's sequences.
    - ``seq-mean-token-sum``: ``1 / num_sequences``, each sequence's token sum, averaged.
    - ``seq-mean-token-sum-norm``: ``1 / (num_sequences * response_len)``, each sequence's token
      sum over the constant ``T`` (Dr. GRPO, https://arxiv.org/abs/2503.20783), averaged.

    ``num_sequences`` counts the sequences with a valid token in the global minibatch, so the
    ``seq-mean`` weights are the same however it is split into micro-batches and ranks.
    """
    if aggregation == "token-mean":
        return 1.0 / (grad_accum * max(micro_batch_tokens, 1))
    n = max(num_sequences, 1)
    if aggregation == "seq-mean-token-mean":
        return 1.0 / (n * max(sequence_tokens, 1))
    if aggregation == "seq-mean-token-sum":
        return 1.0 / n
    if aggregation == "seq-mean-token-sum-norm":
        return 1.0 / (n * response_len)
    raise ValueError(f"loss.aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}")

