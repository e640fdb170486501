"""Advantages of a scored batch: KL-penalised per-token rewards, then GAE and whitening."""

from typing import NamedTuple

import torch

from torchtune_ppo import distributed
from torchtune_ppo.ppo import rlhf
from torchtune_ppo.rollout.trajectory import Trajectory


class Advantages(NamedTuple):
    """``[b, T]`` each: GAE ``advantages`` (whitened) and ``returns``, the per-token ``kl`` to the
    reference policy and ``kl_rewards``, its penalty part of the rewards."""

    advantages: torch.Tensor
    returns: torch.Tensor
    kl: torch.Tensor
    kl_rewards: torch.Tensor


@torch.no_grad()
def estimate_advantages(
    trajectory: Trajectory, *, kl_coeff: float, gamma: float, lmbda: float, whiten_rewards: bool,
    kl_estimator: str = "k1",
) -> Advantages:
    """Rewards ``score - kl_coeff * kl`` per token (:func:`~torchtune_ppo.ppo.rlhf.get_rewards_ppo`),
    optionally whitened, then GAE (:func:`~torchtune_ppo.ppo.rlhf.estimate_advantages`).

    Whitening is over every rank's valid tokens, so the result is the one-process one.

    Args:
        trajectory (Trajectory): the scored batch ``[b, ...]``.
        kl_coeff (float): weight of the KL penalty.
        gamma (float): discount.
        lmbda (float): GAE lambda.
        whiten_rewards (bool): whiten the per-token rewards before GAE.
        kl_estimator (str): ``k1``, ``k2`` or ``k3`` (:func:`~torchtune_ppo.ppo.kl.kl_estimate`).

    Returns:
        Advantages: ``[b, T]`` tensors, 0 past each row's last valid token.
    """
    valid = ~trajectory.response_padding_masks
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
        trajectory.scores, trajectory.logprobs, trajectory.ref_logprobs, kl_coeff, trajectory.seq_lens, valid,
        kl_estimator=kl_estimator,
    )
    reduce = distributed.all_reduce_sum if distributed.world_size() > 1 else None
    if whiten_rewards:
        rewards = rlhf.whiten(rewards, valid, reduce=reduce)
    advantages, returns = rlhf.estimate_advantages(trajectory.values, rewards, gamma, lmbda, valid, reduce=reduce)
    return Advantages(advantages, returns, kl, kl_rewards)
