"""Advantages of a scored batch: KL-penalised per-token rewards, then GAE and whitening."""

from typing import Dict, NamedTuple, Optional

import torch

from torchtune_ppo import distributed
from torchtune_ppo.ppo import rlhf
from torchtune_ppo.rollout.trajectory import Trajectory


class Advantages(NamedTuple):
    """``[b, T]`` each: GAE ``advantages`` (whitened) and ``returns``, the per-token ``kl`` to the
    reference policy and ``kl_rewards``, its penalty part of the rewards; ``lmbda_actor`` ``[b]``,
    the lambda of each row's advantages, and the critic's ``explained_variance`` (0-dim, global)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    kl: torch.Tensor
    kl_rewards: torch.Tensor
    lmbda_actor: Optional[torch.Tensor] = None
    explained_variance: Optional[torch.Tensor] = None


@torch.no_grad()
def estimate_advantages(
    trajectory: Trajectory, *, kl_coeff: float, gamma: float, lmbda: float, whiten_rewards: bool,
    kl_estimator: str = "k1",
    lmbda_actor: Optional[float] = None,
    lmbda_length_alpha: Optional[float] = None,
) -> Advantages:
    """Rewards ``score - kl_coeff * kl`` per token (:func:`~torchtune_ppo.ppo.rlhf.get_rewards_ppo`),
    optionally whitened, then GAE (:func:`~torchtune_ppo.ppo.rlhf.estimate_advantages`).

    Whitening is over every rank's valid tokens, so the result is the one-process one.

    Args:
        trajectory (Trajectory): the scored batch ``[b, ...]``.
        kl_coeff (float): weight of the KL penalty.
        gamma (float): discount.
        lmbda (float): GAE lambda of the returns, and of the advantages unless one of the next two is set.
        whiten_rewards (bool): whiten the per-token rewards before GAE.
        kl_estimator (str): ``k1``, ``k2`` or ``k3`` (:func:`~torchtune_ppo.ppo.kl.kl_estimate`).
        lmbda_actor (Optional[float]): the advantages' own lambda (decoupled GAE); None: ``lmbda``.
        lmbda_length_alpha (Optional[float]): the advantages' lambda per row,
            :func:`~torchtune_ppo.ppo.rlhf.length_adaptive_lmbda`; None: off.

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
    if lmbda_length_alpha is not None:
        lmbda_actor = rlhf.length_adaptive_lmbda(trajectory.seq_lens, lmbda_length_alpha)
    advantages, returns = rlhf.estimate_advantages(trajectory.values, rewards, gamma, lmbda, valid, reduce=reduce,
                                                   lmbda_actor=lmbda_actor)
    row_lmbda = torch.zeros_like(trajectory.scores, dtype=torch.float32) + (lmbda if lmbda_actor is None else lmbda_actor)
    explained = rlhf.explained_variance(returns, trajectory.values, valid, reduce=reduce)
    return Advantages(advantages, returns, kl, kl_rewards, row_lmbda, explained)


def advantage_metrics(adv: Advantages) -> Dict[str, float]:
    """The logged critic and GAE metrics of a step (one host sync): ``explained_variance`` of the
    returns by the rollout's values, and ``lmbda_actor``, the mean lambda of the advantages,
    both over the global batch; NaN where an estimator sets neither (no critic, no GAE)."""
    nan = torch.tensor(float("nan"), device=adv.advantages.device)
    lmbda = nan if adv.lmbda_actor is None else adv.lmbda_actor.float().mean()
    if distributed.world_size() > 1:  # every rank has as many rows
        lmbda = distributed.all_reduce_sum(lmbda) / distributed.world_size()
    explained = nan if adv.explained_variance is None else adv.explained_variance.float()
    explained, lmbda = torch.stack([explained, lmbda]).tolist()
    return {"explained_variance": explained, "lmbda_actor": lmbda}
