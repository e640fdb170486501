"""Steps 1-6 of a PPO step: generate responses (KV-cached, compiled), then score them.

- :mod:`~torchtune_ppo.rollout.generation` and :mod:`~torchtune_ppo.rollout.sampling`: the
  batched generator, step 1.
- :mod:`~torchtune_ppo.rollout.trajectory`: the :class:`Trajectory` and the rules shared by
  every scoring path (masks, truncation, penalties).
- :mod:`~torchtune_ppo.rollout.scoring`: steps 2-6 on packed real tokens.
- :mod:`~torchtune_ppo.rollout.rollout`: :class:`Rollout`, what the recipe calls.
"""

from torchtune_ppo.rollout.rollout import Rollout, fused_rollout, generate_unrolled  # noqa: F401
from torchtune_ppo.rollout.trajectory import Trajectory  # noqa: F401

__all__ = ["Rollout", "Trajectory", "fused_rollout", "generate_unrolled"]
