"""Steps 2-6 of a PPO step: score generated (query, response) pairs.

:func:`score_trajectory` is a plain function of tensors and modules with static shapes, so
it compiles as one graph. It is always called under ``torch.no_grad()`` with the same shapes,
so it compiles once. It runs the models on padded ``[b, P + T]`` rows: it is what
``compile.rollout`` traces with the generation, what a custom :data:`RewardFn` is scored
with, and the reference twin of the packed scoring the recipe uses otherwise
(:func:`~torchtune_ppo.rollout.scoring.packed_score_trajectory`, the same
:class:`Trajectory` from forwards on real tokens only). Both share :func:`truncated` (step 4)
and :func:`finish_trajectory` (penalties, step 6).
"""

from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import nn

from torchtune_ppo.ppo import rlhf
from torchtune_ppo._patches.torchtune_modules import final_hidden_states


class Trajectory(NamedTuple):
    """A batch of scored trajectories (``b`` rows, prompt length ``P``, response length ``T``).

    Attributes:
        query_responses (torch.Tensor): prompts then truncated responses ``[b, P + T]``.
        logprobs (torch.Tensor): policy logprobs at generation time ``[b, T]`` (0 where invalid).
        ref_logprobs (torch.Tensor): reference policy logprobs ``[b, T]`` (0 where invalid).
        values (torch.Tensor): value estimates ``[b, T]`` (0 where invalid).
        masks (torch.Tensor): bool causal attention masks ``[b, P + T, P + T]``.
        position_ids (torch.Tensor): positions counted from each row's first real token ``[b, P + T]``.
        response_padding_masks (torch.Tensor): bool ``[b, T]``, True after the first stop token.
        scores (torch.Tensor): reward per row after penalties ``[b]``.
        seq_lens (torch.Tensor): valid response tokens per row, stop token included ``[b]``.
    """

    query_responses: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    masks: torch.Tensor
    position_ids: torch.Tensor
    response_padding_masks: torch.Tensor
    scores: torch.Tensor
    seq_lens: torch.Tensor


# Reward source: (query_responses [b, S], masks [b, S, S], position_ids [b, S],
# last_idx [b] index of each row's last valid token) -> scores [b]. It sees padded rows, so a
# Rollout scores with it on padded rows; ModelReward, whose model is read at the last valid
# token only, is scored on packed rows instead (torchtune_ppo.rollout.scoring).
RewardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


