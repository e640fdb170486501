"""torchtune checkpointer internals (written for torchtune 0.6.1, its last release).

- :func:`set_weight_map`: ``FullModelHFCheckpointer.save_checkpoint`` splits the shards along
  ``_weight_map`` (HF key -> shard id ``"0001"``, ...), which only ``load_checkpoint`` fills; a
  writer that never loaded gets the map rebuilt from the shard headers.
- The file names and helpers ``FullModelHFCheckpointer`` itself uses, from
  ``torchtune.training.checkpointing._utils``, so that what the classifier checkpointer writes
  is laid out exactly as torchtune's checkpoints are.

``tests`` check that each still exists.
"""

from typing import Any, Mapping

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
