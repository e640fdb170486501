"""Checkpoints of a PPO run: the atomic store of step folders, and the training state in them."""

from torchtune_ppo.checkpointing.store import *  # noqa: F401,F403
from torchtune_ppo.checkpointing.store import (  # noqa: F401  names the recipe uses
    CheckpointManager,
    capture_rng_state,
    check_shapes,
    checkpoint_to_resume,
    checkpointer_overrides,
    existing_checkpoints,
    latest_checkpoint,
    load_training_state,
    restore_rng_state,
)
