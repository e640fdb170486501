"""Steps 1-6 of a PPO step: generate responses (KV-cached, compiled), then score them.

- :mod:`~torchtune_ppo.rollout.generation` and :mod:`~torchtune_ppo.rollout.sampling`: the
  batched generator, step 1.
- :mod:`~torchtune_ppo.rollout.scoring`: steps 2-6 on packed real tokens.
- :mod:`~torchtune_ppo.rollout.rollout`: :class:`Rollout`, what the recipe calls.
- :mod:`~torchtune_ppo.rollout.turns`: multi-turn episodes with an environment.
- :mod:`~torchtune_ppo.rollout.speculative`: position-keyed noise and drafts checked in one forward.
- :mod:`~torchtune_ppo.rollout.fused`: experimental, steps 1-6 as one region (``compile.rollout``).
"""

from torchtune_ppo.rollout.generation import Generator  # noqa: F401
from torchtune_ppo.rollout.rollout import Rollout  # noqa: F401
from torchtune_ppo.rollout.speculative import Speculation, speculative_args  # noqa: F401
from torchtune_ppo.rollout.turns import TurnRunner, cache_tokens  # noqa: F401
from torchtune_ppo.rlhf import ScoringSettings, Trajectory  # noqa: F401

__all__ = ["Generator", "Rollout", "ScoringSettings", "Speculation", "Trajectory", "TurnRunner", "cache_tokens",
           "speculative_args"]
