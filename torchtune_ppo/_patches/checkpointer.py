"""torchtune checkpointer internals (written for torchtune 0.6.1, its last release).

- :func:`set_weight_map`, :func:`weight_map`: ``FullModelHFCheckpointer.save_checkpoint`` splits
  the shards along ``_weight_map`` (HF key -> shard id ``"0001"``, ...), which only
  ``load_checkpoint`` fills; a writer that never loaded gets the map rebuilt from the shard
  headers.
- :func:`hf_checkpointer_settings`: what ``FullModelHFCheckpointer.__init__`` keeps in private
  attributes (the resolved folders and files, the model type, the HF ``config.json``), for the
  classifier checkpointer that subclasses it.
- The file names and helpers ``FullModelHFCheckpointer`` itself uses, from
  ``torchtune.training.checkpointing._utils``, so that what the classifier checkpointer writes
  is laid out exactly as torchtune's checkpoints are.

``tests`` check that each still exists.
"""

from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

from torchtune.training.checkpointing._utils import (  # noqa: F401
    RECIPE_STATE_DIRNAME,
    SAFETENSOR_INDEX_FNAME,
    SHARD_FNAME,
    SUFFIXES_TO_NOT_COPY,
    TORCH_INDEX_FNAME,
    FormattedCheckpointFiles,
    copy_files,
    safe_torch_load,
)

TESTED_WITH = "torchtune 0.6.1"


def set_weight_map(writer: Any, weight_map: Mapping[str, str]) -> None:
    """Gives a ``FullModelHFCheckpointer`` that has not loaded the shard map it saves along."""
    writer._weight_map = dict(weight_map)


def weight_map(checkpointer: Any) -> Dict[str, str]:
    """The shard map a ``FullModelHFCheckpointer`` saves along ({} before any load)."""
    return dict(getattr(checkpointer, "_weight_map", None) or {})


class HFCheckpointerSettings(NamedTuple):
    """A ``FullModelHFCheckpointer``'s settings after ``__init__`` resolved them.

    Attributes:
        checkpoint_dir (Path): the folder it reads.
        checkpoint_paths (List[Path]): the files it reads, sorted as it loads them.
        output_dir (Path): where it writes.
        model_type (Any): a ``torchtune.training.ModelType``.
        config (Mapping[str, Any]): the checkpoint's HF ``config.json``.
        safe_serialization (bool): writes ``.safetensors`` rather than ``.bin``.
        should_load_recipe_state (bool): loads ``recipe_checkpoint`` too.
        recipe_checkpoint (Optional[Path]): the recipe state's file.
    """

    checkpoint_dir: Path
    checkpoint_paths: List[Path]
    output_dir: Path
    model_type: Any
    config: Mapping[str, Any]
    safe_serialization: bool
    should_load_recipe_state: bool
    recipe_checkpoint: Optional[Path]


def hf_checkpointer_settings(checkpointer: Any) -> HFCheckpointerSettings:
    """Reads the private attributes in which ``FullModelHFCheckpointer`` keeps its settings."""
    c = checkpointer
    return HFCheckpointerSettings(
        Path(c._checkpoint_dir), [Path(p) for p in c._checkpoint_paths], Path(c._output_dir), c._model_type,
        c._config, c._safe_serialization, c._should_load_recipe_state, c._recipe_checkpoint,
    )
