"""Advantages of a scored batch: KL-penalised per-token rewards, then the advantage estimator
the config names (:data:`~torchtune_ppo.rlhf.rewards.ADVANTAGE_ESTIMATORS`; the estimators
themselves are :mod:`torchtune_ppo.rlhf.rewards`'s).

A response's reward is the sum of its per-token rewards, ``score - kl_coeff * sum(kl)``
(verl's with ``use_kl_in_reward``); ``kl_coeff: 0`` leaves the score alone.

Each rank repeats its own prompts (:func:`~torchtune_ppo.rlhf.sequence_processing.repeat_prompts`),
so a group never spans ranks and its statistics need no communication; whitening is over every
rank's valid tokens, so the result is the one-process one.
"""

from typing import Any, Dict, Mapping, NamedTuple, Optional

import torch

from torchtune_ppo import distributed, rlhf
from torchtune_ppo.rlhf import GROUP_ESTIMATORS, GROUP_STD_EPS, Trajectory
from torchtune_ppo.rlhf.correction import CorrectionWeights, MismatchStats, correction_weights, mismatch_stats


class AdvantageSettings(NamedTuple):
    """How a step's advantages are estimated, the config keys of the same names.

    Attributes:
        advantage_estimator (str): one of :data:`~torchtune_ppo.rlhf.rewards.ADVANTAGE_ESTIMATORS`.
        gamma (float): discount (``gae``, ``reinforce_plus_plus``).
        lmbda (float): GAE lambda of the returns, and of the advantages unless one of the last
            two is set (``gae`` only).
        whiten_rewards (bool): whiten the per-token rewards before GAE (``gae`` only).
        kl_estimator (str): the per-token KL in the reward (:func:`~torchtune_ppo.rlhf.kl.kl_estimate`).
        num_samples_per_prompt (int): ``n``, responses per prompt, contiguous.
        lmbda_actor (Optional[float]): the advantages' own lambda (decoupled GAE); None: ``lmbda``.
        lmbda_length_alpha (Optional[float]): the advantages' lambda per row,
            :func:`~torchtune_ppo.rlhf.rewards.length_adaptive_lmbda`; None: off.
        rollout_correction (Optional[Mapping]): ``mode`` (None: off), ``level``, ``threshold``:
            the advantages weighted by :func:`~torchtune_ppo.rlhf.correction.correction_weights`
            of the trajectory's recomputed against its rollout logprobs.
    """

    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lmbda: float = 0.95
    whiten_rewards: bool = False
    kl_estimator: str = "k1"
    num_samples_per_prompt: int = 1
    lmbda_actor: Optional[float] = None
    lmbda_length_alpha: Optional[float] = None
    rollout_correction: Optional[Mapping[str, Any]] = None

    @classmethod
    def from_config(cls, cfg: Any) -> "AdvantageSettings":
        """From the validated recipe config."""
        return cls(**{k: cfg[k] for k in cls._fields})


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
    # with rollout_correction: the weights, and the trainer's against the rollout's logprobs
    correction: Optional[CorrectionWeights] = None
    mismatch: Optional[MismatchStats] = None


@torch.no_grad()
def estimate_advantages(trajectory: Trajectory, settings: AdvantageSettings, kl_coeff: float) -> Advantages:
    """:func:`uncorrected_advantages`, then, with ``settings.rollout_correction``, the
    advantages weighted for the rollout's numerics (TIS or MIS, see :mod:`torchtune_ppo.rlhf.correction`)."""
    adv = uncorrected_advantages(trajectory, settings, kl_coeff)
    corr = settings.rollout_correction
    if not corr or corr["mode"] is None or trajectory.rollout_logprobs is None:
        return adv
    valid = ~trajectory.response_padding_masks
    weights = correction_weights(trajectory.logprobs, trajectory.rollout_logprobs, valid, mode=corr["mode"],
                                 level=corr["level"], threshold=float(corr["threshold"]))
    mismatch = mismatch_stats(trajectory.logprobs, trajectory.rollout_logprobs, valid)
    reduce = distributed.all_reduce_sum
    mismatch = MismatchStats(reduce(mismatch.sums), distributed.all_reduce_max(mismatch.max_abs))
    return adv._replace(advantages=adv.advantages * weights.weights, correction=weights, mismatch=mismatch)


