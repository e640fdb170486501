"""Advantages of a scored batch: KL-penalised per-token rewards, then an advantage estimator.

``gae`` (the default) uses the value model: GAE, then whitening. The others are critic-free,
so a run with one of them has no value model at all:

- ``grpo`` (https://arxiv.org/abs/2402.03300): each response's reward minus its group's mean,
  over the group's (unbiased) std.
- ``dr_grpo`` (Dr. GRPO, https://arxiv.org/abs/2503.20783): the same without the std.
- ``rloo`` (https://arxiv.org/abs/2402.14740): minus the mean of the *other* responses of the
  group, ``n / (n - 1) * (r - mean)``.
- ``reinforce_plus_plus`` (https://arxiv.org/abs/2501.03262): per-token discounted return-to-go
  of the KL-penalised rewards, whitened over the global batch's valid tokens.
- ``reinforce_plus_plus_baseline``: the group's mean subtracted from each response's reward,
  then whitened over the global batch's valid tokens.

A response's reward here is the sum of its per-token rewards, ``score - kl_coeff * sum(kl)``
(verl's with ``use_kl_in_reward``); ``kl_coeff: 0`` leaves the score alone.

Groups: a batch of ``b = g * n`` rows holds ``g`` groups of ``n`` responses to one prompt, each
group's rows contiguous (:func:`repeat_prompts`). Each rank repeats its own prompts, so a group
never spans ranks and its statistics need no communication; whitening is over every rank's
valid tokens, so the result is the one-process one.
"""

from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_ppo import distributed
from torchtune_ppo.ppo import rlhf

if TYPE_CHECKING:  # the config schema imports this module, and the rollout package imports the config
    from torchtune_ppo.rollout.trajectory import Trajectory

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# Estimators whose baseline is the group of responses to one prompt: they need n >= 2.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
# Added to the group std before dividing (verl's and the GRPO paper's epsilon).
GROUP_STD_EPS = 1e-6


def uses_value_model(advantage_estimator: str) -> bool:
    """Whether the estimator reads values: only ``gae``. The others build no value model."""
    return advantage_estimator == "gae"


class Advantages(NamedTuple):
    """``[b, T]`` each: the ``advantages`` and ``returns`` (the value model's targets; for a
    critic-free estimator unused by the loss), the per-token ``kl`` to the reference policy and
    ``kl_rewards``, its penalty part of the rewards; ``lmbda_actor`` ``[b]``, the lambda of each
    row's GAE advantages, and the critic's ``explained_variance`` (0-dim, global): both None for a
    critic-free estimator."""

    advantages: torch.Tensor
    returns: torch.Tensor
    kl: torch.Tensor
    kl_rewards: torch.Tensor
    lmbda_actor: Optional[torch.Tensor] = None
    explained_variance: Optional[torch.Tensor] = None


def repeat_prompts(
    prompts: torch.Tensor, prompt_lens: torch.Tensor, references: Optional[Sequence[Optional[str]]], n: int,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[List[Optional[str]]]]:
    """Each prompt ``n`` times in a row: ``[b, P]`` -> ``[b * n, P]``, so a group is contiguous.

    ``prompt_lens [b]`` and ``references`` (one per prompt, or None) are repeated alike; with
    ``n == 1`` the inputs come back as they are.
    """
    if n == 1:
        return prompts, prompt_lens, None if references is None else list(references)
    refs = None if references is None else [r for r in references for _ in range(n)]
    return prompts.repeat_interleave(n, dim=0), prompt_lens.repeat_interleave(n, dim=0), refs


def group_baseline(rewards: torch.Tensor, n: int, estimator: str) -> torch.Tensor:
    """Outcome advantages of ``rewards [g * n]`` against their group of ``n`` (contiguous).

    - ``grpo``: ``(r - mean) / (std + 1e-6)``, std unbiased; 0 for a group whose std is at most
      1e-6 (``GROUP_STD_EPS``): equal responses scored by a model may differ by a rounding error
      (packed differently), which the division would blow up to advantages of ~0.1.
    - ``dr_grpo`` and ``reinforce_plus_plus_baseline``: ``r - mean``.
    - ``rloo``: ``r - mean(others) = n / (n - 1) * (r - mean)``.

    Returns:
        torch.Tensor: ``[g * n]``.
    """
    if n < 2:
        raise ValueError(f"{estimator} compares the responses of a group: it needs num_samples_per_prompt "
                         f">= 2, got {n}.")
    groups = rewards.view(-1, n)  # [g, n]
    centred = groups - groups.mean(-1, keepdim=True)
    if estimator == "grpo":
        std = groups.std(-1, keepdim=True)
        out = torch.where(std > GROUP_STD_EPS, centred / (std + GROUP_STD_EPS), torch.zeros_like(centred))
    elif estimator in ("dr_grpo", "reinforce_plus_plus_baseline"):
        out = centred
    elif estimator == "rloo":
        out = centred * (n / (n - 1))
    else:
        raise ValueError(f"advantage_estimator {estimator!r} has no group baseline; "
                         f"those with one are {list(GROUP_ESTIMATORS)}.")
    return out.flatten()


