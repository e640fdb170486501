"""The PPO loss step: policy and value forward on a packed micro-step, then the clipped losses.

:func:`packed_ppo_loss_step` runs on packed micro-steps (real tokens only, see
:mod:`torchtune_ppo.rlhf.packing`) and projects to the vocabulary only where it reads a logprob.
Its padded twin on ``[b, P + T]`` trajectory rows, the reference it is tested against, is a
test asset (``tests/twins/loss_step.py``). It is compiled as one region when
``compile.loss_step`` is on; the caller runs ``loss.backward()`` on its output, which
AOTAutograd compiles as well. It is always called with grad enabled, in train mode.
"""

from typing import Optional, Tuple

import torch
from torch import nn

from torchtune_ppo import rlhf
from torchtune_ppo._patches.torchtune_modules import SegmentLayout, final_hidden_states
from torchtune_ppo.rlhf import block_causal_masks, kl_loss_estimate


def packed_ppo_loss_step(
    policy_model: nn.Module,
    value_model: Optional[nn.Module],
    tokens: torch.Tensor,
    segment_ids: torch.Tensor,
    position_ids: torch.Tensor,
    read_positions: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    micro_batch_ids: torch.Tensor,
    stat_weights: torch.Tensor,
    ref_logprobs: torch.Tensor,
    prefix_ids: Optional[torch.Tensor] = None,
    attention: Optional[SegmentLayout] = None,
    *,
    temperature: float,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
    num_micro_batches: int,
    epsilon_low: Optional[float] = None,
    epsilon_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    entropy_coeff: float = 0.0,
    kl_coeff: float = 0.0,
    kl_estimator: str = "k3",
) -> Tuple[torch.Tensor, rlhf.PPOStats, torch.Tensor]:
    """Forward both trained models on one packed micro-step; return its weighted PPO loss and stats.

    The tensor arguments are the fields of :class:`~torchtune_ppo.rlhf.packing.PackedMicroStep`:
    ``R`` rows of ``L`` packed tokens and ``C`` chunks of ``K`` reads; ``R`` and ``K`` vary from
    call to call (compiled: one graph, dynamic in both). The output projections run only on the
    read positions, the policy's one chunk at a time (no ``[R, L, V]`` logits; the largest
    float32 tensor is ``[K, V]``).

    Args:
        policy_model (nn.Module): the trained policy.
        value_model (Optional[nn.Module]): the trained value model (a ``[D, 1]`` output layer);
            None for a critic-free run: no value forward, and the value loss is 0.
        tokens (torch.Tensor): ``[R, L]``.
        segment_ids (torch.Tensor): ``[R, L]``, one id per packed sequence.
        position_ids (torch.Tensor): ``[R, L]``.
        read_positions (torch.Tensor): flat slot indices into ``R * L`` ``[C, K]``.
        old_logprobs (torch.Tensor): logprobs at trajectory time ``[C, K]``.
        old_values (torch.Tensor): values at trajectory time ``[C, K]``.
        advantages (torch.Tensor): ``[C, K]``.
        returns (torch.Tensor): ``[C, K]``.
        targets (torch.Tensor): the response tokens read ``[C, K]``.
        weights (torch.Tensor): each token loss's weight in the minibatch loss ``[C, K]``, 0 at
            unused reads (``1 / (grad_accum * valid tokens of the micro-batch)`` for token-mean).
        micro_batch_ids (torch.Tensor): ``[C, K]`` in ``[0, num_micro_batches)``.
        stat_weights (torch.Tensor): the token-mean weights ``[C, K]`` of the diagnostic stats
            (ratios, clip fractions, approximate KL, entropy, KL to the reference);
            ``weights`` weight the loss terms.
        ref_logprobs (torch.Tensor): the reference policy's logprobs ``[C, K]``.
        prefix_ids (Optional[torch.Tensor]): ``[R, L]``, the segment (a group's prompt copy) each
            slot may also attend; None: rows without shared prompts. With shared prompts the
            prompt's activations are computed once and their gradient is the sum over the reads
            of the group's responses, as their own sequences would give it.
        attention (Optional[SegmentLayout]): the rows' attention by sequence, for models prepared
            with :func:`~torchtune_ppo._patches.torchtune_modules.use_segment_attention`: the same
            outputs as the block-causal masks of ``segment_ids`` and ``prefix_ids``, for fewer
            scores; None: those masks.
        temperature (float): sampling temperature of the trajectory.
        epsilon (float): policy ratio clip range.
        value_clip_range (float): value clip range.
        value_coeff (float): weight of the value loss.
        num_micro_batches (int): ``grad_accum``, the micro-batches the stats are summed into.
        epsilon_low (Optional[float]): lower ratio clip range; None: ``epsilon``.
        epsilon_high (Optional[float]): upper ratio clip range; None: ``epsilon``.
        dual_clip (Optional[float]): dual-clip constant for negative advantages; None: off.
        entropy_coeff (float): the token loss gets ``- entropy_coeff * entropy`` (the policy's
            entropy over the vocabulary at the read); 0: the entropy is only a stat.
        kl_coeff (float): the token loss gets ``+ kl_coeff * kl`` (``kl`` from
            :func:`~torchtune_ppo.rlhf.kl.kl_loss_estimate` with ``kl_estimator``); 0: a stat only.
        kl_estimator (str): ``k1``, ``k2``, ``k3``, ``k1+`` or ``k3+``.

    Returns:
        Tuple[torch.Tensor, PPOStats, torch.Tensor]: the loss to call ``backward`` on; detached
        stats, each ``[num_micro_batches]``: this micro-step's share of every micro-batch's scaled
        stat; and the policy's detached logprobs of the reads ``[C, K]`` (the trainer's side of
        the rollout/training mismatch).
    """
    masks = block_causal_masks(segment_ids, prefix_ids) if attention is None else attention  # [R, L, L]
    # Both trunks before any read: with compile.layers each trunk is a graph break, across
    # which only the inputs and the trunks' own tensors keep their dynamic sizes.
    h = final_hidden_states(policy_model, tokens, mask=masks, input_pos=position_ids)
    h_value = (None if value_model is None else
               final_hidden_states(value_model, tokens, mask=masks, input_pos=position_ids))
    pi_logprobs, entropy = rlhf.read_logprobs_and_entropy(
        policy_model.output, h.flatten(0, 1), read_positions, targets, temperature,
        entropy_grad=entropy_coeff != 0)  # [C, K]
    if value_model is not None:
        phi_values = rlhf.read_values(value_model.output, h_value.flatten(0, 1), read_positions)  # [C, K]
    else:  # critic-free: no value forward, no value loss
        phi_values = old_values

    tl = rlhf.ppo_token_losses(
        old_logprobs, pi_logprobs, advantages, old_values, phi_values, returns,
        epsilon=epsilon, value_clip_range=value_clip_range,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip=dual_clip,
    )
    policy_losses, value_losses, ratios, clipped = tl[:4]
    if value_model is None:
        value_losses = torch.zeros_like(policy_losses)
    token_losses = policy_losses + value_coeff * 0.5 * value_losses
    kl = kl_loss_estimate(pi_logprobs if kl_coeff else pi_logprobs.detach(), ref_logprobs, kl_estimator)
    if entropy_coeff:  # Python floats: the graph is specialised on which terms are on
        token_losses = token_losses - entropy_coeff * entropy
    if kl_coeff:
        token_losses = token_losses + kl_coeff * kl
    loss = (token_losses * weights).sum()

    approx_kls = 0.5 * (pi_logprobs.detach() - old_logprobs).pow(2)
    per_token = torch.cat([
        torch.stack([token_losses, policy_losses, 0.5 * value_losses]).detach() * weights,
        torch.stack([ratios, clipped, approx_kls, tl.clipped_low, tl.clipped_high, tl.dual_clipped,
                     entropy, kl]).detach() * stat_weights,
    ])  # [11, C, K], the PPOStats fields
    # A one-hot matmul rather than index_add: inductor 2.13 fails to generate code for an
    # atomic scatter into a size-1 dimension (grad_accum = 1).
    onehot = torch.nn.functional.one_hot(micro_batch_ids.flatten(), num_micro_batches).to(per_token.dtype)
    per_micro_batch = per_token.flatten(1) @ onehot  # [11, C * K] @ [C * K, G] -> [11, G]
    return loss, rlhf.PPOStats(*per_micro_batch), pi_logprobs.detach()