class ModelReward:
    """Reward from a classifier with one output ``[b, S, 1]``, read at the last valid token."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, tokens, masks, position_ids, last_idx):
        out = self.model(tokens, mask=masks, input_pos=position_ids)  # [b, S, 1]
        return out[torch.arange(out.shape[0], device=out.device), last_idx, 0].float()


def _response_logprobs(
    model: nn.Module,
    query_responses: torch.Tensor,
    masks: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    prompt_len: int,
    temperature: float,
) -> torch.Tensor:
    """``[b, T]`` logprobs of ``responses``, projecting only the ``T`` positions that predict
    them, in chunks (no ``[b, P + T, V]`` logits)."""
    hidden = final_hidden_states(model, query_responses, mask=masks, input_pos=position_ids)
    hidden = hidden[:, prompt_len - 1 : -1]  # [b, T, D]: position i predicts token i + 1
    flat = rlhf.chunked_logprobs(model.output, hidden.flatten(0, 1), responses.flatten(), temperature)
    return flat.view(responses.shape)


def score_trajectory(
    query_responses: torch.Tensor,
    prompt_lens: torch.Tensor,
    logprobs: Optional[torch.Tensor],
    policy_model: Optional[nn.Module],
    ref_policy_model: nn.Module,
    value_model: nn.Module,
    reward_fn: Optional[RewardFn],
    stop_token_ids: torch.Tensor,
    *,
    prompt_len: int,
    pad_id: int,
    temperature: float,
    penalise_no_eos: bool,
    min_response_length: Optional[int],
    reward_penalty: float,
    scores: Optional[torch.Tensor] = None,
) -> Trajectory:
    """Steps 2-6 of the PPO trajectory: logprobs, values, truncation, scores, masks.

    Args:
        query_responses (torch.Tensor): left-padded prompts then generated tokens ``[b, P + T]``.
        prompt_lens (torch.Tensor): real tokens of each prompt ``[b]``; the rest is padding.
        logprobs (Optional[torch.Tensor]): policy logprobs from the generator ``[b, T]``; when
            None they are computed with ``policy_model`` (step 2).
        policy_model (Optional[nn.Module]): the policy, used only when ``logprobs`` is None.
        ref_policy_model (nn.Module): frozen reference policy.
        value_model (nn.Module): value model returning ``[b, S, 1]``.
        reward_fn (Optional[RewardFn]): the reward source in the graph, e.g. :class:`ModelReward`;
            None when ``scores`` come from outside (a function reward, run eagerly before).
        stop_token_ids (torch.Tensor): ``[n_stop]``.
        prompt_len (int): ``P``.
        pad_id (int): padding id.
        temperature (float): sampling temperature; logprobs are taken at this temperature.
        penalise_no_eos (bool): replace the score of rows without a stop token by ``reward_penalty``.
        min_response_length (Optional[int]): same for rows with fewer valid tokens.
        reward_penalty (float): the replacement score.
        scores (Optional[torch.Tensor]): ``[b]`` scores of the truncated responses, used when
            ``reward_fn`` is None; the penalties still apply.

    Returns:
        Trajectory: the scored batch.
    """
    query_responses, response_padding_masks, masks, position_ids = truncated(
        query_responses, prompt_lens, stop_token_ids, prompt_len=prompt_len, pad_id=pad_id
    )
    responses = query_responses[:, prompt_len:]

    # step 2: policy and reference logprobs of the responses
    if logprobs is None:
        logprobs = _response_logprobs(policy_model, query_responses, masks, position_ids,
                                      responses, prompt_len, temperature)
    ref_logprobs = _response_logprobs(ref_policy_model, query_responses, masks, position_ids,
                                      responses, prompt_len, temperature)

    # step 3: values of the states before each response token
    values = rlhf.response_values(
        value_model(query_responses, mask=masks, input_pos=position_ids), prompt_len
    )

    # step 5: score the truncated pairs at each row's last valid token
    if reward_fn is not None:
        seq_lens = (~response_padding_masks).sum(-1)
        scores = reward_fn(query_responses, masks, position_ids, prompt_len + seq_lens - 1)
    return finish_trajectory(
        query_responses, response_padding_masks, masks, position_ids, logprobs, ref_logprobs,
        values, scores, stop_token_ids, penalise_no_eos=penalise_no_eos,
        min_response_length=min_response_length, reward_penalty=reward_penalty,
    )


def truncated(
    query_responses: torch.Tensor,
    prompt_lens: torch.Tensor,
    stop_token_ids: torch.Tensor,
    *,
    prompt_len: int,
    pad_id: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4, first, so every later step sees the final tokens: each response truncated after
    its first stop token. Returns the truncated ``query_responses [b, P + T]``, the
    ``response_padding_masks [b, T]``, and the padded rows' attention masks and position ids
    (:func:`masks_and_positions`)."""
    prompts, responses = query_responses[:, :prompt_len], query_responses[:, prompt_len:]
    masks, position_ids = masks_and_positions(prompt_lens, prompt_len, responses.shape[1])
    response_padding_masks, responses = rlhf.truncate_after_stop_token(
        responses, stop_token_ids, pad_id
    )
    return torch.cat([prompts, responses], dim=1), response_padding_masks, masks, position_ids


def finish_trajectory(
    query_responses: torch.Tensor,
    response_padding_masks: torch.Tensor,
    masks: torch.Tensor,
    position_ids: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    stop_token_ids: torch.Tensor,
    *,
    penalise_no_eos: bool,
    min_response_length: Optional[int],
    reward_penalty: float,
) -> Trajectory:
    """Steps 5 (penalties) and 6 (everything past the last valid token zeroed): the
    :class:`Trajectory` from truncated rows (:func:`truncated`), ``[b, T]`` logprobs, reference
    logprobs and values, and the reward's ``[b]`` scores."""
    prompt_len = query_responses.shape[1] - response_padding_masks.shape[1]
    valid = ~response_padding_masks
    seq_lens = valid.sum(-1)
    penalty = rlhf.get_reward_penalty_mask(
        response_padding_masks,
        seq_lens,
        stop_token_ids,
        query_responses[:, prompt_len:],
        penalise_no_eos,
        min_response_length,
    )
    scores = torch.where(penalty, torch.full_like(scores, reward_penalty), scores)
    return Trajectory(
        query_responses=query_responses,
        logprobs=logprobs.float() * valid,
        ref_logprobs=ref_logprobs * valid,
        values=values * valid,
        masks=masks,
        position_ids=position_ids,
        response_padding_masks=response_padding_masks,
        scores=scores,
        seq_lens=seq_lens,
    )
