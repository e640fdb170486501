"""The prompt loader of a run: each rank's share of every batch, left-padded to ``P``."""

from functools import partial
from typing import Any, Tuple

from torch.utils.data import DataLoader, DistributedSampler

from torchtune_ppo import distributed
from torchtune_ppo.data.collate import left_pad_prompts


def prompt_loader(
    dataset: Any, *, batch_size: int, shuffle: bool, seed: int, max_prompt_len: int, pad_id: int,
    long_prompts: str,
) -> Tuple[DistributedSampler, DataLoader]:
    """A sampler and loader of ``batch_size // W`` prompts per batch for this rank.

    The ``W`` ranks' batches together are one global batch of ``batch_size`` prompts; an
    incomplete last batch is dropped. Batches are :func:`left_pad_prompts`' dicts.

    Args:
        dataset (Any): a map-style dataset of ``{"tokens": [...], ...}`` samples.
        batch_size (int): global prompts per step.
        shuffle (bool): reshuffle every epoch (``sampler.set_epoch``).
        seed (int): the shuffle's seed, the same on every rank.
        max_prompt_len (int): ``P``.
        pad_id (int): left padding.
        long_prompts (str): ``"truncate"`` or ``"error"``.

    Returns:
        Tuple[DistributedSampler, DataLoader]: the sampler (to set the epoch) and the loader.
    """
    world = distributed.world_size()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=distributed.rank(), shuffle=shuffle, seed=seed)
    collate = partial(left_pad_prompts, max_prompt_len=max_prompt_len, pad_id=pad_id, long_prompts=long_prompts)
    loader = DataLoader(dataset, batch_size=batch_size // world, sampler=sampler, drop_last=True, collate_fn=collate)
    return sampler, loader
