"""PPO math on fixed-shape tensors: rewards with a KL penalty, GAE, whitening, the clipped losses.

All functions are pure, keep shapes static (no boolean indexing), and compile without graph
breaks. Masks are True where a token is valid.
"""

from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch

from torchtune_ppo.ppo.kl import kl_estimate


# How token losses make the minibatch loss (verl's ``loss_agg_mode`` names); the weights are
# :func:`torchtune_ppo.ppo.packing.loss_weight`'s.
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


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None
) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 where nothing is valid)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def response_logprobs(
    logits: torch.Tensor, responses: torch.Tensor, prompt_len: int, temperature: float
) -> torch.Tensor:
    """Logprobs of ``responses [b, T]`` under full-sequence ``logits [b, P + T, V]`` -> ``[b, T]``.

    The logits at position ``i`` predict token ``i + 1``, so the response's come from
    positions ``P - 1 .. P + T - 2``.
    """
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    return torch.gather(torch.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)


def chunked_logprobs(
    output: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Logprobs of ``targets [N]`` from final hidden states ``hidden [N, D]``, chunk by chunk.

    The output projection runs only on the ``N`` positions whose logprob is read, at most
    ``chunk_size`` of them at a time, so no ``[rows, S, V]`` logits exist; the largest
    float32 tensor is ``[chunk_size, V]``.

    Args:
        output (Callable): the model's output projection, ``model.output`` (an ``nn.Linear``
            or a ``TiedLinear`` sharing the embedding weight).
        hidden (torch.Tensor): hidden states after the final norm ``[N, D]``.
        targets (torch.Tensor): the token each position predicts ``[N]``.
        temperature (float): logits are divided by it before the softmax.
        chunk_size (int): positions per projection.

    Returns:
        torch.Tensor: float32 ``[N]``.
    """
    logprobs = []
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        logprobs.append(token_logprobs(output, hidden[start:end], targets[start:end], temperature))
    return torch.cat(logprobs)


def token_logprobs(
    output: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Logprobs of ``targets [n]`` from ``hidden [n, D]`` in one projection (one chunk of
    :func:`chunked_logprobs`): float32 ``[n]``."""
    logits = output(hidden).float() / temperature  # [n, V]
    return torch.gather(torch.log_softmax(logits, dim=-1), 1, targets[:, None]).squeeze(1)


