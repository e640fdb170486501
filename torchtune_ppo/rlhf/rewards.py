"""Rewards and advantages: KL-penalised per-token rewards, GAE, whitening, the critic's
explained variance, and the critic-free estimators' group baselines and returns.

``gae`` (the default estimator) uses the value model: GAE, then whitening. The others are
critic-free, so a run with one of them has no value model at all:

- ``grpo`` (https://arxiv.org/abs/2402.03300): each response's reward minus its group's mean,
  over the group's (unbiased) std.
- ``dr_grpo`` (Dr. GRPO, https://arxiv.org/abs/2503.20783): the same without the std.
- ``rloo`` (https://arxiv.org/abs/2402.14740): minus the mean of the *other* responses of the
  group, ``n / (n - 1) * (r - mean)``.
- ``reinforce_plus_plus`` (https://arxiv.org/abs/2501.03262): per-token discounted return-to-go
  of the KL-penalised rewards, whitened over the global batch's valid tokens.
- ``reinforce_plus_plus_baseline``: the group's mean subtracted from each response's reward,
  then whitened over the global batch's valid tokens.

Groups: a batch of ``b = g * n`` rows holds ``g`` groups of ``n`` responses to one prompt, each
group's rows contiguous (:func:`~torchtune_ppo.rlhf.sequence_processing.repeat_prompts`).

Observations: the estimators above read each row's valid tokens as a prefix (the score lands at
``seq_lens - 1``, GAE bootstraps from the next position). A multi-turn episode's tool observations
are holes among the policy's tokens; :func:`compact_order`, :func:`compact` and :func:`expand`
move the policy's tokens to the left of their row and back, so the estimators run over them alone,
observations skipped. :func:`turn_ids` and :func:`turn_gae_advantages` are GAE over assistant
turns instead of tokens (AReaL's turn-level GAE).

Pure functions on fixed-shape tensors. Reductions over processes come in as ``reduce``, a
function that sums a tensor over every process (None: this process only).
"""

from typing import Callable, Optional, Tuple, Union

import torch

from torchtune_ppo.rlhf.kl import kl_estimate
from torchtune_ppo.rlhf.sequence_processing import masked_mean

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# Estimators whose baseline is the group of responses to one prompt: they need n >= 2.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
# Added to the group std before dividing (verl's and the GRPO paper's epsilon).
GROUP_STD_EPS = 1e-6


def uses_value_model(advantage_estimator: str) -> bool:
    """Whether the estimator reads values: only ``gae``. The others build no value model."""
    return advantage_estimator == "gae"


def get_rewards_ppo(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_coeff: float,
    seq_lens: torch.Tensor,
    masks: torch.Tensor,
    kl_estimator: str = "k1",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coeff * kl`` everywhere valid, plus the score at the last valid token.

    Args:
        scores (torch.Tensor): sequence scores ``[b]``.
        logprobs (torch.Tensor): policy logprobs of the response ``[b, response_len]``.
        ref_logprobs (torch.Tensor): reference logprobs ``[b, response_len]``.
        kl_coeff (float): KL penalty coefficient.
        seq_lens (torch.Tensor): valid tokens per row ``[b]`` (>= 1).
        masks (torch.Tensor): bool ``[b, response_len]``, True where valid.
        kl_estimator (str): the per-token ``kl``, see :func:`torchtune_ppo.ppo.kl.kl_estimate`;
            ``k1``: ``logprobs - ref_logprobs``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``rewards``, ``kl`` and ``kl_rewards``,
        each ``[b, response_len]`` and 0 at invalid positions.
    """
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator) * masks
    kl_rewards = -kl_coeff * kl
    last = (seq_lens - 1).clamp(min=0).unsqueeze(-1)  # [b, 1]
    rewards = kl_rewards.scatter_add(1, last, scores.unsqueeze(-1).to(kl_rewards.dtype))
    return rewards, kl, kl_rewards


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Shift and scale ``x`` to zero mean and unit (unbiased) variance over valid positions.

    Unlike ``torchtune.rlhf.whiten`` with its default ``shift_mean=True``, the mean is not
    added back. Invalid positions are set to 0.

    Args:
        x (torch.Tensor): values, any shape, e.g. ``[b, response_len]``.
        mask (torch.Tensor): bool, same shape as ``x``, True where valid.
        eps (float): added to the variance before the square root.
        reduce (Optional[Callable]): sums a tensor over processes, so that the mean and variance
            are over every process's valid positions; None for this process's only.

    Returns:
        torch.Tensor: whitened values with the shape of ``x``.
    """
    if reduce is not None:
        m = mask.to(x.dtype)
        sums = reduce(torch.stack([(x * m).sum(), m.sum()]))
        n = sums[1]
        centered = (x - sums[0] / n.clamp(min=1.0)) * mask
        var = reduce(centered.pow(2).sum()) / (n - 1).clamp(min=1.0)
        return centered * torch.rsqrt(var + eps)
    mean = masked_mean(x, mask)
    centered = (x - mean) * mask
    n = mask.sum().to(x.dtype)
    var = centered.pow(2).sum() / (n - 1).clamp(min=1.0)
    return centered * torch.rsqrt(var + eps)


def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    lmbda: Union[float, torch.Tensor],
) -> torch.Tensor:
    """Generalized Advantage Estimation (https://arxiv.org/abs/1506.02438), not whitened.

    ``A_t = delta_t + gamma * lmbda * A_{t+1}`` with ``delta_t = r_t + gamma * V_{t+1} - V_t``;
    values and rewards past each row's last valid token must be 0, so the recursion ends there.

    Args:
        values (torch.Tensor): value estimates ``[b, response_len]``, 0 where invalid.
        rewards (torch.Tensor): per-token rewards ``[b, response_len]``, 0 where invalid.
        gamma (float): discount factor.
        lmbda (Union[float, torch.Tensor]): GAE lambda, one for all rows or one per row ``[b]``.

    Returns:
        torch.Tensor: advantages ``[b, response_len]``.
    """
    response_len = values.shape[-1]
    last_gae = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(response_len)):
        next_value = values[:, t + 1] if t < response_len - 1 else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lmbda * last_gae
        advantages.append(last_gae)
    return torch.stack(advantages[::-1], dim=1)


