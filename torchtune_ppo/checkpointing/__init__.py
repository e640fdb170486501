"""Checkpoints of a PPO run: the atomic store of step folders (:mod:`.store`) and the training
state in them, saved and restored by :class:`CheckpointClient` (:mod:`.training_state`)."""

from torchtune_ppo.checkpointing.store import (  # noqa: F401
    CHECKPOINTS_DIRNAME,
    CONFIG_FNAME,
    EVALUATION_FNAME,
    MARKER_FNAME,
    MODEL_NAMES,
    TRAINING_STATE_FNAME,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointWriteError,
    DamagedCheckpointError,
    NonFiniteWeightsError,
    check_loaded_finite,
    check_shapes,
    check_writable,
    checkpoint_to_resume,
    checkpointer_overrides,
    edited_files,
    existing_checkpoints,
    is_sharded,
    latest_checkpoint,
    load_adapters,
    load_training_state,
    lock_output_dir,
    release_output_dir,
    set_aside,
    write_evaluation,
)
from torchtune_ppo.checkpointing.resume_config import (  # noqa: F401
    ResumeConfigError,
    apply_optimizer_overrides,
    check_resume_config,
    config_to_save,
)
from torchtune_ppo.checkpointing.training_state import (  # noqa: F401
    CheckpointClient,
    capture_rng_state,
    restore_rng_state,
)

__all__ = [
    "CHECKPOINTS_DIRNAME", "MARKER_FNAME", "MODEL_NAMES", "TRAINING_STATE_FNAME",
    "CheckpointClient", "CheckpointExistsError", "CheckpointManager", "CheckpointWriteError",
    "CONFIG_FNAME", "DamagedCheckpointError", "EVALUATION_FNAME", "NonFiniteWeightsError", "ResumeConfigError",
    "apply_optimizer_overrides", "capture_rng_state", "check_loaded_finite", "check_resume_config",
    "check_shapes", "check_writable", "config_to_save", "checkpoint_to_resume", "checkpointer_overrides",
    "edited_files", "existing_checkpoints", "is_sharded", "latest_checkpoint", "load_adapters", "load_training_state",
    "lock_output_dir", "release_output_dir", "restore_rng_state", "set_aside", "write_evaluation",
]
