"""Sampling one token per row without a host sync: the exponential race, top-k, top-p."""

from typing import Optional, Tuple

import torch

__all__ = ["sample"]


def sample(
    logits: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row with the exponential race; no host sync.

    ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. is a draw from ``probs``.

    Args:
        logits (torch.Tensor): ``[B, V]`` next-token logits.
        noise (Optional[torch.Tensor]): ``[B, V]``, or ``[B, top_k]`` when ``top_k`` is set,
            Exponential(1) draws. Unused (may be None) when ``top_k == 1``.
        temperature (float): logits are divided by it; must be > 0.
        top_k (Optional[int]): sample among the ``top_k`` largest logits; 1 is greedy argmax.
        top_p (Optional[float]): then keep the smallest set of tokens whose probability
            (renormalised over the top-k, when set) sums to at least ``top_p``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``[B]`` int64 tokens and their ``[B]`` float32
        log-probabilities under the full ``softmax(logits / temperature)``.
    """
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    if top_k == 1:
        token = torch.argmax(scaled, dim=-1)
    else:
        if top_k is not None:
            # Race among the top-k only: [B, k] instead of [B, V] noise and softmax.
            # Sorted (descending) only when top-p needs it.
            cand, cand_idx = torch.topk(scaled, top_k, dim=-1, sorted=top_p is not None)
        else:
            cand, cand_idx = scaled, None
        if top_p is not None and top_p < 1.0:
            cand = _top_p_filter(cand, top_p, is_sorted=top_k is not None)
        probs = torch.softmax(cand, dim=-1)
        # A zero draw would turn a filtered 0 into 0/0 = NaN, which argmax would pick.
        race = probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)
        choice = torch.argmax(race, dim=-1)  # [B]
        token = choice if cand_idx is None else cand_idx.gather(-1, choice[:, None])[:, 0]
    logprob = logprobs.gather(-1, token[:, None])[:, 0]
    return token, logprob


def _top_p_filter(scores: torch.Tensor, top_p: float, *, is_sorted: bool) -> torch.Tensor:
    """Sets to -inf the scores outside the top-p nucleus. ``scores``: [B, N]."""
    if is_sorted:
        sorted_scores, order = scores, None
    else:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first is always kept.
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    sorted_scores = sorted_scores.masked_fill(drop, -float("inf"))
    if order is None:
        return sorted_scores
    return torch.empty_like(scores).scatter_(-1, order, sorted_scores)