def length_adaptive_lmbda(seq_lens: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's actor lambda for a response of ``l`` tokens, ``1 - 1 / (alpha * l)``, at least 0
    (VAPO, https://arxiv.org/abs/2504.05118): ``seq_lens [b]`` -> float32 ``[b]``.

    The sum of the weights GAE gives the TD errors, ``1 / (1 - lambda)``, is then ``alpha * l``:
    proportional to the length, so long responses keep a low-bias estimate and short ones a
    low-variance one.
    """
    return (1.0 - 1.0 / (alpha * seq_lens.clamp(min=1).float())).clamp(min=0.0)


def gae_advantages(
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    lmbda: float,
    masks: torch.Tensor,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    lmbda_actor: Optional[Union[float, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages (whitened) and returns; with ``lmbda_actor`` decoupled (VAPO).

    Values and rewards past the last valid token must be 0 (as :func:`get_rewards_ppo` and the
    trajectory leave them), so the recursion ends at each row's last valid token.

    Args:
        values (torch.Tensor): value estimates ``[b, response_len]``.
        rewards (torch.Tensor): per-token rewards ``[b, response_len]``.
        gamma (float): discount factor.
        lmbda (float): GAE lambda of the returns (the critic's targets), and of the advantages
            unless ``lmbda_actor`` is given.
        masks (torch.Tensor): bool ``[b, response_len]``, True where valid.
        reduce (Optional[Callable]): see :func:`whiten`.
        lmbda_actor (Optional[Union[float, torch.Tensor]]): the advantages' lambda, one or per
            row ``[b]`` (:func:`length_adaptive_lmbda`); None: ``lmbda``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``advantages`` (whitened over valid tokens, 0 elsewhere)
        and ``returns`` (``lmbda``'s advantages + values), each ``[b, response_len]``.
    """
    values = values * masks
    rewards = rewards * masks
    advantages = gae(values, rewards, gamma, lmbda)
    returns = advantages + values
    if lmbda_actor is not None:
        advantages = gae(values, rewards, gamma, lmbda_actor)
    return whiten(advantages, masks, reduce=reduce), returns


def explained_variance(
    returns: torch.Tensor,
    values: torch.Tensor,
    masks: torch.Tensor,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """How much of the returns' variance the critic's values explain, over valid tokens:
    ``1 - Var(returns - values) / Var(returns)`` (1: perfect, 0: no better than the mean,
    negative: worse; NaN when the returns are constant).

    Args:
        returns (torch.Tensor): ``[b, response_len]``.
        values (torch.Tensor): ``[b, response_len]``.
        masks (torch.Tensor): bool ``[b, response_len]``, True where valid.
        reduce (Optional[Callable]): sums over processes (see :func:`whiten`), for the variance
            over every process's valid tokens.

    Returns:
        torch.Tensor: 0-dim.
    """
    m = masks.to(returns.dtype)
    both = torch.stack([returns, returns - values]) * m  # [2, b, T]
    sums = torch.cat([both.sum((1, 2)), m.sum()[None]])  # [3]: two sums and the count
    sums = reduce(sums) if reduce is not None else sums
    n = sums[2].clamp(min=1.0)
    centered = (both - (sums[:2] / n)[:, None, None]) * m  # two passes: no cancellation
    var = centered.pow(2).sum((1, 2))
    var = reduce(var) if reduce is not None else var
    return torch.where(var[0] > 0, 1.0 - var[1] / var[0], torch.nan)


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



def compact_order(valid: torch.Tensor) -> torch.Tensor:
    """A per-row permutation putting the valid positions first, in their order, then the invalid
    ones in theirs: ``valid [b, T]`` bool -> ``[b, T]`` long, for :func:`compact` and :func:`expand`.

    Shape-static (a stable sort, no boolean indexing). Where the valid positions are already a
    prefix of each row it is the identity.
    """
    return torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)


def compact(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x [b, T]`` read in :func:`compact_order`'s order: each row's valid positions on the left."""
    return x.gather(1, order)


def expand(x_compact: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`compact`: ``expand(compact(x, order), order) == x``, ``[b, T]``."""
    return torch.empty_like(x_compact).scatter(1, order, x_compact)


def turn_ids(valid: torch.Tensor, observation_masks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The assistant turn of each valid token: 0, 1, 2, ... along each row, -1 where invalid.

    A new turn starts at the first valid token after an observation: a turn is a run of valid
    tokens with no observation token between them (padding between them does not split it).
    Without ``observation_masks`` each row is one turn.

    Args:
        valid (torch.Tensor): bool ``[b, T]``, True at the policy's tokens.
        observation_masks (Optional[torch.Tensor]): bool ``[b, T]``, True at observation tokens.

    Returns:
        torch.Tensor: long ``[b, T]``.
    """
    if observation_masks is None:
        return torch.where(valid, 0, -1)
    order = compact_order(valid)
    # [b, T]: observations up to each valid token, the valid tokens first in their order
    seen = compact(observation_masks.long().cumsum(1), order)
    starts = torch.cat([torch.zeros_like(seen[:, :1]), (seen[:, 1:] > seen[:, :-1]).long()], dim=1)
    return torch.where(valid, expand(starts.cumsum(1), order), -1)


def turn_gae_advantages(
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    lmbda: float,
    masks: torch.Tensor,
    turns: torch.Tensor,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    lmbda_actor: Optional[Union[float, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE over assistant turns (AReaL's turn-level GAE): each turn is one step, whose reward is
    the sum of its tokens' rewards and whose value is the value at its first token; every token
    of a turn gets its turn's advantage (then whitened over valid tokens) and return.

    ``A_k = delta_k + gamma * lmbda * A_{k+1}``, ``delta_k = R_k + gamma * V_{k+1} - V_k``, ending
    at each row's last turn; a row has at most ``T`` turns, so every sum and read is a
    scatter-add or gather on ``[b, T]``.

    Args:
        values (torch.Tensor): value estimates ``[b, T]``.
        rewards (torch.Tensor): per-token rewards ``[b, T]`` (:func:`get_rewards_ppo`).
        gamma (float): discount per turn.
        lmbda (float): GAE lambda per turn, of the returns and, unless ``lmbda_actor``, the
            advantages.
        masks (torch.Tensor): bool ``[b, T]``, True where valid.
        turns (torch.Tensor): long ``[b, T]``, each valid token's turn (:func:`turn_ids`),
            nondecreasing along the valid tokens of a row.
        reduce (Optional[Callable]): see :func:`whiten`.
        lmbda_actor (Optional[Union[float, torch.Tensor]]): the advantages' lambda, one or per
            row ``[b]``; None: ``lmbda``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: per-token ``advantages`` (whitened over valid tokens,
        0 elsewhere) and ``returns``, each ``[b, T]``.
    """
    m = masks.to(rewards.dtype)
    idx = turns.clamp(min=0)  # [b, T]; invalid tokens add 0 to turn 0
    # a turn's first token: its id above every id before it (invalid ones are -1)
    before = torch.cat([torch.full_like(turns[:, :1], -1), turns.cummax(1).values[:, :-1]], dim=1)
    first = (masks & (turns > before)).to(values.dtype)
    turn_rewards = torch.zeros_like(rewards).scatter_add(1, idx, rewards * m)  # [b, T turns]
    turn_values = torch.zeros_like(values).scatter_add(1, idx, values * first)  # 0 past the last turn
    turn_advantages = gae(turn_values, turn_rewards, gamma, lmbda)
    returns = (turn_advantages + turn_values).gather(1, idx) * m
    if lmbda_actor is not None:
        turn_advantages = gae(turn_values, turn_rewards, gamma, lmbda_actor)
    return whiten(turn_advantages.gather(1, idx) * m, masks, reduce=reduce), returns
