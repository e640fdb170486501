"""Packed rows' attention by sequence: the host side of :class:`SegmentLayout`.

A packed row of ``L`` slots holding several sequences attends through a block-diagonal causal
mask (:func:`~torchtune_ppo.rlhf.sequence_processing.block_causal_masks`): ``L * L`` scores a
row, of which each sequence keeps its own triangle and its prefix's columns. With a shared
prompt prefix the rows are 4x a sequence's length, and with long answers (a few hundred slots a
row) that attention outgrows the matrix products of the layers. :func:`segment_layout` turns
the packed rows' segment ids into one block per sequence: its queries, then its prefix's slots
and its own as keys, padded to the longest; the layers then compute ``S * Lq * Lk`` scores.
Built on the host from the same lists the packers place, before the index tensors go to the
device.
"""

from typing import List, Mapping, Optional, Sequence

import torch
from torch import nn

from torchtune_ppo._patches.torchtune_modules import SegmentLayout, accepts_segment_layouts

# No dimension of size 1 (dynamo specialises it), as packing's MIN_SIZE.
_MIN_SIZE = 2


def segment_layout(
    segment_ids: Sequence[int],
    prefix_ids: Optional[Sequence[int]],
    *,
    row_len: int,
) -> SegmentLayout:
    """The :class:`SegmentLayout` of packed rows, from their flat host lists.

    Args:
        segment_ids (Sequence[int]): ``R * L`` slots' segment ids, row after row: equal within a
            sequence, in order; negative for unused slots (one-token segments).
        prefix_ids (Optional[Sequence[int]]): per slot, the segment it may also attend (a shared
            prompt copy, placed before it in the row); its own id or None for none.
        row_len (int): ``L``.

    Returns:
        SegmentLayout: host tensors (the caller moves them with the packed step's); ``S``
        sequences (at least 2; padded ones are all slot 0), ``Lq`` their longest, ``Lk`` the
        longest prefix plus ``Lq``.

    Raises:
        ValueError: if the slots are not whole rows of ``row_len``, or if a prefix is not a
            used segment placed before the slots that name it.
    """
    n = len(segment_ids)
    if row_len < 1 or n % row_len:
        raise ValueError(f"segment_layout: {n} slots are not whole rows of row_len={row_len}")
    prefix_ids = segment_ids if prefix_ids is None else prefix_ids
    slots: dict = {}  # segment id -> its slots, in order
    prefix_of: dict = {}
    for i, (g, p) in enumerate(zip(segment_ids, prefix_ids)):
        if g < 0:
            continue
        slots.setdefault(g, []).append(i)
        if p != g:
            if p not in slots or slots[p][-1] > i:
                raise ValueError(f"segment_layout: slot {i} (segment {g}) names prefix {p}, which is not "
                                 "a used segment before it")
            prefix_of[g] = p
    ids = list(slots)
    lq = max([_MIN_SIZE, *(len(slots[g]) for g in ids)])
    lp = max([0, *(len(slots[p]) for p in prefix_of.values())])
    lk = lp + lq
    count = max(len(ids), _MIN_SIZE)
    q_index: List[List[int]] = [[0] * lq for _ in range(count)]
    kv_index: List[List[int]] = [[0] * lk for _ in range(count)]
    q_lens, p_lens, out_index = [0] * count, [0] * count, [0] * n
    for row, g in enumerate(ids):
        own = slots[g]
        q_index[row][: len(own)] = own
        kv_index[row][lp : lp + len(own)] = own
        q_lens[row] = len(own)
        if g in prefix_of:
            pre = slots[prefix_of[g]]
            kv_index[row][: len(pre)] = pre
            p_lens[row] = len(pre)
        for t, slot in enumerate(own):
            out_index[slot] = row * lq + t
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    own_keys = (j >= lp) & (j - lp <= i)  # [Lq, Lk]: causal within the sequence
    q_lens_t, p_lens_t = torch.tensor(q_lens)[:, None, None], torch.tensor(p_lens)[:, None, None]
    mask = (j[None] < p_lens_t) | own_keys[None]  # [S, Lq, Lk]
    mask = torch.where(i[None] < q_lens_t, mask, j[None] == 0)  # padded queries: column 0
    return SegmentLayout(
        q_index=torch.tensor(q_index),
        kv_index=torch.tensor(kv_index),
        mask=mask,
        out_index=torch.tensor(out_index).view(-1, row_len),
    )


def check_segment_models(owner: str, enabled: bool, models: Mapping[str, Optional[nn.Module]]) -> None:
    """Raises ValueError naming each model of ``models`` (None: absent) that would get a
    :class:`SegmentLayout` as its mask but does not take one, when ``enabled``."""
    if not enabled:
        return
    bad = [name for name, m in models.items() if m is not None and not accepts_segment_layouts(m)]
    if bad:
        raise ValueError(
            f"{owner}: segment_attention=True, but the {', '.join(bad)} model(s) do not take a SegmentLayout "
            "as their attention mask: prepare them with torchtune_ppo._patches.torchtune_modules."
            "use_segment_attention(model) (the recipe's builder does), or set segment_attention=False."
        )
