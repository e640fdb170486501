"""The held-out prompts of the evaluation: which dataset, read and checked before any weights load.

``eval.dataset: null`` means the training dataset's held-out split: the same block with
``field: heldout`` when its JSON data file is an object with a ``heldout`` list (the embedded
arithmetic tasks' ``problems.json`` holds ``train`` and ``heldout``). Every prompt is read and
left-padded once, here; the evaluation then only slices this table (no data loader, so no
draw from any random stream).
"""

import json
from pathlib import Path
from typing import Any, List, NamedTuple, Optional

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_ppo.config.data_files import instantiate_dataset
from torchtune_ppo.data.collate import left_pad_prompts

__all__ = ["HELDOUT_FIELD", "EvalPrompts", "default_eval_dataset", "eval_prompts"]

HELDOUT_FIELD = "heldout"


class EvalPrompts(NamedTuple):
    """Every evaluation prompt, left-padded to its own width ``P``.

    Attributes:
        tokens (torch.Tensor): ``[N, P]`` int64, left-padded.
        prompt_lens (torch.Tensor): ``[N]`` real tokens of each prompt.
        references (List[Optional[str]]): each prompt's reference answer (None where it has none).
        source (str): what they were read from, for the log.
    """

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    references: List[Optional[str]]
    source: str

    @property
    def prompt_len(self) -> int:
        return self.tokens.shape[1]


def default_eval_dataset(dataset: DictConfig) -> Optional[DictConfig]:
    """``dataset`` with ``field: heldout`` when it reads a ``field`` of a local JSON file that has a
    ``heldout`` list; None when it has no such split."""
    if not isinstance(dataset, DictConfig) or dataset.get("field") in (None, HELDOUT_FIELD):
        return None
    files = dataset.get("data_files")
    files = [files] if isinstance(files, str) else list(files) if isinstance(files, ListConfig) else []
    if len(files) != 1 or not Path(str(files[0])).is_file():
        return None
    try:
        data = json.loads(Path(str(files[0])).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get(HELDOUT_FIELD), list) and data[HELDOUT_FIELD]):
        return None
    block = OmegaConf.create(OmegaConf.to_container(dataset, resolve=True))
    block.field = HELDOUT_FIELD
    return block


def eval_prompts(cfg: DictConfig, tokenizer: Any, log) -> EvalPrompts:
    """Reads and checks the evaluation's prompts (``eval.dataset``, or the default above).

    Args:
        cfg (DictConfig): the validated config; ``eval.every_n_steps`` is set.
        tokenizer (Any): the run's tokenizer.
        log: where the note on what is evaluated goes.

    Returns:
        EvalPrompts: the first ``eval.max_prompts`` prompts (all when null), left-padded to
        ``max_prompt_len`` when it is set, else to the longest of them.

    Raises:
        ValueError: naming ``eval.dataset`` when it is null and the dataset has no held-out split,
            when it fails to load or holds an empty prompt, and, under ``long_prompts: error``, a
            prompt longer than ``max_prompt_len``.
    """
    block = cfg.eval.dataset
    if block is None:
        block = default_eval_dataset(cfg.dataset)
        if block is None:
            raise ValueError(
                f"eval.every_n_steps={cfg.eval.every_n_steps} turns evaluation on, but eval.dataset is null and "
                f"dataset ({cfg.dataset.get('_component_')}) has no held-out split to default to (a "
                f"`{HELDOUT_FIELD}` list in its JSON data file, read through `field`). Give eval.dataset, a block "
                "like dataset (e.g. the same builder on held-out data), or set eval.every_n_steps=null.")
    try:
        dataset = instantiate_dataset(block, tokenizer)
    except ValueError as e:
        raise ValueError(f"eval.dataset: {e}") from e
    n = len(dataset) if cfg.eval.max_prompts is None else min(len(dataset), cfg.eval.max_prompts)
    samples = [dataset[i] for i in range(n)]
    empty = [i for i, s in enumerate(samples) if not s["tokens"]]
    if not samples or empty:
        raise ValueError(f"eval.dataset: {'no prompts' if not samples else f'prompt {empty[0]} has 0 tokens'}; "
                         "every evaluation prompt needs at least one token.")
    width = cfg.max_prompt_len or max(len(s["tokens"]) for s in samples)
    long = [i for i, s in enumerate(samples) if len(s["tokens"]) > width]
    if long and cfg.long_prompts == "error":
        raise ValueError(
            f"eval.dataset: {len(long)} of {n} prompts are longer than max_prompt_len={width} (the first: #{long[0]}, "
            f"{len(samples[long[0]]['tokens'])} tokens) and long_prompts='error'; raise max_prompt_len or set "
            "long_prompts=truncate.")
    batch = left_pad_prompts(samples, max_prompt_len=width, pad_id=tokenizer.pad_id, long_prompts=cfg.long_prompts)
    source = f"{block.get('data_files', block.get('source'))}" + (f" ({block.field})" if block.get("field") else "")
    log.info(f"Evaluation: {n} prompts of {source} every {cfg.eval.every_n_steps} steps"
             + (f", {len(long)} of them cut to their last {width} tokens" if long else "") + ".")
    return EvalPrompts(batch["tokens"], batch["prompt_lens"], [s.get("reference") for s in samples], source)
