"""Prompt datasets that carry each prompt's reference answer, for function rewards.

torchtune's ``text_completion_dataset`` keeps only tokens: a verifiable reward also needs the
answer each prompt should lead to. :func:`prompt_dataset` keeps it next to the tokens, and
:func:`collate_references` gathers a batch's references in row order.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from datasets import load_dataset
from torch.utils.data import Dataset

from torchtune_ppo.models import render_chat_prompt

__all__ = ["PromptDataset", "collate_references", "prompt_dataset"]


class PromptDataset(Dataset):
    """Tokenized prompts with their reference answers; see :func:`prompt_dataset`.

    The Hugging Face dataset is kept in ``_data``, where torchtune's datasets keep theirs, so
    code that reads ``_data.column_names`` works with both.
    """

    def __init__(
        self,
        tokenizer: Any,
        source: str,
        column: str = "prompt",
        reference_column: Optional[str] = "answer",
        add_bos: bool = True,
        filter_fn: Optional[Callable] = None,
        chat: bool = False,
        system_prompt: Optional[str] = None,
        response_prefix: Optional[str] = None,
        system_column: Optional[str] = None,
        prefix_column: Optional[str] = None,
        **load_dataset_kwargs: Any,
    ) -> None:
        for key, value in (("system_prompt", system_prompt), ("response_prefix", response_prefix),
                           ("system_column", system_column), ("prefix_column", prefix_column)):
            if value is not None and not chat:
                raise ValueError(f"prompt_dataset: {key} is used only with chat=True; set chat=True "
                                 f"or remove {key}.")
        self._tokenizer, self._chat, self._system_prompt = tokenizer, chat, system_prompt
        # The start of the assistant's reply, after its header: the response continues it.
        self._prefix = self._encode_prefix(response_prefix)
        self._data = load_dataset(source, **load_dataset_kwargs)
        if filter_fn is not None:
            self._data = self._data.filter(filter_fn)
        names = list(self._data.column_names)
        for key, name in (("column", column), ("reference_column", reference_column),
                          ("system_column", system_column), ("prefix_column", prefix_column)):
            if name is not None and name not in names:
                raise ValueError(
                    f"prompt_dataset: {key}={name!r} is not a column of {source!r} "
                    f"{load_dataset_kwargs.get('data_files', '')}; its columns are {names}."
                )
        self._column, self._reference_column, self._add_bos = column, reference_column, add_bos
        self._system_column, self._prefix_column = system_column, prefix_column

    def _encode_prefix(self, prefix: Optional[str]) -> List[int]:
        return [] if not prefix else self._tokenizer.encode(prefix, add_bos=False, add_eos=False)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = self._data[index]
        # No EOS: the prompt is to be continued. No truncation either: the recipe's collator
        # keeps the end of an over-long prompt (the part next to the response), or raises.
        if self._chat:  # a user turn, then the assistant header: what instruct models expect
            # A row's own system line or reply prefix, where it has one (null: the block's).
            system = None if self._system_column is None else sample[self._system_column]
            prefix = None if self._prefix_column is None else sample[self._prefix_column]
            tokens = render_chat_prompt(self._tokenizer, [{"role": "user", "content": sample[self._column]}],
                                        system=self._system_prompt if system is None else system)
            tokens += self._prefix if prefix is None else self._encode_prefix(prefix)
        else:
            tokens = self._tokenizer.encode(sample[self._column], add_bos=self._add_bos, add_eos=False)
        reference = None if self._reference_column is None else sample[self._reference_column]
        # JSON numbers arrive as int or float; reward functions compare text.
        return {"tokens": tokens, "reference": None if reference is None else str(reference)}


def prompt_dataset(
    tokenizer: Any,
    source: str,
    column: str = "prompt",
    reference_column: Optional[str] = "answer",
    split: str = "train",
    add_bos: bool = True,
    filter_fn: Optional[Callable] = None,
    chat: bool = False,
    system_prompt: Optional[str] = None,
    response_prefix: Optional[str] = None,
    system_column: Optional[str] = None,
    prefix_column: Optional[str] = None,
    **load_dataset_kwargs: Any,
) -> PromptDataset:
    """Prompts to complete, each with its reference answer, from any ``datasets`` source.

    Config example (a local JSON file whose records are ``{"prompt": ..., "answer": ...}``)::

        dataset:
          _component_: torchtune_ppo.data.prompt_dataset
          source: json
          data_files: ${ppo_asset:tiny_arithmetic/problems.json}
          field: train          # records under this key of the JSON object
          column: prompt
          reference_column: answer

    Args:
        tokenizer (Any): has ``encode(text, add_bos=..., add_eos=...) -> List[int]``.
        source (str): ``datasets.load_dataset``'s path: a Hub name, or a file type such as
            ``"json"`` / ``"csv"`` / ``"parquet"`` with ``data_files``.
        column (str): the prompt text column. Default: ``"prompt"``
        reference_column (Optional[str]): the reference answer column; None for a dataset
            without answers (every reference is then None). Default: ``"answer"``
        split (str): ``load_dataset``'s split, e.g. ``"train"`` or ``"train[:10%]"``.
        add_bos (bool): prepend the tokenizer's BOS (plain prompts only). Default: True
        filter_fn (Optional[Callable]): keep the rows (dicts of columns) for which it is True.
        chat (bool): render each prompt as a user turn through the tokenizer's chat template,
            ending in the assistant header (:func:`torchtune_ppo.models.render_chat_prompt`),
            the format instruct models were trained on. Default: False
        system_prompt (Optional[str]): a system turn before it (chat only); None: the
            template's own default, if it has one. Default: None
        response_prefix (Optional[str]): text that opens the assistant's reply (chat only),
            e.g. ``"The answer is"``: the response continues it. Default: None
        system_column (Optional[str]): a column holding each row's own system prompt (chat
            only); a row whose value is null gets ``system_prompt``. Default: None
        prefix_column (Optional[str]): a column holding each row's own reply prefix (chat only);
            a row whose value is null gets ``response_prefix``, an empty string none. Default: None
        **load_dataset_kwargs (Any): passed to ``load_dataset`` (``data_files``, ``field``, ...).

    Returns:
        PromptDataset: samples ``{"tokens": List[int], "reference": Optional[str]}``; tokens
        never end in EOS. References are the column's values as text.

    Raises:
        ValueError: ``column``, ``reference_column``, ``system_column`` or ``prefix_column`` is
            not a column of the data (the message lists the columns); a chat-only key without
            ``chat=True``.
    """
    return PromptDataset(tokenizer, source, column=column, reference_column=reference_column,
                         add_bos=add_bos, filter_fn=filter_fn, chat=chat, system_prompt=system_prompt,
                         response_prefix=response_prefix, system_column=system_column,
                         prefix_column=prefix_column, split=split, **load_dataset_kwargs)


def collate_references(batch: Sequence[Mapping[str, Any]]) -> List[Optional[str]]:
    """The references of a batch of samples, in row order (None where a sample has none).

    Args:
        batch (Sequence[Mapping[str, Any]]): samples as the dataset returns them.

    Returns:
        List[Optional[str]]: ``[b]`` references, aligned with the rows of
        :func:`torchtune_ppo.data.left_pad_prompts` on the same batch.
    """
    return [sample.get("reference") for sample in batch]
