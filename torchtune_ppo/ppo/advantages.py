"""Advantages of a scored batch: KL-penalised per-token rewards, then the advantage estimator
the config names (:data:`~torchtune_ppo.rlhf.rewards.ADVANTAGE_ESTIMATORS`; the estimators
themselves are :mod:`torchtune_ppo.rlhf.rewards`'s).

A response's reward is the sum of its per-token rewards, ``score - kl_coeff * sum(kl)``
(verl's with ``use_kl_in_reward``); ``kl_coeff: 0`` leaves the score alone.

Each rank repeats its own prompts (:func:`~torchtune_ppo.rlhf.sequence_processing.repeat_prompts`),
so a group never spans ranks and its statistics need no communication; whitening is over every
rank's valid tokens, so the result is the one-process one.

Multi-turn episodes (a trajectory with ``observation_masks``): observation tokens are invalid
(``response_padding_masks`` is True there), and every estimator runs over each row's policy
tokens alone, as if the observations were cut out of the row; the observations get 0. With
``turns.gae: turn``, GAE's steps are the assistant turns instead of the tokens
(:func:`~torchtune_ppo.rlhf.rewards.turn_gae_advantages`).
"""

from functools import partial
from typing import Any, Dict, Mapping, NamedTuple, Optional

import torch

from torchtune_ppo import distributed, rlhf
from torchtune_ppo.rlhf import GROUP_ESTIMATORS, GROUP_STD_EPS, Trajectory
from torchtune_ppo.rlhf.correction import CorrectionWeights, MismatchStats, correction_weights, mismatch_stats

# ``turns.gae``: GAE's step is a token, or an assistant turn of a multi-turn episode.
GAE_LEVELS = ("token", "turn")


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
        gae_level (str): config ``turns.gae``, one of :data:`GAE_LEVELS` (``gae`` only):
            ``token``, GAE over the policy's tokens; ``turn``, over assistant turns
            (:func:`~torchtune_ppo.rlhf.rewards.turn_gae_advantages`; ``gamma``, ``lmbda`` and
            ``lmbda_actor`` per turn, ``lmbda_length_alpha`` of the number of turns). Without
            observations a row is one turn: the whole response is one step.
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
    gae_level: str = "token"

    @classmethod
    def from_config(cls, cfg: Any) -> "AdvantageSettings":
        """From the validated recipe config; ``gae_level`` from the ``turns`` block, ``token``
        without one."""
        turns = cfg.get("turns", None)
        level = None if turns is None else turns.get("gae", None)
        settings = cls(**{k: cfg[k] for k in cls._fields if k != "gae_level"},
                       gae_level="token" if level is None else level)
        check_gae_level(settings)
        return settings


def check_gae_level(settings: AdvantageSettings) -> None:
    """``turns.gae`` is one of :data:`GAE_LEVELS`, and ``turn`` only with the ``gae`` estimator."""
    level, estimator = settings.gae_level, settings.advantage_estimator
    if level not in GAE_LEVELS:
        raise ValueError(f"turns.gae must be one of {list(GAE_LEVELS)}, got {level!r}.")
    if level == "turn" and estimator != "gae":
        raise ValueError(f"turns.gae='turn' runs GAE over turns: it needs advantage_estimator='gae', "
                         f"got advantage_estimator={estimator!r}; set turns.gae='token' or the estimator to 'gae'.")


class Advantages(NamedTuple):
    """``[b, T]`` each, 0 at invalid positions (observations included): the ``advantages`` and
    ``returns`` (the value model's targets; for a critic-free estimator unused by the loss), the
    per-token ``kl`` to the reference policy and ``kl_rewards``, its penalty part of the rewards;
    ``lmbda_actor`` ``[b]``, the lambda of each row's GAE advantages, and the critic's
    ``explained_variance`` (0-dim, global): both None for a critic-free estimator."""

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
    (:func:`~torchtune_ppo.rlhf.rewards.gae_advantages`, or over turns with ``gae_level: turn``),
    whitened. Every whitening is over every rank's valid tokens, so the result is the one-process one.

    A trajectory with ``observation_masks`` (not None) is compacted first: each row's valid (the
    policy's) tokens moved to its left (:func:`~torchtune_ppo.rlhf.rewards.compact`), the
    estimators run on those rows, and the outputs moved back, 0 at observations and padding.
    Without it the rows are used as they are (valid tokens a prefix of each row).

    Args:
        trajectory (Trajectory): the scored batch ``[b, ...]``, ``b = g * n`` rows in groups of
            ``n = settings.num_samples_per_prompt`` contiguous rows.
        settings (AdvantageSettings): the estimator and its settings.
        kl_coeff (float): weight of the KL penalty (the KL controller's value this step).

    Returns:
        Advantages: ``[b, T]`` tensors, 0 at invalid positions.
    """
    check_gae_level(settings)
    valid = ~trajectory.response_padding_masks
    observations = getattr(trajectory, "observation_masks", None)
    turns = rlhf.turn_ids(valid, observations) if settings.gae_level == "turn" else None
    scored = (trajectory.scores, trajectory.logprobs, trajectory.ref_logprobs, trajectory.values, valid)
    if observations is None:
        return _prefix_advantages(*scored, trajectory.seq_lens, turns, settings, kl_coeff)
    # no host sync on whether any row has an observation: without one the order is the identity
    order = rlhf.compact_order(valid)
    compact, expand = partial(rlhf.compact, order=order), partial(rlhf.expand, order=order)
    adv = _prefix_advantages(trajectory.scores, *map(compact, scored[1:]), trajectory.seq_lens,
                             None if turns is None else compact(turns), settings, kl_coeff)
    return adv._replace(advantages=expand(adv.advantages), returns=expand(adv.returns), kl=expand(adv.kl),
                        kl_rewards=expand(adv.kl_rewards))


def _prefix_advantages(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                       values: torch.Tensor, valid: torch.Tensor, seq_lens: torch.Tensor,
                       turns: Optional[torch.Tensor], s: AdvantageSettings, kl_coeff: float) -> Advantages:
    """:func:`uncorrected_advantages` of rows whose ``valid [b, T]`` tokens are a prefix;
    ``turns [b, T]``: each token's turn for turn-level GAE, None for token-level."""
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
        scores, logprobs, ref_logprobs, kl_coeff, seq_lens, valid, kl_estimator=s.kl_estimator,
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
        if s.lmbda_length_alpha is not None:  # of GAE's steps: tokens, or turns
            steps = seq_lens if turns is None else turns.max(-1).values + 1
            lmbda_actor = rlhf.length_adaptive_lmbda(steps, s.lmbda_length_alpha)
        if turns is None:
            advantages, returns = rlhf.gae_advantages(values, rewards, s.gamma, s.lmbda, valid,
                                                      reduce=reduce, lmbda_actor=lmbda_actor)
        else:
            advantages, returns = rlhf.turn_gae_advantages(values, rewards, s.gamma, s.lmbda, valid, turns,
                                                           reduce=reduce, lmbda_actor=lmbda_actor)
        row_lmbda = (torch.zeros_like(scores, dtype=torch.float32)
                     + (s.lmbda if lmbda_actor is None else lmbda_actor))
        explained = rlhf.explained_variance(returns, values, valid, reduce=reduce)
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

