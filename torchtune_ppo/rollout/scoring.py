"""Steps 2-6 on real tokens only: the scoring forwards on packed rows.

:func:`~torchtune_ppo.rollout.fused.score_trajectory` runs the reference policy, the value model
and the reward model on padded ``[b, P + T]`` rows: left-padded prompts, responses padded after
the stop token. Real tokens are often a third of those positions. Here each row's real tokens
(its prompt's, then its response up to and including its last valid token) are packed whole,
first-fit decreasing, into at most ``b`` rows of ``P + T`` slots, as the loss step packs its
micro-steps (:mod:`torchtune_ppo.rlhf.packing`): block-diagonal causal masks, positions from 0 per
sequence, outputs projected only where read.

:func:`plan_scoring` places the sequences on the host from each row's prompt length and valid
response length (read in one sync after generation). :func:`packed_score_trajectory` is the
region, compiled as one graph when ``compile.trajectory`` is on: it truncates, builds the
packed tokens by a gather, runs the models, and gathers their outputs back into the ``[b, T]``
and ``[b]`` tensors of the padded :class:`~torchtune_ppo.rlhf.trajectory.Trajectory`, which it
returns with the same fields and meanings (padded masks and position ids included). The rows
``R`` and the chunk length ``K`` of the reads change with the length mix;
:meth:`PackedScoring.mark_dynamic` marks them so the compiled region keeps one graph for every mix.

Reads: response token ``j`` of a sequence is predicted by the output at the slot before it,
which is also the state whose value is read; the reward is read at the sequence's last valid
token. Reads are laid out as ``C`` chunks of ``K``, one output projection per chunk, so the
largest float32 tensor is ``[K, V]``.

With groups (``group_size = n``: the chunk's rows ``[g * n, (g + 1) * n)`` answer one prompt) a
group's prompt is packed once per row, followed by its responses
(:func:`~torchtune_ppo.rlhf.packing.share_prompts`): each response attends the prompt and its
own earlier tokens (``prefix_ids``), its positions continue from the prompt's length, and its
first token is read at the prompt's last slot. Rows are then
:func:`~torchtune_ppo.rlhf.packing.shared_row_len` long (``P + k * T``) instead of ``P + T``.
Without groups, ``common_prefix`` tokens that every prompt of the chunk begins with can be packed
once per row the same way, each sequence's other prompt tokens then its response following
(:func:`~torchtune_ppo.rlhf.packing.prefix_row_len` long rows).
"""

from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from torchtune_ppo import lora, rlhf
from torchtune_ppo._patches.dynamo import mark_dynamic, mark_layout_dynamic
from torchtune_ppo._patches.torchtune_modules import SegmentLayout, final_hidden_states
from torchtune_ppo.rlhf import ScoringSettings, Trajectory, block_causal_masks, finish_trajectory, truncated
from torchtune_ppo.rlhf.packing import (MIN_SIZE, plan_micro_steps, prefix_pieces, prefix_row_len, share_prompts,
                                        shared_row_len, to_device)
from torchtune_ppo.rlhf.segments import segment_layout


