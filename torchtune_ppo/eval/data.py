"""The held-out prompts of the evaluation: which datasets, read and checked before any weights load.

``eval.dataset: null`` means the training dataset's held-out split: the same block with
``field: heldout`` when its JSON data file is an object with a ``heldout`` list (the embedded
arithmetic tasks' ``problems.json`` holds ``train`` and ``heldout``). ``eval.datasets`` names
several sets, evaluated side by side (a null block there is that same held-out split). Every
prompt is read and left-padded once, here, every set to one width; the evaluation then only
slices these tables (no data loader, so no draw from any random stream).
"""

import json
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config as tt_config

from torchtune_ppo.config.data_files import instantiate_dataset
from torchtune_ppo.data.collate import left_pad_prompts

__all__ = ["HELDOUT_FIELD", "EvalPrompts", "check_eval_length", "default_eval_dataset", "eval_blocks",
           "eval_prompts"]

HELDOUT_FIELD = "heldout"


class EvalPrompts(NamedTuple):
    """Every evaluation prompt, left-padded to its own width ``P``.

    Attributes:
        tokens (torch.Tensor): ``[N, P]`` int64, left-padded.
        prompt_lens (torch.Tensor): ``[N]`` real tokens of each prompt.
        references (List[Optional[str]]): each prompt's reference answer (None where it has none).
        source (str): what they were read from, for the log.
        name (Optional[str]): the set's name in ``eval.datasets``, which its metrics carry
            (``val/<name>/...``); None for the one set of ``eval.dataset`` (``val/...``).
    """

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    references: List[Optional[str]]
    source: str
    name: Optional[str] = None

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


def eval_blocks(cfg: DictConfig) -> Dict[Optional[str], DictConfig]:
    """The evaluation's dataset blocks by set name: ``{None: block}`` for ``eval.dataset`` (or its
    default), ``{name: block, ...}`` for ``eval.datasets``, in the config's order.

    Raises:
        ValueError: naming the key, when a block is null and the dataset has no held-out split.
    """
    named = cfg.eval.get("datasets")
    given = {None: cfg.eval.dataset} if named is None else {str(k): v for k, v in named.items()}
    blocks = {}
    for name, block in given.items():
        if block is None:
            block = default_eval_dataset(cfg.dataset)
        if block is None:
            key = "eval.dataset" if name is None else f"eval.datasets.{name}"
            raise ValueError(
                f"eval.every_n_steps={cfg.eval.every_n_steps} turns evaluation on, but {key} is null and "
                f"dataset ({cfg.dataset.get('_component_')}) has no held-out split to default to (a "
                f"`{HELDOUT_FIELD}` list in its JSON data file, read through `field`). Give {key}, a block "
                "like dataset (e.g. the same builder on held-out data), or set eval.every_n_steps=null.")
        blocks[name] = block
    return blocks


def eval_prompts(cfg: DictConfig, tokenizer: Any, log) -> Tuple[EvalPrompts, ...]:
    """Reads and checks the evaluation's prompts (``eval.dataset`` or ``eval.datasets``, or the
    default held-out split).

    Args:
        cfg (DictConfig): the validated config; ``eval.every_n_steps`` is set.
        tokenizer (Any): the run's tokenizer.
        log: where the note on what is evaluated goes.

    Returns:
        Tuple[EvalPrompts, ...]: one per set (one for ``eval.dataset``), each the first
        ``eval.max_prompts`` prompts of its dataset (all when null), every set left-padded to
        one width: ``max_prompt_len`` when it is set, else the longest prompt of them all.

    Raises:
        ValueError: naming the key (``eval.dataset``, ``eval.datasets.<name>``) when it is null and
            the dataset has no held-out split, when it fails to load or holds an empty prompt,
            and, under ``long_prompts: error``, a prompt longer than ``max_prompt_len``; naming
            ``eval.max_generated_tokens`` when the width and the response do not fit a model's
            ``max_seq_len`` (:func:`check_eval_length`).
    """
    read = {}
    for name, block in eval_blocks(cfg).items():
        key = "eval.dataset" if name is None else f"eval.datasets.{name}"
        try:
            dataset = instantiate_dataset(block, tokenizer)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from e
        n = len(dataset) if cfg.eval.max_prompts is None else min(len(dataset), cfg.eval.max_prompts)
        samples = [dataset[i] for i in range(n)]
        empty = [i for i, s in enumerate(samples) if not s["tokens"]]
        if not samples or empty:
            raise ValueError(f"{key}: {'no prompts' if not samples else f'prompt {empty[0]} has 0 tokens'}; "
                             "every evaluation prompt needs at least one token.")
        read[name] = (key, block, samples)
    widest = {key: max(len(s["tokens"]) for s in samples) for key, _, samples in read.values()}
    width = cfg.max_prompt_len or max(widest.values())
    check_eval_length(cfg, width, None if cfg.max_prompt_len else max(widest, key=widest.get))
    out = []
    for name, (key, block, samples) in read.items():
        n = len(samples)
        long = [i for i, s in enumerate(samples) if len(s["tokens"]) > width]
        if long and cfg.long_prompts == "error":
            raise ValueError(
                f"{key}: {len(long)} of {n} prompts are longer than max_prompt_len={width} (the first: #{long[0]}, "
                f"{len(samples[long[0]]['tokens'])} tokens) and long_prompts='error'; raise max_prompt_len or set "
                "long_prompts=truncate.")
        batch = left_pad_prompts(samples, max_prompt_len=width, pad_id=tokenizer.pad_id,
                                 long_prompts=cfg.long_prompts)
        source = f"{block.get('data_files', block.get('source'))}" + (f" ({block.field})" if block.get("field") else "")
        log.info(f"Evaluation{'' if name is None else f' {name!r}'}: {n} prompts of {source} every "
                 f"{cfg.eval.every_n_steps} steps"
                 + (f", {len(long)} of them cut to their last {width} tokens" if long else "") + ".")
        out.append(EvalPrompts(batch["tokens"], batch["prompt_lens"], [s.get("reference") for s in samples],
                               source, name))
    return tuple(out)


def check_eval_length(cfg: DictConfig, width: int, widest: Optional[str] = None) -> None:
    """The evaluation's prompt width plus its response tokens must fit the ``max_seq_len`` of every
    model it runs: the policy, and the reward model when that scores the responses.

    Args:
        cfg (DictConfig): the validated config.
        width (int): ``P`` of the evaluation's prompts (``max_prompt_len``, or their longest).
        widest (Optional[str]): the key of the set holding the longest prompt, when ``width`` is that.

    Raises:
        ValueError: naming the keys and the numbers.
    """
    T = cfg.eval.max_generated_tokens or cfg.max_generated_tokens
    keys = ["policy_model"]
    if cfg.eval.reward is None and cfg.reward is None and cfg.reward_and_value_model is not None:
        keys.append("reward_and_value_model")
    for key in keys:
        with torch.device("meta"):
            limit = getattr(tt_config.instantiate(cfg[key]), "max_seq_len", None)
        if limit is not None and width + T > limit:
            given = (f"max_prompt_len={width}" if widest is None
                     else f"the longest evaluation prompt ({width} tokens, {widest})")
            raise ValueError(
                f"{given} + eval.max_generated_tokens={T}"
                f"{'' if cfg.eval.max_generated_tokens else ' (null: max_generated_tokens)'} = {width + T} exceeds "
                f"{key}.max_seq_len ({limit}); lower eval.max_generated_tokens, or set max_prompt_len (with "
                "long_prompts=truncate each prompt keeps its last tokens).")