def discounted_returns(rewards: torch.Tensor, masks: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` of each row, 0 past its last valid token.

    Args:
        rewards (torch.Tensor): per-token rewards ``[b, T]``.
        masks (torch.Tensor): bool ``[b, T]``, True where valid (a prefix of each row).
        gamma (float): discount.

    Returns:
        torch.Tensor: ``[b, T]``.
    """
    rewards = rewards * masks
    running = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out.append(running)
    return torch.stack(out[::-1], dim=1) * masks


@torch.no_grad()
def estimate_advantages(
    trajectory: "Trajectory", *, kl_coeff: float, gamma: float, lmbda: float, whiten_rewards: bool,
    kl_estimator: str = "k1", advantage_estimator: str = "gae", num_samples_per_prompt: int = 1,
    lmbda_actor: Optional[float] = None,
    lmbda_length_alpha: Optional[float] = None,
) -> Advantages:
    """Rewards ``score - kl_coeff * kl`` per token (:func:`~torchtune_ppo.ppo.rlhf.get_rewards_ppo`),
    then the advantages of ``advantage_estimator`` (see the module's docstring).

    For ``gae``: the rewards optionally whitened, then GAE
    (:func:`~torchtune_ppo.ppo.rlhf.estimate_advantages`), whitened. Every whitening is over
    every rank's valid tokens, so the result is the one-process one.

    Args:
        trajectory (Trajectory): the scored batch ``[b, ...]``, ``b = g * n`` rows in groups of
            ``n = num_samples_per_prompt`` contiguous rows.
        kl_coeff (float): weight of the KL penalty.
        gamma (float): discount (``gae``, ``reinforce_plus_plus``).
        lmbda (float): GAE lambda of the returns, and of the advantages unless one of the last two
            is set (``gae`` only).
        whiten_rewards (bool): whiten the per-token rewards before GAE (``gae`` only).
        kl_estimator (str): ``k1``, ``k2`` or ``k3`` (:func:`~torchtune_ppo.ppo.kl.kl_estimate`).
        advantage_estimator (str): one of :data:`ADVANTAGE_ESTIMATORS`.
        num_samples_per_prompt (int): ``n``, responses per prompt.
        lmbda_actor (Optional[float]): the advantages' own lambda (decoupled GAE); None: ``lmbda``
            (``gae`` only).
        lmbda_length_alpha (Optional[float]): the advantages' lambda per row,
            :func:`~torchtune_ppo.ppo.rlhf.length_adaptive_lmbda`; None: off (``gae`` only).

    Returns:
        Advantages: ``[b, T]`` tensors, 0 past each row's last valid token.
    """
    valid = ~trajectory.response_padding_masks
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
        trajectory.scores, trajectory.logprobs, trajectory.ref_logprobs, kl_coeff, trajectory.seq_lens, valid,
        kl_estimator=kl_estimator,
    )
    reduce = distributed.all_reduce_sum if distributed.world_size() > 1 else None
    if advantage_estimator != "gae" and (lmbda_actor is not None or lmbda_length_alpha is not None):
        raise ValueError(f"lmbda_actor and lmbda_length_alpha are GAE's; advantage_estimator "
                         f"{advantage_estimator!r} takes neither, got {lmbda_actor!r} and {lmbda_length_alpha!r}.")
    if advantage_estimator == "gae":
        if whiten_rewards:
            rewards = rlhf.whiten(rewards, valid, reduce=reduce)
        if lmbda_length_alpha is not None:
            lmbda_actor = rlhf.length_adaptive_lmbda(trajectory.seq_lens, lmbda_length_alpha)
        advantages, returns = rlhf.estimate_advantages(trajectory.values, rewards, gamma, lmbda, valid, reduce=reduce,
                                                       lmbda_actor=lmbda_actor)
        row_lmbda = torch.zeros_like(trajectory.scores, dtype=torch.float32) + (lmbda if lmbda_actor is None else lmbda_actor)
        explained = rlhf.explained_variance(returns, trajectory.values, valid, reduce=reduce)
        return Advantages(advantages, returns, kl, kl_rewards, row_lmbda, explained)
    if advantage_estimator == "reinforce_plus_plus":
        returns = discounted_returns(rewards, valid, gamma)
        advantages = rlhf.whiten(returns, valid, reduce=reduce)
    elif advantage_estimator in GROUP_ESTIMATORS:
        per_row = group_baseline(rewards.sum(-1), num_samples_per_prompt, advantage_estimator)  # [b]
        advantages = per_row[:, None] * valid
        if advantage_estimator == "reinforce_plus_plus_baseline":
            advantages = rlhf.whiten(advantages, valid, reduce=reduce)
        returns = advantages
    else:
        raise ValueError(f"advantage_estimator must be one of {list(ADVANTAGE_ESTIMATORS)}, "
                         f"got {advantage_estimator!r}.")
    return Advantages(advantages, returns, kl, kl_rewards)


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


def group_metrics(scores: torch.Tensor, n: int) -> Dict[str, float]:
    """What group sampling gives the estimators, over the global batch: ``group_score_std``, the
    mean over groups of the (unbiased) std of their ``n`` scores, and ``zero_std_groups``, the
    fraction of groups whose scores are all equal, std at most 1e-6 (no learning signal for a
    group baseline; equal responses may score a rounding error apart where they were packed
    differently).

    Args:
        scores (torch.Tensor): ``[g * n]`` this rank's scores after penalties, groups contiguous.
        n (int): responses per prompt (>= 2).

    Returns:
        Dict[str, float]: the two metrics (non-finite scores count as a group with std NaN).
    """
    groups = scores.float().view(-1, n)
    std = groups.std(-1)
    zero = std <= GROUP_STD_EPS
    sums = torch.stack([std.sum(), zero.sum().float(), torch.tensor(float(len(std)), device=std.device)])
    total = distributed.all_reduce_sum(sums).tolist()
    return {"group_score_std": total[0] / total[2], "zero_std_groups": total[1] / total[2]}
