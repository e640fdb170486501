"""Prompts in: datasets that keep each prompt's reference answer, and the left-padding collator."""

from torchtune_ppo.data.collate import left_pad_prompts  # noqa: F401
from torchtune_ppo.data.datasets import PromptDataset, collate_references, prompt_dataset  # noqa: F401
from torchtune_ppo.data.loader import prompt_loader  # noqa: F401

__all__ = ["PromptDataset", "collate_references", "left_pad_prompts", "prompt_dataset", "prompt_loader"]
