"""Sequence processing on fixed-shape tensors: truncation at the stop token, attention masks and
positions of left-padded rows, the reward penalties' mask, and the reads of logprobs, entropies
and values from a model's final hidden states.

Pure functions that keep shapes static (no boolean indexing) and compile without graph breaks.
Masks are True where a token is valid.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import torch

def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None
) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 where nothing is valid)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


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


def masks_and_positions(
    prompt_lens: torch.Tensor, prompt_len: int, response_len: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal attention masks and position ids for left-padded prompts followed by responses.

    Padding is told by each prompt's real length, never by a token value. Only prompt padding
    is masked: tokens after a stop token never influence earlier positions in a causal model,
    and their outputs are masked downstream.

    Args:
        prompt_lens (torch.Tensor): real tokens of each prompt ``[b]``.
        prompt_len (int): ``P``, the padded prompt width.
        response_len (int): ``T``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: bool masks ``[b, P + T, P + T]`` (the diagonal is
        always True so all-pad rows stay finite) and int64 position ids ``[b, P + T]``.
    """
    s = prompt_len + response_len
    cols = torch.arange(s, device=prompt_lens.device)
    valid = cols >= (prompt_len - prompt_lens)[:, None]  # [b, S]
    causal = cols[None, :] <= cols[:, None]  # [S, S]
    masks = (causal & valid[:, None, :]) | torch.eye(s, dtype=torch.bool, device=valid.device)
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return masks, position_ids


def block_causal_masks(segment_ids: torch.Tensor, prefix_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention within each packed sequence: ``segment_ids [R, L]`` -> bool ``[R, L, L]``.

    With ``prefix_ids [R, L]`` a slot also attends the earlier slots of the segment its prefix id
    names: a response packed after its group's one prompt copy has its own segment and the
    prompt's segment as its prefix, so it sees the prompt and its own earlier tokens only. A slot
    whose prefix id is its own segment id sees its segment alone (the masks without prefixes).
    """
    length = segment_ids.shape[-1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=segment_ids.device))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        same = same | (prefix_ids[:, :, None] == segment_ids[:, None, :])
    return same & causal


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

