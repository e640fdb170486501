"""Padded PPO math that only the tests use: logprobs from full ``[b, P + T, V]`` logits and the
masked-mean clipped loss, as torchtune computes them; the twins of the library's reads and
token losses."""

from typing import Tuple

import torch

from torchtune_ppo.rlhf import masked_mean, ppo_token_losses


def response_logprobs(
    logits: torch.Tensor, responses: torch.Tensor, prompt_len: int, temperature: float
) -> torch.Tensor:
    """Logprobs of ``responses [b, T]`` under full-sequence ``logits [b, P + T, V]`` -> ``[b, T]``.

    The logits at position ``i`` predict token ``i + 1``, so the response's come from
    positions ``P - 1 .. P + T - 2``.
    """
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    return torch.gather(torch.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)


def ppo_loss(pi_old_logprobs: torch.Tensor, pi_logprobs: torch.Tensor, advantages: torch.Tensor,
             phi_old_values: torch.Tensor, phi_values: torch.Tensor, returns: torch.Tensor, masks: torch.Tensor,
             epsilon: float, value_clip_range: float, value_coeff: float) -> Tuple[torch.Tensor, ...]:
    """Clipped PPO policy loss plus clipped value loss (as ``torchtune.rlhf.loss.PPOLoss``): the
    token losses of :func:`~torchtune_ppo.rlhf.loss.ppo_token_losses` (same arguments, each
    ``[b, T]``), masked means over ``masks`` (True where valid), the value loss weighted by
    ``value_coeff``.

    Returns:
        Tuple of 0-dim tensors: ``loss`` (with grad), then detached ``policy_loss``,
        ``value_loss``, mean ``ratios`` and ``clipfrac``, all averaged over valid tokens.
    """
    policy_losses, value_losses, ratios, clipped = ppo_token_losses(
        pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns,
        epsilon=epsilon, value_clip_range=value_clip_range,
    )[:4]
    clipfrac = masked_mean(clipped, masks)
    policy_loss = masked_mean(policy_losses, masks)
    value_loss = 0.5 * masked_mean(value_losses, masks)

    loss = policy_loss + value_coeff * value_loss
    return (
        loss,
        policy_loss.detach(),
        value_loss.detach(),
        masked_mean(ratios, masks).detach(),
        clipfrac.detach(),
    )

