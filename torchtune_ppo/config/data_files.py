"""The dataset, read once before any weights load: errors that point at the data file.

``instantiate_dataset`` builds ``cfg.dataset`` and turns a failure inside the ``datasets``
library into one that names the file (and, for JSON, the line and column) or the missing
column; ``validate_dataset`` reads every prompt once and checks its length.
"""

import inspect
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, ListConfig
from torchtune import config as tt_config

from torchtune_ppo.config.components import import_component

# How many over-long prompts an error lists by index; the count covers all of them.
_LISTED_PROMPTS = 5


def instantiate_dataset(cfg_dataset: DictConfig, tokenizer: Any) -> Any:
    """Build ``cfg.dataset`` with errors that point at the data, not into ``datasets``.

    A malformed data file fails inside the ``datasets`` library with a message that names
    neither the file nor, for JSON, the line; a wrong ``column`` only fails when the first
    sample is read, at step 1.

    Args:
        cfg_dataset (DictConfig): the ``dataset`` block of the config.
        tokenizer (Any): passed to the dataset builder.

    Returns:
        Any: the dataset, as ``torchtune.config.instantiate`` returns it.

    Raises:
        ValueError: naming the file and the position of a parse error (line and column for
            JSON, or what the underlying error says), naming a file that holds no rows (empty,
            ``[]``, a CSV header alone) and the format expected, or naming a missing column
            and the columns that exist.
    """
    try:
        dataset = tt_config.instantiate(cfg_dataset, tokenizer=tokenizer)
    except Exception as e:
        # An empty file stops `datasets` with a bare StopIteration, `[]` with "... corresponds
        # to no data!", an empty CSV with pandas' EmptyDataError: none names the file.
        if _is_no_data_error(e) or _files_without_rows(cfg_dataset):
            raise ValueError(_no_rows_message(cfg_dataset)) from e
        if not _is_data_error(e):
            raise
        files = _data_files(cfg_dataset)
        for path in files:
            where = _json_error(path)
            if where is not None:
                raise ValueError(
                    f"dataset.data_files: {str(path)!r} is not valid JSON: {where}. A JSON data "
                    "file holds a list of objects, or one object per line (JSON Lines)."
                ) from e
        root = _root_cause(e)
        named = [str(p) for p in files] or cfg_dataset.get("data_files")
        named = named or cfg_dataset.get("source")
        raise ValueError(
            f"dataset: loading {named!r} failed: {type(root).__name__}: {root}"
        ) from e
    _check_columns(cfg_dataset, dataset)
    return dataset


def validate_dataset(dataset: Any, cfg: DictConfig) -> int:
    """Read every prompt once and check its length against ``max_prompt_len``.

    Args:
        dataset (Any): the tokenized dataset; each sample is a dict with ``"tokens"``.
        cfg (DictConfig): the config returned by ``validate_config``.

    Returns:
        int: how many prompts are longer than ``max_prompt_len`` and will be truncated
        (``long_prompts: truncate``; under ``error`` it is always 0).

    Raises:
        ValueError: when the dataset holds fewer prompts than ``batch_size``, a prompt has no
            tokens, a sample cannot be read (e.g. a missing column), or, under
            ``long_prompts: error``, any prompt is too long.
    """
    limit = cfg.max_prompt_len if cfg.max_prompt_len is not None else math.inf
    size = len(dataset)
    if size < cfg.batch_size:
        raise ValueError(
            f"dataset has {size} prompts, fewer than batch_size ({cfg.batch_size}); lower "
            "batch_size or add prompts."
        )
    too_long: List[Tuple[int, int]] = []
    for i in range(size):
        try:
            sample = dataset[i]
        except KeyError as e:
            raise ValueError(
                f"dataset: sample {i} has no column {e.args[0]!r}{_columns_hint(dataset)}; "
                "check dataset.column (or dataset.column_map)."
            ) from e
        n = len(sample["tokens"])
        if n == 0:
            raise ValueError(
                f"dataset: prompt {i} has 0 tokens; every prompt needs at least one token to "
                "generate from. Remove it from the data (or use a dataset filter_fn)."
            )
        if n > limit:
            too_long.append((i, n))
    if too_long and cfg.long_prompts == "error":
        listed = ", ".join(f"#{i} ({n} tokens)" for i, n in too_long[:_LISTED_PROMPTS])
        more = ", ..." if len(too_long) > _LISTED_PROMPTS else ""
        longest = max(n for _, n in too_long)
        raise ValueError(
            f"long_prompts='error': {len(too_long)} of {size} prompts are longer than "
            f"max_prompt_len={limit} tokens: {listed}{more}; the longest has {longest}. Raise "
            f"max_prompt_len to {longest} (max_prompt_len + max_generated_tokens must stay "
            "within the models' max_seq_len), or set long_prompts=truncate to keep each "
            f"prompt's last {limit} tokens."
        )
    return len(too_long)


