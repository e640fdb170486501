"""Rewards: functions of the decoded texts (protocol and built-ins) and reward models."""

from torchtune_ppo.rewards.functions import *  # noqa: F401,F403
from torchtune_ppo.rewards.functions import __all__ as _functions_all

__all__ = list(_functions_all)
