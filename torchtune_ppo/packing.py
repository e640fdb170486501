"""Packing a PPO minibatch into fixed-shape rows of real tokens, for the loss step.

A trajectory row is ``[P + T]``: left padding, the prompt's real tokens, the response, then
padding after the stop token. The loss reads response token ``j`` through the outputs at
column ``P - 1 + j`` (its logprob, and the value of the state before it), so all a row needs
is its prompt's real tokens and its response up to the token before its last valid one:
``prompt_len + span - 1`` tokens, where ``span`` ends at the last valid response token.

Each such sequence is placed whole (first-fit decreasing) into micro-steps of ``R`` rows of
``L = P + T - 1`` slots, so any sequence fits a row, with at most ``N`` reads per micro-step.
Sequences sharing a row see only themselves (block-diagonal causal masks) and count positions
from 0, as in their trajectory row. Every micro-step has the same shapes, so the compiled loss
step keeps one graph; only the number of micro-steps changes with the length mix (a Python
loop count).

Each read carries the weight ``1 / (grad_accum * valid tokens of its micro-batch)``, the
micro-batch being the one the recipe drew for it, so the sum of the weighted token losses over
all micro-steps of a minibatch equals the sum of the micro-batches' masked means scaled by
``1 / grad_accum``: the same loss, gradients and stats as the padded micro-batches.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_ppo import rlhf
from torchtune_ppo.trajectory import Trajectory


class SequenceLengths(NamedTuple):
    """Per trajectory row, on the host: what packing needs to place it.

    Attributes:
        prompt_lens (List[int]): real prompt tokens (>= 1).
        spans (List[int]): response positions up to and including the last valid token.
        valid_counts (List[int]): valid response tokens (the masked means' denominators).
    """

    prompt_lens: List[int]
    spans: List[int]
    valid_counts: List[int]


class PackedMicroStep(NamedTuple):
    """One packed micro-step, the tensor arguments of ``packed_ppo_loss_step`` in order.

    ``R`` rows of ``L`` slots; ``N`` reads (positions whose output is read), flat indices
    into the ``R * L`` slots. Unused slots are one-token segments at position 0; unused reads
    point at slot 0 with weight 0.

    Attributes:
        tokens (torch.Tensor): ``[R, L]``.
        segment_ids (torch.Tensor): ``[R, L]``, equal within a sequence, unique otherwise.
        position_ids (torch.Tensor): ``[R, L]``, from 0 within each sequence.
        read_positions (torch.Tensor): ``[N]``, slot whose output predicts the target.
        old_logprobs (torch.Tensor): ``[N]``.
        old_values (torch.Tensor): ``[N]``.
        advantages (torch.Tensor): ``[N]``.
        returns (torch.Tensor): ``[N]``.
        targets (torch.Tensor): ``[N]``, the response token read.
        weights (torch.Tensor): ``[N]``, ``1 / (grad_accum * n_valid(micro-batch))``, 0 if unused.
        micro_batch_ids (torch.Tensor): ``[N]``, the micro-batch each read belongs to.
    """

    tokens: torch.Tensor
    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    read_positions: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    micro_batch_ids: torch.Tensor


def default_rows(micro_batch_size: int) -> int:
    """Rows per packed micro-step for micro-batches of ``micro_batch_size`` padded rows: half.

    Real tokens fill a third to a half of a padded row in typical PPO batches (shorter prompts,
    early stops), so a micro-batch's tokens usually fit one such micro-step. Fewer rows would
    waste less padding in the last micro-step but pay the fixed cost of a call (kernel launches,
    autograd bookkeeping for both models) more often; on the tiny CPU task that cost is worth
    a few rows.
    """
    return max(1, (micro_batch_size + 1) // 2)


def sequence_lengths(trajectory: Trajectory, prompt_len: int) -> SequenceLengths:
    """Reads each row's prompt length, response span and valid count to the host (one sync).

    The prompt length comes from the first response token's mask row, which attends to
    exactly the prompt's real tokens.

    Raises:
        ValueError: a prompt has no real token (the config checks reject such data).
    """
    valid = ~trajectory.response_padding_masks  # [b, T]
    prompt_lens = trajectory.masks[:, prompt_len, :prompt_len].sum(-1)  # [b]
    columns = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    spans = (valid * columns).amax(-1)  # [b]
    host = torch.stack([prompt_lens, spans, valid.sum(-1)]).tolist()
    if min(host[0]) < 1:
        raise ValueError(f"packing needs at least one real prompt token per row, got {host[0]}")
    return SequenceLengths(*host)


def plan_micro_steps(
    token_counts: Sequence[int],
    read_counts: Sequence[int],
    *,
    rows: int,
    row_len: int,
    max_reads: int,
) -> Tuple[List[Tuple[int, int, int]], int]:
    """First-fit decreasing placement of whole sequences into micro-steps of ``rows`` rows.

    Args:
        token_counts (Sequence[int]): tokens of each sequence (each <= ``row_len``).
        read_counts (Sequence[int]): reads of each sequence (each <= ``max_reads``).
        rows (int): rows per micro-step.
        row_len (int): slots per row.
        max_reads (int): reads per micro-step.

    Returns:
        Tuple: for each sequence ``(step, first slot in the step, first read in the step)``,
        and the number of micro-steps (at least 1).
    """
    open_rows = []  # [step, first slot of the row, slots used]
    step_rows, step_reads = [], []
    places = [None] * len(token_counts)
    for i in sorted(range(len(token_counts)), key=lambda i: -token_counts[i]):
        n, r = token_counts[i], read_counts[i]
        if n > row_len or r > max_reads:
            raise ValueError(f"a sequence of {n} tokens and {r} reads does not fit a micro-step "
                             f"of {rows} rows of {row_len} tokens and {max_reads} reads")
        row = next((o for o in open_rows if o[2] + n <= row_len and step_reads[o[0]] + r <= max_reads), None)
        if row is None:
            step = next((k for k in range(len(step_rows))
                         if step_rows[k] < rows and step_reads[k] + r <= max_reads), len(step_rows))
            if step == len(step_rows):
                step_rows.append(0)
                step_reads.append(0)
            row = [step, step_rows[step] * row_len, 0]
            step_rows[step] += 1
            open_rows.append(row)
        places[i] = (row[0], row[1] + row[2], step_reads[row[0]])
        row[2] += n
        step_reads[row[0]] += r
    return places, max(len(step_rows), 1)


def pack_minibatch(
    trajectory: Trajectory,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    micro_batches: Sequence[Sequence[int]],
    lengths: SequenceLengths,
    *,
    prompt_len: int,
    rows: int,
    max_reads: int = 0,
    valid_totals: Optional[Sequence[int]] = None,
) -> List[PackedMicroStep]:
    """The packed micro-steps of one minibatch: placement on the host, gathers on the device.

    Args:
        trajectory (Trajectory): the step's batch, ``[B, P + T]`` rows.
        advantages (torch.Tensor): ``[B, T]``.
        returns (torch.Tensor): ``[B, T]``.
        micro_batches (Sequence[Sequence[int]]): the minibatch's trajectory rows, split into the
            ``grad_accum`` micro-batches whose masked means the loss reproduces.
        lengths (SequenceLengths): from :func:`sequence_lengths`.
        prompt_len (int): ``P``.
        rows (int): ``R``, rows per micro-step.
        max_reads (int): ``N``, reads per micro-step; 0 means ``R * T``, a padded micro-batch's.
        valid_totals (Optional[Sequence[int]]): per micro-batch, the valid tokens its weights
            divide by; None for its own. With data parallel ranks: the global micro-batch's, so
            the ranks' weighted losses sum to the global micro-batch's mean.

    Returns:
        List[PackedMicroStep]: one or more micro-steps, all of the same shapes.
    """
    s = trajectory.query_responses.shape[1]
    response_len = s - prompt_len
    row_len = s - 1
    max_reads = max_reads or rows * response_len
    grad_accum = len(micro_batches)
    seqs = [(g, i) for g, idxs in enumerate(micro_batches) for i in idxs if lengths.spans[i] > 0]
    if valid_totals is None:
        valid_totals = [sum(lengths.valid_counts[i] for i in idxs) for idxs in micro_batches]
    scale = [1.0 / (grad_accum * max(n, 1)) for n in valid_totals]
    token_counts = [lengths.prompt_lens[i] + lengths.spans[i] - 1 for _, i in seqs]
    places, num_steps = plan_micro_steps(
        token_counts, [lengths.spans[i] for _, i in seqs],
        rows=rows, row_len=row_len, max_reads=max_reads,
    )

    # Host index lists, defaults for unused slots and reads: token 0 of row 0, its own segment.
    slots, reads = num_steps * rows * row_len, num_steps * max_reads
    token_src, positions = [0] * slots, [0] * slots
    segments = list(range(-1, -1 - slots, -1))
    read_pos, read_src, read_token, read_micro = [0] * reads, [0] * reads, [0] * reads, [0] * reads
    read_scale = [0.0] * reads
    for seq, ((g, i), n, (step, slot, read)) in enumerate(zip(seqs, token_counts, places)):
        slot0, read0, span = step * rows * row_len + slot, step * max_reads + read, lengths.spans[i]
        first = i * s + prompt_len - lengths.prompt_lens[i]  # flat index of the first real token
        token_src[slot0 : slot0 + n] = range(first, first + n)
        positions[slot0 : slot0 + n] = range(n)
        segments[slot0 : slot0 + n] = [seq] * n
        # read j sits on the slot before response token j
        last_prompt = slot + lengths.prompt_lens[i] - 1
        read_pos[read0 : read0 + span] = range(last_prompt, last_prompt + span)
        read_src[read0 : read0 + span] = range(i * response_len, i * response_len + span)
        read_token[read0 : read0 + span] = range(i * s + prompt_len, i * s + prompt_len + span)
        read_micro[read0 : read0 + span] = [g] * span
        read_scale[read0 : read0 + span] = [scale[g]] * span

    device = trajectory.query_responses.device
    index = _to_device(torch.tensor([token_src, positions, segments]), device)
    read_index = _to_device(torch.tensor([read_pos, read_src, read_token, read_micro]), device)
    read_scale = _to_device(torch.tensor(read_scale, dtype=torch.float32), device)
    token_src, positions, segments = index.view(3, num_steps, rows, row_len)
    read_pos, read_src, read_token, read_micro = read_index.view(4, num_steps, max_reads)

    flat_tokens = trajectory.query_responses.reshape(-1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [K, N]
        return x.reshape(-1)[read_src]

    valid = gather(~trajectory.response_padding_masks)
    weights = torch.where(valid, read_scale.view(num_steps, max_reads), 0.0)
    packed = PackedMicroStep(
        tokens=flat_tokens[token_src],
        segment_ids=segments,
        position_ids=positions,
        read_positions=read_pos,
        old_logprobs=gather(trajectory.logprobs),
        old_values=gather(trajectory.values),
        advantages=gather(advantages),
        returns=gather(returns),
        targets=flat_tokens[read_token],
        weights=weights,
        micro_batch_ids=read_micro,
    )
    # Separate contiguous tensors per micro-step, so each call sees the same strides and offsets.
    return [PackedMicroStep(*(t[k].clone() for t in packed)) for k in range(num_steps)]


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory the copy does not wait for the device's queued work.
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def block_causal_masks(segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within each packed sequence: ``segment_ids [R, L]`` -> bool ``[R, L, L]``."""
    length = segment_ids.shape[-1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=segment_ids.device))
    return (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal


def micro_batch_stats(step_stats: Sequence[rlhf.PPOStats]) -> List[rlhf.PPOStats]:
    """Per-micro-batch stats of a minibatch from its packed micro-steps' ``[grad_accum]`` stats.

    Returns ``grad_accum`` :class:`~torchtune_ppo.rlhf.PPOStats` of 0-dim tensors, each already
    scaled by ``1 / grad_accum``, as the padded micro-batches return them.
    """
    totals = [torch.stack(field).sum(0) for field in zip(*step_stats)]  # each [grad_accum]
    return [rlhf.PPOStats(*fields) for fields in zip(*(t.unbind() for t in totals))]
