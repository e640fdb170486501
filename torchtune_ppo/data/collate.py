"""Prompt batching: every batch left-padded to the same ``max_prompt_len``."""

from typing import Any, Dict, List

import torch


def left_pad_prompts(
    batch: List[Dict[str, Any]], *, max_prompt_len: int, pad_id: int, long_prompts: str = "truncate"
) -> Dict[str, torch.Tensor]:
    """Collate tokenized prompts into a fixed ``[b, max_prompt_len]`` left-padded tensor.

    A fixed width keeps every compiled region at one shape. Prompts longer than
    ``max_prompt_len`` keep their last ``max_prompt_len`` tokens (the ones next to the
    response) when ``long_prompts="truncate"``, and raise with ``"error"``.

    Args:
        batch (List[Dict[str, Any]]): samples with a ``"tokens"`` list of ids.
        max_prompt_len (int): the prompt width ``P``.
        pad_id (int): padding id.
        long_prompts (str): ``"truncate"`` or ``"error"``.

    Returns:
        Dict[str, torch.Tensor]: ``"tokens"`` int64 ``[b, P]``; ``"prompt_lens"`` int64 ``[b]``,
        the real tokens of each row (padding is told by length, never by token value: the
        pad id can be a real token); ``"num_truncated"``, the number of prompts that were
        cut, as a 0-dim tensor; and ``"references"``, a list of each sample's ``"reference"``
        (None where it has none), when any sample has one.

    Raises:
        ValueError: a prompt is longer than ``max_prompt_len`` and ``long_prompts="error"``.
    """
    tokens = torch.full((len(batch), max_prompt_len), pad_id, dtype=torch.long)
    prompt_lens = torch.zeros(len(batch), dtype=torch.long)
    num_truncated = 0
    for i, sample in enumerate(batch):
        ids = list(sample["tokens"])
        if len(ids) > max_prompt_len:
            if long_prompts == "error":
                raise ValueError(
                    f"a prompt has {len(ids)} tokens, more than max_prompt_len={max_prompt_len}; "
                    "raise max_prompt_len or set long_prompts=truncate."
                )
            ids = ids[-max_prompt_len:]
            num_truncated += 1
        if ids:
            tokens[i, max_prompt_len - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_lens[i] = len(ids)
    out = {"tokens": tokens, "prompt_lens": prompt_lens, "num_truncated": torch.tensor(num_truncated)}
    if any("reference" in sample for sample in batch):  # for a function reward
        out["references"] = [sample.get("reference") for sample in batch]
    return out