def _is_data_error(error: BaseException) -> bool:
    """Whether the ``datasets`` library failed to read the data (not a config typo)."""
    try:
        from datasets.exceptions import DatasetsError
    except ImportError:  # pragma: no cover - torchtune depends on datasets
        return False
    seen = error
    while seen is not None:
        if isinstance(seen, DatasetsError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_no_data_error(error: BaseException) -> bool:
    """Whether ``datasets`` failed because the data holds no rows.

    An empty JSON file stops its reader with a bare ``StopIteration``; a JSON file holding
    ``[]`` (or a CSV header alone) with ``Instruction "train" corresponds to no data!``.
    """
    seen = error
    while seen is not None:
        if isinstance(seen, StopIteration) or "corresponds to no data" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _no_rows_message(cfg_dataset: DictConfig) -> str:
    """What to say when the data holds no rows: the file(s) that hold none, and the format."""
    empty = _files_without_rows(cfg_dataset)
    if empty:
        path, why = empty[0]
        return (f"dataset.data_files: {str(path)!r} holds no rows ({why}). "
                f"{_expected_format(path, cfg_dataset.get('source'), cfg_dataset.get('field'))}")
    named = [str(p) for p in _data_files(cfg_dataset)] or cfg_dataset.get("data_files") or cfg_dataset.get("source")
    split = cfg_dataset.get("split", "train")
    return (f"dataset: {named!r} holds no rows for split {split!r}. Check the data files, "
            "dataset.split and dataset.field; each row is one prompt.")


def _files_without_rows(cfg_dataset: DictConfig) -> List[Tuple[Path, str]]:
    """The local data files that hold no rows, each with how (read only on an error path)."""
    field = cfg_dataset.get("field")
    return [(path, why) for path in _data_files(cfg_dataset) for why in [_why_no_rows(path, field)]
            if why is not None]


def _why_no_rows(path: Path, field: Any) -> Optional[str]:
    """How a local data file holds no rows (``"the file is empty"``, ...), or None if it holds
    some or cannot tell."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            return "a parquet file of 0 rows" if pq.ParquetFile(path).metadata.num_rows == 0 else None
        except Exception:  # noqa: BLE001 - not readable as parquet: its own error says why
            return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return "the file is empty" if not text else "only whitespace"
    if path.suffix in (".csv", ".tsv"):
        return "only a header line" if len(lines) == 1 else None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # JSON Lines with a line in it, or not JSON: rows, or another error
    if isinstance(value, dict) and isinstance(field, str):
        inner = value.get(field)
        if inner is None:
            return f"no field {field!r} (dataset.field); its fields are {sorted(value)}"
        return f"an empty list under its field {field!r}, dataset.field" if inner == [] else None
    if value == []:
        return "an empty JSON list, []"
    if value == {}:
        return "an empty JSON object, {}"
    return None


def _expected_format(path: Path, source: Any, field: Any) -> str:
    kind = path.suffix.lstrip(".") or str(source)
    if kind in ("csv", "tsv"):
        return "A CSV data file holds a header line naming the columns, then one line per prompt."
    if kind == "parquet":
        return "A parquet data file holds one row per prompt."
    if kind in ("json", "jsonl"):
        rows = '[{"prompt": "..."}, ...]'
        if isinstance(field, str):
            return (f"A JSON data file holds a list of objects, one per prompt, under dataset.field "
                    f"({{{field!r}: {rows}}}).").replace("'", '"')
        return (f"A JSON data file holds a list of objects, one per prompt ({rows}), or one object "
                "per line (JSON Lines).")
    return "Each row of the data is one prompt."


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error


def _data_files(cfg_dataset: DictConfig) -> List[Path]:
    """Local files named in ``data_files`` (a path, a list, or a split -> path(s) mapping)."""
    files = cfg_dataset.get("data_files")
    if isinstance(files, DictConfig):
        files = [f for v in files.values() for f in (v if isinstance(v, ListConfig) else [v])]
    elif isinstance(files, str):
        files = [files]
    elif not isinstance(files, ListConfig):
        return []
    return [Path(f) for f in files if isinstance(f, str) and Path(f).is_file()]


def _json_error(path: Path) -> Optional[str]:
    """Where a JSON or JSON Lines file stops parsing, or None if it parses (or is not JSON)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.lstrip().startswith(("[", "{")):
        return None  # not JSON (e.g. CSV or parquet): leave it to the underlying message
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        whole_error = whole
    lines = text.splitlines()
    filled = [i for i, line in enumerate(lines) if line.strip()]
    # JSON Lines when the first line is a whole value on its own and more lines follow.
    if len(filled) > 1 and _parses(lines[filled[0]]):
        for i in filled:
            try:
                json.loads(lines[i])
            except json.JSONDecodeError as e:
                return f"line {i + 1}, column {e.colno}: {e.msg} (read as JSON Lines)"
        return None
    e = whole_error
    return f"line {e.lineno}, column {e.colno} (character {e.pos}): {e.msg}"


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def _column_names(dataset: Any) -> Optional[List[str]]:
    # torchtune's dataset classes keep the Hugging Face dataset in `_data`.
    names = getattr(getattr(dataset, "_data", None), "column_names", None)
    return list(names) if isinstance(names, (list, tuple)) else None


def _columns_hint(dataset: Any) -> str:
    names = _column_names(dataset)
    return f" (its columns are {names})" if names is not None else ""


def _check_columns(cfg_dataset: DictConfig, dataset: Any) -> None:
    names = _column_names(dataset)
    if names is None:
        return
    wanted: Dict[str, Any] = {}
    if "column" in cfg_dataset:
        wanted["dataset.column"] = cfg_dataset.column
    elif "_component_" in cfg_dataset:
        # Left out, `column` takes the builder's default ("text" for text_completion_dataset).
        builder = import_component(cfg_dataset._component_, "dataset._component_")
        try:
            param = inspect.signature(builder).parameters.get("column")
        except (TypeError, ValueError):  # a builtin without a signature: nothing to read
            param = None
        if param is not None and isinstance(param.default, str):
            wanted["dataset.column (default)"] = param.default
    column_map = cfg_dataset.get("column_map")
    if isinstance(column_map, DictConfig):
        wanted.update({f"dataset.column_map.{k}": v for k, v in column_map.items()})
    for key, column in wanted.items():
        if column not in names:
            raise ValueError(
                f"{key}: {column!r} is not a column of the data; its columns are {names}. "
                "Set it to one of them."
            )
