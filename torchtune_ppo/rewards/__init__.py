"""Rewards: functions of the decoded texts (the protocol and the built-ins) and reward models."""

from torchtune_ppo.rewards.builtins import (
    EXTRACTORS,
    ExactMatch,
    FormatMatch,
    WeightedSum,
    answers_match,
    extract_answer,
)
from torchtune_ppo.rewards.functions import (
    FunctionReward,
    RewardFunction,
    RewardFunctionError,
    call_reward_fn,
    check_reward_fn,
    from_path,
)
from torchtune_ppo.rewards.model import ModelReward

__all__ = [
    "EXTRACTORS",
    "ExactMatch",
    "FormatMatch",
    "FunctionReward",
    "ModelReward",
    "RewardFunction",
    "RewardFunctionError",
    "WeightedSum",
    "answers_match",
    "call_reward_fn",
    "check_reward_fn",
    "extract_answer",
    "from_path",
]

# The factories that shipped before the built-ins became classes, kept for one release as
# `_component_` paths: torchtune resolves `torchtune_ppo.rewards.exact_match` by getattr,
# which reaches __getattr__ below. Each warns on its first use, then is a plain attribute.
_DEPRECATED = {"exact_match": ExactMatch, "format_match": FormatMatch, "weighted_sum": WeightedSum}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import warnings

        cls = _DEPRECATED[name]
        warnings.warn(f"torchtune_ppo.rewards.{name} is deprecated: use torchtune_ppo.rewards."
                      f"{cls.__name__} (same arguments); the old name will be removed in the next "
                      "release.", FutureWarning, stacklevel=2)
        globals()[name] = cls  # warn once: later lookups find the attribute
        return cls
    raise AttributeError(f"module 'torchtune_ppo.rewards' has no attribute {name!r}")