class PackedScoring(NamedTuple):
    """Where each real token and each read sits in the packed rows, for one scoring chunk.

    ``R`` rows of ``L = P + T`` slots; ``C * K`` reads in ``C`` chunks of ``K``. Unused slots
    are one-token segments at position 0 holding row 0's first token; unused reads point at
    slot 0 and are never gathered back.

    Attributes:
        token_src (torch.Tensor): ``[R, L]`` flat index into the ``[b, P + T]`` trajectory rows.
        segment_ids (torch.Tensor): ``[R, L]``, equal within a sequence, unique otherwise.
        position_ids (torch.Tensor): ``[R, L]``, from 0 within each sequence.
        read_positions (torch.Tensor): ``[C, K]`` flat slot in ``R * L`` whose output predicts
            a response token (and holds the value of the state before it).
        read_targets (torch.Tensor): ``[C, K]`` flat index into the ``[b, T]`` responses, the
            token each read predicts.
        read_index (torch.Tensor): ``[b, T]`` flat index into the ``C * K`` reads for each
            response position (0 where the position is not valid).
        last_positions (torch.Tensor): ``[b]`` flat slot of each row's last valid token.
        prefix_ids (Optional[torch.Tensor]): ``[R, L]``, the segment each slot may also attend
            (its group's prompt copy); None: no shared prompts.
        attention (Optional[SegmentLayout]): the rows' attention by sequence
            (:mod:`~torchtune_ppo.rlhf.segments`), the layers' mask instead of the block-causal
            masks; None: those masks.
    """

    token_src: torch.Tensor
    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    read_positions: torch.Tensor
    read_targets: torch.Tensor
    read_index: torch.Tensor
    last_positions: torch.Tensor
    prefix_ids: Optional[torch.Tensor] = None
    attention: Optional[SegmentLayout] = None

    def mark_dynamic(self, length: bool = False) -> "PackedScoring":
        """Rows ``R`` and chunk length ``K`` dynamic for ``torch.compile`` (both at least 2);
        ``length``: the row length ``L`` too (rows cut to what they hold: ``common_prefix``);
        with ``attention`` its sizes too."""
        prefix = () if self.prefix_ids is None else (self.prefix_ids,)
        layout = () if self.attention is None else (self.attention.out_index,)
        mark_dynamic(self, rows=(*self[:3], *prefix, *layout), reads=self[3:5], length=length)
        if self.attention is not None:
            mark_layout_dynamic(self.attention)
        return self


