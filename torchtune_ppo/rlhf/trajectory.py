"""The scored batch of a PPO step and the rules every scoring path shares.

:class:`Trajectory` is what steps 2-6 produce; :class:`ScoringSettings` holds the scalars
they read. :func:`truncated` (step 4, first, so every later step sees the final tokens) and
:func:`finish_trajectory` (the penalties of step 5 and the zeroing of step 6) are called by
the packed scoring (:func:`~torchtune_ppo.rollout.scoring.packed_score_trajectory`) and by the
padded one of ``compile.rollout`` (:mod:`torchtune_ppo.rollout.fused`), so the two agree by
construction.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_ppo.rlhf.sequence_processing import get_reward_penalty_mask, masks_and_positions, truncate_after_stop_token


class ScoringSettings(NamedTuple):
    """The scalars of steps 2-6, fixed for a run (a compiled region guards on them).

    Attributes:
        prompt_len (int): ``P``, the width of the left-padded prompts.
        pad_id (int): written after each row's first stop token.
        temperature (float): the sampling temperature; logprobs are taken at it.
        penalise_no_eos (bool): replace the score of rows without a stop token by ``reward_penalty``.
        min_response_length (Optional[int]): same for rows with fewer valid tokens.
        reward_penalty (float): the replacement score.
    """

    prompt_len: int
    pad_id: int
    temperature: float
    penalise_no_eos: bool
    min_response_length: Optional[int]
    reward_penalty: float


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
        rollout_logprobs (Optional[torch.Tensor]): the generator's logprobs ``[b, T]`` (0 where
            invalid): ``logprobs`` itself unless the trainer recomputed those.
        observation_masks (Optional[torch.Tensor]): multi-turn episodes only: bool ``[b, T]``,
            True on the tokens an environment wrote (:mod:`torchtune_ppo.rollout.turns`). They are
            part of the sequence (attended) but not the policy's: ``response_padding_masks`` is
            True on them too, so they carry no loss, KL or value loss, and ``seq_lens`` counts
            the policy's tokens only. None: single-turn responses.
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
    rollout_logprobs: Optional[torch.Tensor] = None
    observation_masks: Optional[torch.Tensor] = None


def concat_trajectories(chunks: Sequence[Trajectory]) -> Trajectory:
    """The chunks' rows, in order, as one :class:`Trajectory` (None fields stay None)."""
    return Trajectory(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*chunks)))


def truncated(
    query_responses: torch.Tensor,
    prompt_lens: torch.Tensor,
    stop_token_ids: torch.Tensor,
    settings: ScoringSettings,
    episode_lens: Optional[torch.Tensor] = None,
    observation_masks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4, first, so every later step sees the final tokens: each response truncated after
    its first stop token. Returns the truncated ``query_responses [b, P + T]``, the
    ``response_padding_masks [b, T]``, and the padded rows' attention masks and position ids
    (:func:`masks_and_positions`).

    Multi-turn episodes hold a stop token at the end of every turn: with ``episode_lens [b]``
    each response ends after its episode instead, and ``observation_masks [b, T]`` (True on the
    environment's tokens) are padding for everything but attention."""
    prompt_len = settings.prompt_len
    prompts, responses = query_responses[:, :prompt_len], query_responses[:, prompt_len:]
    masks, position_ids = masks_and_positions(prompt_lens, prompt_len, responses.shape[1])
    if episode_lens is None:
        response_padding_masks, responses = truncate_after_stop_token(
            responses, stop_token_ids, settings.pad_id
        )
    else:
        after = torch.arange(responses.shape[1], device=responses.device) >= episode_lens[:, None]
        responses = responses.masked_fill(after, settings.pad_id)
        response_padding_masks = after if observation_masks is None else after | observation_masks
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
    settings: ScoringSettings,
    observation_masks: Optional[torch.Tensor] = None,
) -> Trajectory:
    """Steps 5 (penalties) and 6 (everything past the last valid token zeroed): the
    :class:`Trajectory` from truncated rows (:func:`truncated`), ``[b, T]`` logprobs, reference
    logprobs and values, and the reward's ``[b]`` scores."""
    prompt_len = query_responses.shape[1] - response_padding_masks.shape[1]
    valid = ~response_padding_masks
    seq_lens = valid.sum(-1)
    penalty = get_reward_penalty_mask(
        response_padding_masks,
        seq_lens,
        stop_token_ids,
        query_responses[:, prompt_len:],
        settings.penalise_no_eos,
        settings.min_response_length,
    )
    scores = torch.where(penalty, torch.full_like(scores, settings.reward_penalty), scores)
    logprobs = logprobs.float() * valid
    return Trajectory(
        query_responses=query_responses,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs * valid,
        values=values * valid,
        masks=masks,
        position_ids=position_ids,
        response_padding_masks=response_padding_masks,
        scores=scores,
        seq_lens=seq_lens,
        rollout_logprobs=logprobs,  # the same tensor, until the trainer recomputes ``logprobs``
        observation_masks=observation_masks,
    )

