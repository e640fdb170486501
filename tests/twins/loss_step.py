"""The padded PPO loss step on ``[b, P + T]`` trajectory rows: the reference twin of
:func:`torchtune_ppo.ppo.loss_step.packed_ppo_loss_step`, which tests compare it against."""

from typing import Optional, Tuple

import torch
from torch import nn

from twins import rlhf as twin_rlhf
from torchtune_ppo import rlhf
from torchtune_ppo.rlhf.kl import kl_loss_estimate


def ppo_loss_step(
    policy_model: nn.Module,
    value_model: nn.Module,
    query_responses: torch.Tensor,
    masks: torch.Tensor,
    position_ids: torch.Tensor,
    response_padding_masks: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    *,
    prompt_len: int,
    temperature: float,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
    loss_scale: float,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy_coeff: float = 0.0,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
) -> Tuple[torch.Tensor, rlhf.PPOStats]:
    """Forward both trained models on a minibatch and return the scaled PPO loss and its stats.

    Args:
        policy_model (nn.Module): the trained policy.
        value_model (nn.Module): the trained value model, returning ``[b, S, 1]``.
        query_responses (torch.Tensor): ``[b, P + T]``.
        masks (torch.Tensor): bool attention masks ``[b, P + T, P + T]``.
        position_ids (torch.Tensor): ``[b, P + T]``.
        response_padding_masks (torch.Tensor): bool ``[b, T]``, True after the stop token.
        old_logprobs (torch.Tensor): logprobs at trajectory time ``[b, T]``.
        old_values (torch.Tensor): values at trajectory time ``[b, T]``.
        advantages (torch.Tensor): ``[b, T]``.
        returns (torch.Tensor): ``[b, T]``.
        prompt_len (int): ``P``.
        temperature (float): sampling temperature of the trajectory.
        epsilon (float): policy ratio clip range.
        value_clip_range (float): value clip range.
        value_coeff (float): weight of the value loss.
        loss_scale (float): multiplies the loss and stats, ``1 / gradient_accumulation_steps``.
        ref_logprobs (Optional[torch.Tensor]): the reference policy's ``[b, T]``; None: the KL
            stat is 0 (and ``kl_coeff`` must be 0).
        entropy_coeff (float): the loss gets ``- entropy_coeff * mean entropy``.
        kl_coeff (float): the loss gets ``+ kl_coeff * mean kl`` (``kl_estimator``).
        kl_estimator (str): see :func:`~torchtune_ppo.ppo.kl.kl_loss_estimate`.

    Returns:
        Tuple[torch.Tensor, PPOStats]: the loss to call ``backward`` on, and detached stats
        already multiplied by ``loss_scale``.
    """
    valid = ~response_padding_masks
    responses = query_responses[:, prompt_len:]
    pi_logits = policy_model(query_responses, mask=masks, input_pos=position_ids)
    pi_logprobs = twin_rlhf.response_logprobs(pi_logits, responses, prompt_len, temperature) * valid
    # [b, T] from the whole [b, T, V] distribution: the reference for the packed step's chunks
    entropy = rlhf.entropy_from_logprobs(torch.log_softmax(pi_logits[:, prompt_len - 1 : -1].float() / temperature, -1))
    kl = torch.zeros_like(pi_logprobs) if ref_logprobs is None else kl_loss_estimate(pi_logprobs, ref_logprobs, kl_estimator)
    phi_values = value_model(query_responses, mask=masks, input_pos=position_ids)
    phi_values = rlhf.response_values(phi_values, prompt_len) * valid

    loss, policy_loss, value_loss, ratios, clipfrac = twin_rlhf.ppo_loss(
        old_logprobs,
        pi_logprobs,
        advantages,
        old_values,
        phi_values,
        returns,
        valid,
        epsilon=epsilon,
        value_clip_range=value_clip_range,
        value_coeff=value_coeff,
    )
    if entropy_coeff:
        loss = loss - entropy_coeff * rlhf.masked_mean(entropy, valid)
    if kl_coeff:
        loss = loss + kl_coeff * rlhf.masked_mean(kl, valid)
    approx_policy_kls = 0.5 * rlhf.masked_mean(
        (pi_logprobs.detach() - old_logprobs).pow(2), valid
    )
    tl = rlhf.ppo_token_losses(old_logprobs, pi_logprobs.detach(), advantages, old_values, phi_values.detach(),
                               returns, epsilon=epsilon, value_clip_range=value_clip_range)
    stats = rlhf.PPOStats(
        loss.detach() * loss_scale,
        policy_loss * loss_scale,
        value_loss * loss_scale,
        ratios * loss_scale,
        clipfrac * loss_scale,
        approx_policy_kls * loss_scale,
        *(rlhf.masked_mean(x, valid) * loss_scale for x in (tl.clipped_low, tl.clipped_high, tl.dual_clipped)),
        *(rlhf.masked_mean(x.detach(), valid) * loss_scale for x in (entropy, kl)),
    )
    return loss * loss_scale, stats