def plan_scoring(
    prompt_lens: Sequence[int],
    valid_counts: Sequence[int],
    *,
    prompt_len: int,
    response_len: int,
    num_chunks: int,
    device: torch.device,
    group_size: int = 1,
    row_len: Optional[int] = None,
    common_prefix: Optional[int] = None,
    segment_attention: bool = False,
) -> PackedScoring:
    """Packs one scoring chunk's sequences: placement on the host, index tensors on ``device``.

    Args:
        prompt_lens (Sequence[int]): real prompt tokens of each row (>= 1).
        valid_counts (Sequence[int]): valid response tokens of each row, stop token included
            (>= 1: the first response token is always valid).
        prompt_len (int): ``P``.
        response_len (int): ``T``.
        num_chunks (int): ``C``, from :func:`scoring_chunks`.
        device (torch.device): where the index tensors go.
        group_size (int): ``n`` > 1: rows ``[g * n, (g + 1) * n)`` share one prompt, packed
            once per row before their responses; 1: each row's own prompt.
        row_len (Optional[int]): ``L``; None: ``P + T``, or
            :func:`~torchtune_ppo.rlhf.packing.shared_row_len` with ``group_size`` > 1, or
            :func:`~torchtune_ppo.rlhf.packing.prefix_row_len` with ``common_prefix``.
        common_prefix (Optional[int]): with ``group_size`` 1, the tokens every prompt begins
            with (:func:`~torchtune_ppo.rlhf.packing.prompt_prefix`; 0 allowed), packed once per
            row; None: not shared.
        segment_attention (bool): the plan carries ``attention``, the rows' attention by
            sequence (:func:`~torchtune_ppo.rlhf.segments.segment_layout`).

    Returns:
        PackedScoring: ``R`` = the rows used (at most ``b``, at least 2), ``K`` = the reads
        over ``C`` rounded up (at least 2).

    Raises:
        ValueError: a row has no real prompt token (the config checks reject such data).
    """
    s = prompt_len + response_len
    by_prefix = common_prefix is not None and group_size == 1
    share = group_size > 1 or by_prefix
    if row_len is None:
        row_len = (shared_row_len(prompt_len, response_len, group_size) if group_size > 1 else
                   prefix_row_len(prompt_len, response_len) if by_prefix else s)
    b = len(prompt_lens)
    if b and min(prompt_lens) < 1:
        raise ValueError(f"packed scoring needs at least one real prompt token per row, got {list(prompt_lens)}")
    # A piece: one copy of a prompt (or of the prefix all prompts share), then its rows' other
    # prompt tokens and valid response tokens (one row unshared).
    total_reads = max(sum(valid_counts), 1)
    prefix = min([common_prefix, *prompt_lens]) if by_prefix else None
    if group_size > 1:
        pieces = share_prompts(range(b), prompt_lens, valid_counts, valid_counts, group_size=group_size,
                               row_len=row_len, max_reads=total_reads)
    elif by_prefix:  # balanced pieces, the rows cut to the longest
        pieces, length = prefix_pieces([q - prefix + v for q, v in zip(prompt_lens, valid_counts)], valid_counts,
                                       shared_len=prefix, row_len=row_len, max_reads=total_reads)
        row_len = max(length, MIN_SIZE)
    else:
        pieces = [[i] for i in range(b)]
    copies = [prompt_lens[p[0]] if prefix is None else prefix for p in pieces]  # each piece's shared slots
    counts = [c + sum(prompt_lens[i] - c + valid_counts[i] for i in p) for p, c in zip(pieces, copies)]
    # One micro-step of up to b rows: every piece fits a row, so all of them fit.
    places, (rows,), _ = plan_micro_steps(counts, [sum(valid_counts[i] for i in p) for p in pieces],
                                          rows=max(b, 1), row_len=row_len, max_reads=total_reads)
    slots = max(rows, MIN_SIZE) * row_len
    k = max(-(-sum(valid_counts) // num_chunks), MIN_SIZE)

    token_src, positions = [0] * slots, [0] * slots
    segments = list(range(-1, -1 - slots, -1))  # unused slots: a segment of their own
    prefixes = list(segments) if share else None
    read_pos, read_targets = [0] * (num_chunks * k), [0] * (num_chunks * k)
    read_index = [0] * (b * response_len)
    last_positions = [0] * b
    read = 0
    for piece_id, (piece, (_, slot, _), p) in enumerate(zip(pieces, places, copies)):
        first = piece[0] * s + prompt_len - prompt_lens[piece[0]]  # the prompt's first real token
        token_src[slot : slot + p] = range(first, first + p)
        positions[slot : slot + p] = range(p)
        segments[slot : slot + p] = [piece_id if share else piece[0]] * p
        if share:
            prefixes[slot : slot + p] = [piece_id] * p
        at = slot + p  # the slot of the next row's first own token
        for i in piece:
            v, q = valid_counts[i], prompt_lens[i]
            own, segment = q - p, len(pieces) + i if share else i  # own: prompt tokens after the copy
            token_src[at : at + own] = range(i * s + prompt_len - own, i * s + prompt_len)
            token_src[at + own : at + own + v] = range(i * s + prompt_len, i * s + prompt_len + v)
            positions[at : at + own + v] = range(p, q + v)
            segments[at : at + own + v] = [segment] * (own + v)
            if share:
                prefixes[at : at + own + v] = [piece_id] * (own + v)
            # response token j is predicted at the slot before it: the prompt's last for j = 0
            at += own
            read_pos[read : read + v] = range(at - 1, at - 1 + v)
            read_pos[read] = at - 1 if own else slot + p - 1
            read_targets[read : read + v] = range(i * response_len, i * response_len + v)
            read_index[i * response_len : i * response_len + v] = range(read, read + v)
            last_positions[i] = at + v - 1
            read, at = read + v, at + v

    index = to_device(torch.tensor([token_src, positions, segments, *([prefixes] if share else [])]), device)
    index = index.view(len(index), -1, row_len)
    reads = to_device(torch.tensor([read_pos, read_targets]), device).view(2, num_chunks, k)
    per_row = to_device(torch.tensor(read_index + last_positions), device)
    return PackedScoring(
        token_src=index[0],
        segment_ids=index[2],
        position_ids=index[1],
        read_positions=reads[0],
        read_targets=reads[1],
        read_index=per_row[: b * response_len].view(b, response_len),
        last_positions=per_row[b * response_len :],
        prefix_ids=index[3] if share else None,
        attention=SegmentLayout(*(to_device(t, device) for t in segment_layout(
            segments, prefixes, row_len=row_len))) if segment_attention else None,
    )


def packed_score_trajectory(
    query_responses: torch.Tensor,
    prompt_lens: torch.Tensor,
    logprobs: Optional[torch.Tensor],
    policy_model: Optional[nn.Module],
    ref_policy_model: nn.Module,
    value_model: Optional[nn.Module],
    reward_model: Optional[nn.Module],
    stop_token_ids: torch.Tensor,
    plan: PackedScoring,
    settings: ScoringSettings,
    scores: Optional[torch.Tensor] = None,
    episode_lens: Optional[torch.Tensor] = None,
    observation_masks: Optional[torch.Tensor] = None,
) -> Trajectory:
    """Steps 2-6 of the PPO trajectory with the forwards on packed rows.

    Args:
        query_responses (torch.Tensor): left-padded prompts then generated tokens ``[b, P + T]``.
        prompt_lens (torch.Tensor): real tokens of each prompt ``[b]``; the rest is padding.
        logprobs (Optional[torch.Tensor]): policy logprobs from the generator ``[b, T]``; when
            None they are computed with ``policy_model`` (step 2).
        policy_model (Optional[nn.Module]): the policy, used only when ``logprobs`` is None.
        ref_policy_model (nn.Module): frozen reference policy.
        value_model (Optional[nn.Module]): the value model, a ``[D, 1]`` output layer; None
            for a critic-free run (the values are 0).
        reward_model (Optional[nn.Module]): a classifier with a ``[D, 1]`` output read at each
            row's last valid token (what :class:`~torchtune_ppo.rewards.model.ModelReward`
            wraps); None when ``scores`` come from outside (a function reward, run before).
        stop_token_ids (torch.Tensor): ``[n_stop]``.
        plan (PackedScoring): from :func:`plan_scoring`, for these rows' prompt lengths and
            valid response lengths (after ``stop_token_ids``).
        settings (ScoringSettings): ``P``, the pad id, the temperature and the penalties.
        scores (Optional[torch.Tensor]): ``[b]`` scores of the truncated responses, used when
            ``reward_model`` is None; the penalties still apply.
        episode_lens (Optional[torch.Tensor]): multi-turn episodes: ``[b]`` tokens of each, whose
            end replaces the first stop token's (:func:`~torchtune_ppo.rlhf.trajectory.truncated`);
            ``plan`` then packs each whole episode.
        observation_masks (Optional[torch.Tensor]): with ``episode_lens``: ``[b, T]`` True on the
            environment's tokens, attended but not the policy's.

    Returns:
        Trajectory: the scored batch, padded ``[b, ...]`` as if scored on padded rows.
    """
    qr, response_padding_masks, masks, padded_positions = truncated(
        query_responses, prompt_lens, stop_token_ids, settings, episode_lens, observation_masks
    )
    responses = qr[:, settings.prompt_len:]
    tokens = qr.flatten()[plan.token_src]  # [R, L]
    packed_masks = (block_causal_masks(plan.segment_ids, plan.prefix_ids) if plan.attention is None
                    else plan.attention)  # [R, L, L] or by sequence
    reads, temperature = plan.read_positions, settings.temperature

    def hidden(model: nn.Module) -> torch.Tensor:  # [R, L, D]
        return final_hidden_states(model, tokens, mask=packed_masks, input_pos=plan.position_ids)

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [C, K] -> [b, T]
        return x.flatten()[plan.read_index]

    # Every trunk before any read: with compile.layers each trunk is a graph break, across which
    # only the inputs and the trunks' own tensors keep their dynamic sizes.
    h_policy = hidden(policy_model) if logprobs is None else None
    h_ref = hidden(ref_policy_model)
    h_value = None if value_model is None else hidden(value_model)
    if reward_model is not None:  # on the value model's base (lora.SharedBaseReward): its adapters off
        h_last = lora.base_adapters_off(reward_model, hidden)
    targets = responses.flatten()[plan.read_targets]  # [C, K]
    # step 2: policy and reference logprobs of the responses
    if logprobs is None:
        logprobs = to_rows(rlhf.read_logprobs(policy_model.output, h_policy.flatten(0, 1), reads, targets, temperature))
    ref_logprobs = to_rows(rlhf.read_logprobs(ref_policy_model.output, h_ref.flatten(0, 1), reads, targets,
                                              temperature))
    # step 3: values of the states before each response token (none for a critic-free run)
    values = (torch.zeros_like(ref_logprobs) if value_model is None
              else to_rows(rlhf.read_values(value_model.output, h_value.flatten(0, 1), reads)))
    # step 5: the reward model at each row's last valid token
    if reward_model is not None:
        scores = reward_model.output(h_last.flatten(0, 1)[plan.last_positions])[:, 0].float()

    return finish_trajectory(
        qr, response_padding_masks, masks, padded_positions, logprobs, ref_logprobs, values,
        scores, stop_token_ids, settings, observation_masks,
    )
