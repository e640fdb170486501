"""Packing a PPO minibatch into fixed-shape rows of real tokens, for the loss step.

A trajectory row is ``[P + T]``: left padding, the prompt's real tokens, the response, then
padding after the stop token. The loss reads response token ``j`` through the outputs at
column ``P - 1 + j`` (its logprob, and the value of the state before it), so all a row needs
is its prompt's real tokens and its response up to the token before its last valid one:
``prompt_len + span - 1`` tokens, where ``span`` ends at the last valid response token.

Each such sequence is placed whole (first-fit decreasing) into rows of ``L = P + T - 1``
slots, so any sequence fits a row; a micro-step holds at most ``R`` rows (the padded
micro-batch's row count, so its activations never exceed the padded step's) and ``R * T``
reads. Sequences sharing a row see only themselves (block-diagonal causal masks) and count
positions from 0, as in their trajectory row. A micro-step has only the rows and reads it
uses (at least 2 of each, so that no size is 1), so the tensors' first dimensions change from
call to call: the compiled loss step marks them dynamic
(:func:`~torchtune_ppo._patches.dynamo.mark_dynamic`) and keeps one graph for every length mix,
where fixed shapes would carry a third or more padding.

Each read carries the weight ``1 / (grad_accum * valid tokens of its micro-batch)``, the
micro-batch being the one the recipe drew for it, so the sum of the weighted token losses over
all micro-steps of a minibatch equals the sum of the micro-batches' masked means scaled by
``1 / grad_accum``: the same loss, gradients and stats as the padded micro-batches. The
``seq-mean-*`` aggregations (:data:`~torchtune_ppo.rlhf.loss.AGGREGATIONS`) weight the loss by
sequence instead, over the whole (global) minibatch, so they do not depend on how it is split
into micro-batches or ranks; the diagnostic stats (ratios, clip fractions, approximate KL) keep
the token-mean weights.

**Shared prompts.** With groups (``group_size = n`` rows in a row answering one prompt) a row can
hold one copy of a group's prompt followed by several of its responses (a *piece*): each
response's slots have a segment of their own and the prompt's segment as their *prefix*
(:func:`~torchtune_ppo.rlhf.sequence_processing.block_causal_masks`), so a response sees the
prompt and its own earlier tokens only; its positions continue from the prompt's length, as in
its own sequence; its first token is read at the prompt's last slot (one read per response,
the same slot), the others at its own slots. The forward is then the unshared one's, computed
on fewer tokens, and the gradient through the prompt's activations is the sum of the reads'
gradients, as the unshared sequences give it. A group whose responses do not fit one row
continues in another row with its own copy of the prompt (:func:`share_prompts`). Shared rows
are longer than unshared ones (:func:`shared_row_len`): a full-length prompt leaves no room for
a second response in a row of ``P + T - 1``.

**A prefix shared by every prompt.** Without groups, the prompts of a batch often begin with the
same tokens (a chat template's system turn). With ``share_prefix`` a row holds one copy of those
``c`` tokens (:attr:`SequenceLengths.common_prefix`) followed by several sequences, each its
prompt's other tokens (positions from ``c``) and its response: each sequence's slots are one
segment with the copy as its prefix, so it sees the ``c`` tokens and itself only, as in its own
row; its first token is read at its prompt's last slot. Rows are :func:`prefix_row_len` long.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_ppo._patches.dynamo import mark_dynamic, mark_layout_dynamic
from torchtune_ppo._patches.torchtune_modules import SegmentLayout
from torchtune_ppo.rlhf.loss import PPOStats, loss_weight
from torchtune_ppo.rlhf.segments import segment_layout
from torchtune_ppo.rlhf.trajectory import Trajectory


class SequenceLengths(NamedTuple):
    """Per trajectory row, on the host: what packing needs to place it.

    Attributes:
        prompt_lens (List[int]): real prompt tokens (>= 1).
        spans (List[int]): response positions up to and including the last valid token.
        valid_counts (List[int]): valid response tokens (the masked means' denominators).
        common_prefix (int): the tokens every row's prompt begins with (at most the shortest
            prompt); 0 unless asked for (:func:`sequence_lengths`).
    """

    prompt_lens: List[int]
    spans: List[int]
    valid_counts: List[int]
    common_prefix: int = 0


class PackedMicroStep(NamedTuple):
    """One packed micro-step, the tensor arguments of ``packed_ppo_loss_step`` in order.

    ``R`` rows of ``L`` slots; ``C * K`` reads (positions whose output is read), flat indices
    into the ``R * L`` slots, in ``C`` chunks of ``K`` (one output projection each). ``R`` and
    ``K`` are what the step's sequences need (at least 2); ``C`` is fixed for the run. Unused
    slots are one-token segments at position 0; unused reads point at slot 0 with weight 0.

    Attributes:
        tokens (torch.Tensor): ``[R, L]``.
        segment_ids (torch.Tensor): ``[R, L]``, equal within a sequence, unique otherwise.
        position_ids (torch.Tensor): ``[R, L]``, from 0 within each sequence.
        read_positions (torch.Tensor): ``[C, K]``, slot whose output predicts the target.
        old_logprobs (torch.Tensor): ``[C, K]``.
        old_values (torch.Tensor): ``[C, K]``.
        advantages (torch.Tensor): ``[C, K]``.
        returns (torch.Tensor): ``[C, K]``.
        targets (torch.Tensor): ``[C, K]``, the response token read.
        weights (torch.Tensor): ``[C, K]``, each token loss's weight in the minibatch loss
            (:func:`loss_weight`), 0 if unused.
        micro_batch_ids (torch.Tensor): ``[C, K]``, the micro-batch each read belongs to.
        stat_weights (torch.Tensor): ``[C, K]``, ``1 / (grad_accum * n_valid(micro-batch))``, 0 if
            unused: the token-mean weights of the diagnostic stats.
        ref_logprobs (torch.Tensor): ``[C, K]``, the reference policy's logprobs (the loss's KL).
        prefix_ids (Optional[torch.Tensor]): ``[R, L]``, the segment each slot may also attend
            (its group's prompt copy); None: rows without shared prompts.
        attention (Optional[SegmentLayout]): the rows' attention by sequence
            (:mod:`~torchtune_ppo.rlhf.segments`), the layers' mask instead of the block-causal
            masks of ``segment_ids``; None: those masks.
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
    stat_weights: torch.Tensor
    ref_logprobs: torch.Tensor
    prefix_ids: Optional[torch.Tensor] = None
    attention: Optional[SegmentLayout] = None

    def mark_dynamic(self, length: bool = False) -> "PackedMicroStep":
        """Rows ``R`` and chunk length ``K`` dynamic for ``torch.compile``: the compiled loss step
        traces one graph, symbolic in both, and every later length mix reuses it. ``length``:
        the row length ``L`` too (rows cut to what they hold: ``share_prefix``). With
        ``attention`` its sizes too (``S``, ``Lq``, ``Lk``)."""
        prefix = () if self.prefix_ids is None else (self.prefix_ids,)
        layout = () if self.attention is None else (self.attention.out_index,)
        mark_dynamic(self, rows=(*self[:3], *prefix, *layout), reads=self[3:13], length=length)
        if self.attention is not None:
            mark_layout_dynamic(self.attention)
        return self


# No micro-step has a dimension of size 1: the compiled step would specialise on it.
MIN_SIZE = 2

def default_rows(micro_batch_size: int, fixed_shapes: bool = False) -> int:
    """Most rows of one packed micro-step: the padded micro-batch's, ``micro_batch_size``.

    Every sequence fits a row, so a micro-batch always packs into one micro-step, and a
    micro-step's activations are at most the padded micro-batch's; it usually needs far fewer
    rows (real tokens fill a third to a half of a padded row in typical PPO batches).

    With ``fixed_shapes`` every micro-step has exactly this many rows: then half the
    micro-batch's (at least 2), which its real tokens usually fill, so that the padding left
    is small and a long mix spills into a second micro-step rather than padding every one.
    """
    if fixed_shapes:
        return max(MIN_SIZE, (micro_batch_size + 1) // 2)
    return max(1, micro_batch_size)


def logprob_chunks(max_reads: int, chunk_size: int = 256) -> int:
    """``C``, the output projections of a loss step of at most ``max_reads`` reads, each on at
    most ``chunk_size`` positions whatever the step's read count."""
    return max(1, -(-max_reads // chunk_size))


# A shared row is at most this many times an unshared row: attention costs grow with the row.
SHARED_ROW_FACTOR = 4


def shared_row_len(prompt_len: int, response_slots: int, group_size: int,
                   max_seq_len: Optional[int] = None) -> int:
    """``L`` of a row of shared prompts: ``P + k * t`` slots, room for a full-length prompt and
    ``k`` full-length responses.

    ``t`` is the slots a full-length response takes (``T - 1`` in the loss step, ``T`` in
    scoring); ``k = min(n, (F * (P + t) - P) // t)`` with ``F`` = :data:`SHARED_ROW_FACTOR`, so a
    whole group fits one row unless that row would be more than ``F`` times an unshared row
    (``P + t``); at least ``min(n, F)`` responses always fit. Never longer than ``max_seq_len``
    (the models' limit on a row), never shorter than ``P + t``.
    """
    base = prompt_len + response_slots
    if response_slots <= 0 or group_size <= 1:
        return base
    k = min(group_size, max(1, (SHARED_ROW_FACTOR * base - prompt_len) // response_slots))
    length = prompt_len + k * response_slots
    if max_seq_len is not None:
        length = min(length, max_seq_len)
    return max(base, length)


def shared_rows(micro_batch_size: int, row_len: int, prompt_len: int, response_slots: int,
                fixed_shapes: bool = False) -> int:
    """Most rows of one packed micro-step with shared prompts: the rows a micro-batch of whole
    groups at full length needs, ``ceil(m / k)`` for ``k`` responses a row (the prompt counted
    once per row), at least 2 (a micro-step never has fewer); with ``fixed_shapes`` half of
    that (at least 2), as :func:`default_rows`."""
    per_row = (row_len - prompt_len) // response_slots if response_slots > 0 else micro_batch_size
    rows = -(-micro_batch_size // max(per_row, 1))
    return max(MIN_SIZE, (rows + 1) // 2 if fixed_shapes else rows)


def prefix_row_len(prompt_len: int, response_slots: int, max_seq_len: Optional[int] = None) -> int:
    """``L`` of a row holding one copy of the prefix every prompt shares (``share_prefix``):
    :data:`SHARED_ROW_FACTOR` unshared rows (``P + t``), so at least that many whole sequences
    fit a row whatever the prefix's length; never longer than ``max_seq_len``, never shorter than
    ``P + t``."""
    base = prompt_len + response_slots
    length = SHARED_ROW_FACTOR * base
    if max_seq_len is not None:
        length = min(length, max_seq_len)
    return max(base, length)


def prefix_rows(micro_batch_size: int, row_len: int, prompt_len: int, response_slots: int,
                fixed_shapes: bool = False) -> int:
    """Most rows of a packed micro-step with a shared prefix: ``ceil(m / k)`` for the ``k`` whole
    sequences a row always holds (an empty prefix: ``L // (P + t)``), at least 2; with
    ``fixed_shapes`` half of that (at least 2), as :func:`default_rows`."""
    per_row = max(1, row_len // (prompt_len + response_slots))
    rows = -(-micro_batch_size // per_row)
    return max(MIN_SIZE, (rows + 1) // 2 if fixed_shapes else rows)


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """The number of leading tokens every prompt of ``prompts`` has in common (0 if none)."""
    if not prompts:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    for k in range(n):
        if any(p[k] != first[k] for p in prompts):
            return k
    return n


def prompt_prefix(query_responses: torch.Tensor, prompt_lens: Sequence[int], prompt_len: int) -> int:
    """:func:`common_prefix_len` of the real prompt tokens of left-padded ``[b, P + T]`` rows
    (one copy of the ``[b, P]`` prompts to the host)."""
    rows = query_responses[:, :prompt_len].tolist()
    return common_prefix_len([row[prompt_len - p:] for row, p in zip(rows, prompt_lens)])


def share_prompts(
    rows: Sequence[int],
    prompt_lens: Sequence[int],
    response_slots: Sequence[int],
    reads: Sequence[int],
    *,
    group_size: int,
    row_len: int,
    max_reads: int,
) -> List[List[int]]:
    """The pieces of shared-prompt rows: each a list of indices into ``rows``, whose responses
    follow one copy of their group's prompt.

    Responses of one group (trajectory row ``// group_size``) go first-fit decreasing into
    pieces of at most ``row_len`` slots (the prompt's, then each response's ``response_slots``)
    and ``max_reads`` reads; a group that fills one piece continues in another, with its own
    copy of the prompt. Groups come in the order of their first response in ``rows``.
    """
    groups: dict = {}
    for k, row in enumerate(rows):
        groups.setdefault(row // group_size, []).append(k)
    pieces = []
    for members in groups.values():
        room = row_len - prompt_lens[members[0]]
        open_pieces = []  # [indices, slots used, reads used]
        for k in sorted(members, key=lambda k: -response_slots[k]):
            piece = next((o for o in open_pieces
                          if o[1] + response_slots[k] <= room and o[2] + reads[k] <= max_reads), None)
            if piece is None:
                piece = [[], 0, 0]
                open_pieces.append(piece)
            piece[0].append(k)
            piece[1] += response_slots[k]
            piece[2] += reads[k]
        pieces += [o[0] for o in open_pieces]
    return pieces


def prefix_pieces(slots: Sequence[int], reads: Sequence[int], *, shared_len: int, row_len: int,
                  max_reads: int) -> Tuple[List[List[int]], int]:
    """Sequences after one copy of a ``shared_len``-slot prefix, in balanced pieces, and the row
    length they need.

    The fewest pieces (at least 2 when there are 2 sequences, so no row is filler) of at most
    ``row_len`` slots and ``max_reads`` reads each: sequences longest first, each to the piece
    holding the fewest slots. Returns the pieces (indices into ``slots``) and ``L``, the longest
    piece's slots with its copy: rows are cut to that, not ``row_len``.
    """
    n, room = len(slots), row_len - shared_len
    order = sorted(range(n), key=lambda k: -slots[k])
    count = max(min(n, MIN_SIZE), -(-sum(slots) // max(room, 1)), -(-sum(reads) // max(max_reads, 1)))
    while True:
        pieces, load, used = [[] for _ in range(count)], [0] * count, [0] * count
        for k in order:
            j = min(range(count), key=load.__getitem__)
            pieces[j].append(k)
            load[j] += slots[k]
            used[j] += reads[k]
        if count >= n or (max(load) <= room and max(used) <= max_reads):
            return [p for p in pieces if p], shared_len + max(load, default=0)
        count += 1


def sequence_lengths(trajectory: Trajectory, prompt_len: int, common_prefix: bool = False) -> SequenceLengths:
    """Reads each row's prompt length, response span and valid count to the host (one sync).

    The prompt length comes from the first response token's mask row, which attends to
    exactly the prompt's real tokens. ``common_prefix``: also the prompts' common prefix
    (:func:`prompt_prefix`, a second copy).

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
    prefix = prompt_prefix(trajectory.query_responses, host[0], prompt_len) if common_prefix else 0
    return SequenceLengths(*host, common_prefix=prefix)


def plan_micro_steps(
    token_counts: Sequence[int],
    read_counts: Sequence[int],
    *,
    rows: int,
    row_len: int,
    max_reads: int,
) -> Tuple[List[Tuple[int, int, int]], List[int], List[int]]:
    """First-fit decreasing placement of whole sequences into micro-steps of ``rows`` rows.

    Args:
        token_counts (Sequence[int]): tokens of each sequence (each <= ``row_len``).
        read_counts (Sequence[int]): reads of each sequence (each <= ``max_reads``).
        rows (int): rows per micro-step.
        row_len (int): slots per row.
        max_reads (int): reads per micro-step.

    Returns:
        Tuple: for each sequence ``(step, first slot in the step, first read in the step)``;
        the rows and the reads each micro-step uses (at least one micro-step).
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
    return places, step_rows or [0], step_reads or [0]


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
    num_chunks: int = 1,
    valid_totals: Optional[Sequence[int]] = None,
    fixed_shapes: bool = False,
    aggregation: str = "token-mean",
    num_sequences: Optional[int] = None,
    group_size: int = 1,
    row_len: Optional[int] = None,
    share_prefix: bool = False,
    segment_attention: bool = False,
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
        max_reads (int): reads per micro-step; 0 means ``R * T``, a padded micro-batch's.
        num_chunks (int): ``C``, the chunks a micro-step's reads are laid out in.
        fixed_shapes (bool): every micro-step gets ``rows`` rows and ``max_reads`` reads (rounded
            up to ``C`` chunks), for a compiled step that cannot take dynamic sizes (under FSDP,
            whose hooks break the step into frames that specialise them).
        valid_totals (Optional[Sequence[int]]): per micro-batch, the valid tokens its weights
            divide by; None for its own. With data parallel ranks: the global micro-batch's, so
            the ranks' weighted losses sum to the global micro-batch's mean.
        aggregation (str): one of :data:`~torchtune_ppo.rlhf.loss.AGGREGATIONS`, see :func:`loss_weight`.
        num_sequences (Optional[int]): sequences with a valid token in the global minibatch;
            None: this minibatch's (one process).
        group_size (int): ``n`` > 1: trajectory rows ``[g * n, (g + 1) * n)`` answer one prompt,
            and each group's responses in the minibatch share one prompt copy per row
            (:func:`share_prompts`); the micro-steps then carry ``prefix_ids``. 1: one sequence
            per prompt, as without groups.
        row_len (Optional[int]): ``L``; None: ``P + T - 1``, or :func:`shared_row_len` with
            ``group_size`` > 1, or :func:`prefix_row_len` with ``share_prefix``.
        share_prefix (bool): without groups, one copy per row of the ``lengths.common_prefix``
            tokens every prompt begins with, before several sequences (module docstring); the
            micro-steps then carry ``prefix_ids``.
        segment_attention (bool): the micro-steps carry ``attention``, their rows' attention by
            sequence (:func:`~torchtune_ppo.rlhf.segments.segment_layout`).

    Returns:
        List[PackedMicroStep]: one or more micro-steps, each with the rows and reads it uses.
    """
    s = trajectory.query_responses.shape[1]
    response_len = s - prompt_len
    by_prefix = share_prefix and group_size == 1
    share = group_size > 1 or by_prefix
    if row_len is None:
        row_len = (shared_row_len(prompt_len, response_len - 1, group_size) if group_size > 1 else
                   prefix_row_len(prompt_len, response_len - 1) if by_prefix else s - 1)
    max_reads = max_reads or rows * response_len
    grad_accum = len(micro_batches)
    seqs = [(g, i) for g, idxs in enumerate(micro_batches) for i in idxs if lengths.spans[i] > 0]
    if valid_totals is None:
        valid_totals = [sum(lengths.valid_counts[i] for i in idxs) for idxs in micro_batches]
    scale = [1.0 / (grad_accum * max(n, 1)) for n in valid_totals]
    if num_sequences is None:
        num_sequences = sum(lengths.valid_counts[i] > 0 for idxs in micro_batches for i in idxs)
    weight = [
        scale[g] if aggregation == "token-mean" else loss_weight(
            aggregation, grad_accum=grad_accum, micro_batch_tokens=valid_totals[g],
            num_sequences=num_sequences, sequence_tokens=lengths.valid_counts[i], response_len=response_len,
        )
        for g, i in seqs
    ]
    # A piece: one copy of a prompt (or of the prefix all prompts share), then its sequences'
    # other prompt tokens and response tokens (one sequence unshared).
    spans = [lengths.spans[i] for _, i in seqs]
    prompts = [lengths.prompt_lens[i] for _, i in seqs]
    prefix = min([lengths.common_prefix, *prompts]) if by_prefix else None
    if group_size > 1:
        pieces = share_prompts([i for _, i in seqs], prompts, [n - 1 for n in spans], spans,
                               group_size=group_size, row_len=row_len, max_reads=max_reads)
    elif by_prefix:  # balanced pieces, the rows cut to the longest (fixed shapes: full rows)
        pieces, length = prefix_pieces([q - prefix + n - 1 for q, n in zip(prompts, spans)], spans,
                                       shared_len=prefix, row_len=row_len, max_reads=max_reads)
        row_len = row_len if fixed_shapes else max(length, MIN_SIZE)
    else:
        pieces = [[k] for k in range(len(seqs))]
    copies = [prompts[p[0]] if prefix is None else prefix for p in pieces]  # each piece's shared slots
    token_counts = [c + sum(prompts[k] - c + spans[k] - 1 for k in p) for p, c in zip(pieces, copies)]
    places, step_rows, step_reads = plan_micro_steps(
        token_counts, [sum(spans[k] for k in p) for p in pieces],
        rows=rows, row_len=row_len, max_reads=max_reads,
    )
    if fixed_shapes:
        step_rows, step_reads = [rows] * len(step_rows), [max_reads] * len(step_reads)
    step_slots = [max(r, MIN_SIZE) * row_len for r in step_rows]
    # each step's reads as C chunks of K, K = ceil(reads / C) (at least MIN_SIZE)
    step_reads = [num_chunks * max(-(-r // num_chunks), MIN_SIZE) for r in step_reads]
    slot_base = [sum(step_slots[:k]) for k in range(len(step_slots))]
    read_base = [sum(step_reads[:k]) for k in range(len(step_reads))]

    # Host index lists, defaults for unused slots and reads: token 0 of row 0, its own segment.
    slots, reads = sum(step_slots), sum(step_reads)
    token_src, positions = [0] * slots, [0] * slots
    segments = list(range(-1, -1 - slots, -1))
    prefixes = list(segments) if share else None
    read_pos, read_src, read_token, read_micro = [0] * reads, [0] * reads, [0] * reads, [0] * reads
    read_scale, read_weight = [0.0] * reads, [0.0] * reads
    for piece_id, (piece, (step, slot, read), p) in enumerate(zip(pieces, places, copies)):
        slot0, read0 = slot_base[step] + slot, read_base[step] + read
        first = seqs[piece[0]][1] * s + prompt_len - prompts[piece[0]]  # the prompt's first real token
        token_src[slot0 : slot0 + p] = range(first, first + p)
        positions[slot0 : slot0 + p] = range(p)
        segments[slot0 : slot0 + p] = [piece_id] * p
        if share:
            prefixes[slot0 : slot0 + p] = [piece_id] * p
        last_prompt = slot + p - 1  # in the step's slots: reads index one micro-step
        cursor = p  # the next sequence's slot, from the piece's first
        for k in piece:
            (g, i), span, q = seqs[k], spans[k], prompts[k]
            n, own, segment = span - 1, q - p, len(pieces) + k if share else piece_id
            at = slot0 + cursor
            # the prompt's tokens after the shared copy (none unshared or in a group), then the
            # response: token j (j >= 1) is the input at the slot that reads token j + 1
            token_src[at + own : at + own + n] = range(i * s + prompt_len, i * s + prompt_len + n)
            token_src[at : at + own] = range(i * s + prompt_len - q + p, i * s + prompt_len)
            positions[at : at + own + n] = range(p, q + n)
            segments[at : at + own + n] = [segment] * (own + n)
            if share:
                prefixes[at : at + own + n] = [piece_id] * (own + n)
            # read 0 sits on the prompt's last slot, read j on the slot of response token j - 1
            r, cursor = read0, cursor + own
            read_pos[r : r + span] = [slot + cursor - 1 if own else last_prompt,
                                      *range(slot + cursor, slot + cursor + n)]
            read_src[r : r + span] = range(i * response_len, i * response_len + span)
            read_token[r : r + span] = range(i * s + prompt_len, i * s + prompt_len + span)
            read_micro[r : r + span] = [g] * span
            read_scale[r : r + span] = [scale[g]] * span
            read_weight[r : r + span] = [weight[k]] * span
            cursor, read0 = cursor + n, read0 + span

    device = trajectory.query_responses.device
    layouts = [None] * len(step_slots)
    if segment_attention:  # from the host lists, each micro-step's own slots
        layouts = [SegmentLayout(*(to_device(t, device) for t in segment_layout(
            segments[base : base + n], prefixes[base : base + n] if share else None, row_len=row_len)))
            for base, n in zip(slot_base, step_slots)]
    index = to_device(torch.tensor([token_src, positions, segments, *([prefixes] if share else [])]), device)
    read_index = to_device(torch.tensor([read_pos, read_src, read_token, read_micro]), device)
    read_scale, read_weight = to_device(torch.tensor([read_scale, read_weight], dtype=torch.float32), device)
    index = index.view(len(index), slots // row_len, row_len)
    token_src, positions, segments = index[:3]
    read_pos, read_src, read_token, read_micro = read_index

    flat_tokens = trajectory.query_responses.reshape(-1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [reads]
        return x.reshape(-1)[read_src]

    valid = gather(~trajectory.response_padding_masks)
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
        weights=torch.where(valid, read_weight, 0.0),
        micro_batch_ids=read_micro,
        stat_weights=torch.where(valid, read_scale, 0.0),
        ref_logprobs=gather(trajectory.ref_logprobs),
        prefix_ids=index[3] if share else None,
    )
    # Separate contiguous tensors per micro-step, each starting at offset 0.
    row_splits = [n // row_len for n in step_slots]
    split = [None if t is None else t.split(row_splits if t.dim() == 2 else step_reads)
             for t in packed[:-1]]  # every field but attention
    return [
        PackedMicroStep(*(
            None if parts is None else
            parts[k].clone() if parts[k].dim() == 2 else parts[k].reshape(num_chunks, -1).clone()
            for parts in split
        ), attention=layouts[k])
        for k in range(len(step_slots))
    ]


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory the copy does not wait for the device's queued work.
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def micro_batch_stats(step_stats: Sequence[PPOStats]) -> List[PPOStats]:
    """Per-micro-batch stats of a minibatch from its packed micro-steps' ``[grad_accum]`` stats.

    Returns ``grad_accum`` :class:`~torchtune_ppo.ppo.PPOStats` of 0-dim tensors, each already
    scaled by ``1 / grad_accum``, as the padded micro-batches return them.
    """
    totals = [torch.stack(field).sum(0) for field in zip(*step_stats)]  # each [grad_accum]
    return [PPOStats(*fields) for fields in zip(*(t.unbind() for t in totals))]


class PackedTokens:
    """Token slots the loss step ran on against the real tokens it needed, over a step.

    ``ratio`` (logged as ``loss_step_slots_per_token``) is 1.0 for perfect packing; a padded
    step would run on ``P + T`` slots per row.
    """

    def __init__(self) -> None:
        self.slots = self.real = 0

    def reset(self) -> None:
        self.slots = self.real = 0

    def update(self, steps: Sequence[PackedMicroStep], lengths: SequenceLengths,
               micro_batches: Sequence[Sequence[int]]) -> None:
        """Counts one minibatch's packed micro-steps and the real tokens of its sequences."""
        self.slots += sum(step.tokens.numel() for step in steps)
        self.real += sum(
            lengths.prompt_lens[i] + lengths.spans[i] - 1
            for idxs in micro_batches for i in idxs if lengths.spans[i] > 0
        )  # unshared: with shared prompts the ratio can fall below 1

    @property
    def ratio(self) -> float:
        return self.slots / self.real if self.real else float("nan")
