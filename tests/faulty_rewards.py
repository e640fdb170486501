"""Reward functions that fail, for the tests of an evaluation that fails or is killed: one that
raises, one that ends its process with SIGKILL. Importable by name (``faulty_rewards.raises_while``)
from a ``tune run`` whose ``PYTHONPATH`` holds ``tests/``; as a config's ``eval.reward`` block::

    eval.reward._component_=faulty_rewards.raises_while eval.reward.env=SOME_VARIABLE

Each misbehaves only while the environment variable ``env`` is set, and otherwise scores as the
tiny arithmetic task's reward does (``ExactMatch`` of the last number), so the same command,
run again without the variable, is the run as it should have been.
"""

import os
import signal

from torchtune_ppo.rewards import ExactMatch


def raises_while(env: str):
    """The arithmetic reward, raising ``ZeroDivisionError`` while ``env`` is set."""
    score = ExactMatch(extract="last_number")

    def reward(prompts, responses, **kwargs):
        if os.environ.get(env):
            raise ZeroDivisionError(f"the evaluation's reward failed ({env} is set)")
        return score(prompts, responses, **kwargs)

    return reward


def _signals_while(env: str, signum: int):
    score = ExactMatch(extract="last_number")

    def reward(prompts, responses, **kwargs):
        if os.environ.get(env):
            os.kill(os.getpid(), signum)
        return score(prompts, responses, **kwargs)

    return reward


def kills_while(env: str):
    """The arithmetic reward, killing its own process (SIGKILL: nothing can save) while ``env`` is set."""
    return _signals_while(env, signal.SIGKILL)


def sigterms_while(env: str):
    """The arithmetic reward, sending its own process SIGTERM while ``env`` is set: the run ends
    what it is doing, saves and exits 143, as when it is stopped from outside."""
    return _signals_while(env, signal.SIGTERM)