def uncorrected_advantages(trajectory: Trajectory, settings: AdvantageSettings, kl_coeff: float) -> Advantages:
    """Rewards ``score - kl_coeff * kl`` per token (:func:`~torchtune_ppo.rlhf.rewards.get_rewards_ppo`),
    then the advantages of ``settings.advantage_estimator``.

    For ``gae``: the rewards optionally whitened, then GAE
    (:func:`~torchtune_ppo.rlhf.rewards.gae_advantages`), whitened. Every whitening is over every
    rank's valid tokens, so the result is the one-process one.

    Args:
        trajectory (Trajectory): the scored batch ``[b, ...]``, ``b = g * n`` rows in groups of
            ``n = settings.num_samples_per_prompt`` contiguous rows.
        settings (AdvantageSettings): the estimator and its settings.
        kl_coeff (float): weight of the KL penalty (the KL controller's value this step).

    Returns:
        Advantages: ``[b, T]`` tensors, 0 past each row's last valid token.
    """
    s = settings
    valid = ~trajectory.response_padding_masks
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
        trajectory.scores, trajectory.logprobs, trajectory.ref_logprobs, kl_coeff, trajectory.seq_lens, valid,
        kl_estimator=s.kl_estimator,
    )
    reduce = distributed.all_reduce_sum if distributed.world_size() > 1 else None
    estimator = s.advantage_estimator
    if estimator != "gae" and (s.lmbda_actor is not None or s.lmbda_length_alpha is not None):
        raise ValueError(f"lmbda_actor and lmbda_length_alpha are GAE's; advantage_estimator "
                         f"{estimator!r} takes neither, got {s.lmbda_actor!r} and {s.lmbda_length_alpha!r}.")
    if estimator == "gae":
        if s.whiten_rewards:
            rewards = rlhf.whiten(rewards, valid, reduce=reduce)
        lmbda_actor = s.lmbda_actor
        if s.lmbda_length_alpha is not None:
            lmbda_actor = rlhf.length_adaptive_lmbda(trajectory.seq_lens, s.lmbda_length_alpha)
        advantages, returns = rlhf.gae_advantages(trajectory.values, rewards, s.gamma, s.lmbda, valid,
                                                  reduce=reduce, lmbda_actor=lmbda_actor)
        row_lmbda = (torch.zeros_like(trajectory.scores, dtype=torch.float32)
                     + (s.lmbda if lmbda_actor is None else lmbda_actor))
        explained = rlhf.explained_variance(returns, trajectory.values, valid, reduce=reduce)
        return Advantages(advantages, returns, kl, kl_rewards, row_lmbda, explained)
    if estimator == "reinforce_plus_plus":
        returns = rlhf.discounted_returns(rewards, valid, s.gamma)
        advantages = rlhf.whiten(returns, valid, reduce=reduce)
    elif estimator in GROUP_ESTIMATORS:
        per_row = rlhf.group_baseline(rewards.sum(-1), s.num_samples_per_prompt, estimator)  # [b]
        advantages = per_row[:, None] * valid
        if estimator == "reinforce_plus_plus_baseline":
            advantages = rlhf.whiten(advantages, valid, reduce=reduce)
        returns = advantages
    else:
        raise ValueError(f"advantage_estimator must be one of {list(rlhf.ADVANTAGE_ESTIMATORS)}, "
                         f"got {estimator!r}.")
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
    metrics = {"explained_variance": explained, "lmbda_actor": lmbda}
    if adv.correction is not None:  # over every rank's tokens or sequences
        c = adv.correction
        hits, units, weight_sum, tokens = distributed.all_reduce_sum(
            torch.stack([c.hits, c.units, c.weight_sum, c.tokens])).tolist()
        # the tokens (or sequences) whose weight TIS truncated or MIS masked, and the mean weight
        metrics["rollout_corr/corrected_frac"] = hits / max(units, 1.0)
        metrics["rollout_corr/weight_mean"] = weight_sum / max(tokens, 1.0)
    return metrics


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