def read_logprobs(
    output: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    read_positions: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Logprobs of ``targets [C, K]`` read from packed hidden states at ``read_positions``.

    The one read of the packed regions (scoring and loss step): one output projection per
    chunk of ``K`` reads, so the largest float32 tensor is ``[K, V]``.

    Args:
        output (Callable): the model's output projection, ``model.output``.
        hidden (torch.Tensor): final hidden states of the packed slots, flat ``[R * L, D]``.
        read_positions (torch.Tensor): ``[C, K]`` flat slots whose outputs predict ``targets``.
        targets (torch.Tensor): ``[C, K]`` token ids.
        temperature (float): logits are divided by it before the softmax.

    Returns:
        torch.Tensor: float32 ``[C, K]``.
    """
    return torch.stack([
        token_logprobs(output, hidden.index_select(0, read_positions[c]), targets[c], temperature)
        for c in range(read_positions.shape[0])
    ])


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of distributions given by their log-probabilities
    ``[..., V]`` (a ``log_softmax``) -> ``[...]``."""
    return -(logprobs.exp() * logprobs).sum(-1)


def token_logprobs_and_entropy(
    output: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` of ``targets [n]`` and the entropy of the same ``[n, V]``
    distribution (logits over ``temperature``), each float32 ``[n]``.

    With ``entropy_grad`` False the entropy is detached: backward keeps nothing more than the
    logprobs' (the ``[n, V]`` log-softmax), and the logprobs are the same bits as
    :func:`token_logprobs`'.
    """
    logits = output(hidden).float() / temperature  # [n, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    entropy = entropy_from_logprobs(logprobs if entropy_grad else logprobs.detach())
    return torch.gather(logprobs, 1, targets[:, None]).squeeze(1), entropy


def read_logprobs_and_entropy(
    output: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    read_positions: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_logprobs` and the policy's entropy at the same reads, both float32 ``[C, K]``.

    One output projection per chunk of ``K`` reads, as :func:`read_logprobs`: no ``[R, L, V]``
    or ``[C, K, V]`` tensor, the largest float32 one is ``[K, V]``. ``entropy_grad``: see
    :func:`token_logprobs_and_entropy`.
    """
    chunks = [
        token_logprobs_and_entropy(output, hidden.index_select(0, read_positions[c]), targets[c], temperature,
                                   entropy_grad)
        for c in range(read_positions.shape[0])
    ]
    return torch.stack([lp for lp, _ in chunks]), torch.stack([h for _, h in chunks])


def read_values(
    output: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, read_positions: torch.Tensor
) -> torch.Tensor:
    """Values ``[C, K]`` (float32) of a one-output model's packed ``hidden [R * L, D]`` at
    ``read_positions [C, K]``."""
    return output(hidden[read_positions])[..., 0].float()


def response_values(values: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Value estimates of the states before each response token: ``[b, P + T, 1]`` -> ``[b, T]``."""
    return values[:, prompt_len - 1 : -1, 0].float()


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


def truncate_after_stop_token(
    responses: torch.Tensor, stop_token_ids: torch.Tensor, pad_id: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Replace every token after a row's first stop token with ``pad_id``.

    Args:
        responses (torch.Tensor): generated tokens ``[b, response_len]``.
        stop_token_ids (torch.Tensor): stop token ids ``[n_stop]``.
        pad_id (int): padding id written after the first stop token.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]:
            - padding_masks: bool ``[b, response_len]``, True after the first stop token
              (the stop token itself is kept and valid).
            - truncated responses ``[b, response_len]`` (a new tensor; the input is not modified).
    """
    is_stop = torch.isin(responses, stop_token_ids)
    seen = torch.cumsum(is_stop.int(), dim=-1)
    padding_masks = (seen > 1) | ((seen == 1) & ~is_stop)
    return padding_masks, responses.masked_fill(padding_masks, pad_id)


def get_reward_penalty_mask(
    response_padding_masks: torch.Tensor,
    seq_lens: torch.Tensor,
    stop_token_ids: torch.Tensor,
    responses: torch.Tensor,
    penalise_no_eos: bool,
    min_response_length: Optional[int],
) -> torch.Tensor:
    """Rows whose score is replaced by the penalty: no stop token, or shorter than the minimum.

    Args:
        response_padding_masks (torch.Tensor): bool ``[b, response_len]``, True after the stop token.
        seq_lens (torch.Tensor): valid response tokens per row, stop token included, ``[b]``.
        stop_token_ids (torch.Tensor): ``[n_stop]``.
        responses (torch.Tensor): truncated responses ``[b, response_len]``.
        penalise_no_eos (bool): penalise rows that never emitted a stop token.
        min_response_length (Optional[int]): penalise rows with fewer valid tokens.

    Returns:
        torch.Tensor: bool ``[b]``.
    """
    penalty = torch.zeros_like(seq_lens, dtype=torch.bool)
    if penalise_no_eos:
        has_stop = (torch.isin(responses, stop_token_ids) & ~response_padding_masks).any(-1)
        penalty = penalty | ~has_stop
    if min_response_length is not None:
        penalty = penalty | (seq_lens < min_response_length)
    return penalty


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


def estimate_advantages(
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


def ppo_loss(
    pi_old_logprobs: torch.Tensor,
    pi_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    phi_old_values: torch.Tensor,
    phi_values: torch.Tensor,
    returns: torch.Tensor,
    masks: torch.Tensor,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped PPO policy loss plus clipped value loss (as ``torchtune.rlhf.loss.PPOLoss``).

    Args:
        pi_old_logprobs (torch.Tensor): logprobs at trajectory time ``[b, response_len]``.
        pi_logprobs (torch.Tensor): logprobs of the current policy ``[b, response_len]``.
        advantages (torch.Tensor): ``[b, response_len]``.
        phi_old_values (torch.Tensor): values at trajectory time ``[b, response_len]``.
        phi_values (torch.Tensor): values of the current value model ``[b, response_len]``.
        returns (torch.Tensor): ``[b, response_len]``.
        masks (torch.Tensor): bool ``[b, response_len]``, True where valid.
        epsilon (float): policy ratio clip range.
        value_clip_range (float): value clip range around the old values.
        value_coeff (float): weight of the value loss.

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
