"""Checkpoints of a PPO run: the atomic store of step folders (:mod:`.store`) and the training
state in them, saved and restored by :class:`CheckpointClient` (:mod:`.training_state`)."""

from torchtune_ppo.checkpointing.store import (  # noqa: F401
    CHECKPOINTS_DIRNAME,
    MARKER_FNAME,
    MODEL_NAMES,
    TRAINING_STATE_FNAME,
    CheckpointExistsError,
    CheckpointManager,
    NonFiniteWeightsError,
    check_shapes,
    checkpoint_to_resume,
    checkpointer_overrides,
    existing_checkpoints,
    latest_checkpoint,
    load_training_state,
)
from torchtune_ppo.checkpointing.training_state import (  # noqa: F401
    CheckpointClient,
    capture_rng_state,
    restore_rng_state,
)

__all__ = [
    "CHECKPOINTS_DIRNAME", "MARKER_FNAME", "MODEL_NAMES", "TRAINING_STATE_FNAME",
    "CheckpointClient", "CheckpointExistsError", "CheckpointManager", "NonFiniteWeightsError",
    "capture_rng_state", "check_shapes", "checkpoint_to_resume", "checkpointer_overrides",
    "existing_checkpoints", "latest_checkpoint", "load_training_state", "restore_rng_state",
]
