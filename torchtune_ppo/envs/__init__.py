"""Environments of multi-turn rollouts: the protocol, the built-ins, and observations as tokens.

An environment reads each assistant turn and answers the next tool turn's text or the end of
the episode (:class:`EnvStep`); the rollout calls it through :func:`safe_step` (in a worker process
that is killed when a step overruns, or a worker thread: ``ISOLATIONS``) and appends the
observation as :class:`ObservationRenderer` tokens. See ``docs/multi_turn.md``.

Nothing here imports the rollout, the PPO update or the recipe.
"""

from torchtune_ppo.envs.base import (
    ISOLATIONS,
    Conversation,
    Environment,
    EnvStep,
    check_environment,
    safe_step,
)
from torchtune_ppo.envs.calculator import Calculator
from torchtune_ppo.envs.example import GuessNumber
from torchtune_ppo.envs.render import ObservationRenderer

__all__ = [
    "Conversation",
    "EnvStep",
    "Environment",
    "ISOLATIONS",
    "safe_step",
    "check_environment",
    "Calculator",
    "ObservationRenderer",
    "GuessNumber",
]
