"""How to write an environment: a number-guessing game, small enough to copy and change.

An environment is any object with ``step(conversation, turn) -> EnvStep``. Copy this file,
rename the class, change ``step``, and name it in the config by its import path.
"""

import re

from torchtune_ppo.envs.base import Conversation, EnvStep

__all__ = ["GuessNumber"]

_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """The row's reference is a secret number; each assistant turn guesses it.

    The guess is the last number in the turn. The environment answers ``"higher"`` or
    ``"lower"``, and the episode ends with reward 1.0 when the guess is right, or with no
    reward after a wrong guess once ``max_hints`` hints were given.

    Args:
        max_hints (int): tool turns the episode may hold before a wrong guess ends it. Default: 4
    """

    def __init__(self, max_hints: int = 4):
        # Settings go in __init__ (the config's keys); state never does: one instance serves
        # every row of every step, in any order, and a resumed run replays the same calls.
        self.max_hints = max_hints

    def step(self, conversation: Conversation, turn: str) -> EnvStep:
        """Answer one guess; see :class:`GuessNumber`."""
        # The row's data: its reference answer (here the secret number). Raising is fine:
        # the rollout ends the episode and logs the cause with the class name.
        if conversation.reference is None:
            raise ValueError("GuessNumber needs the secret number as the row's reference")
        secret = int(conversation.reference)

        # The episode so far is in conversation.turns: count the hints already given.
        hints = sum(role == "tool" for role, _ in conversation.turns)

        numbers = _NUMBER.findall(turn)
        if numbers and int(numbers[-1]) == secret:
            return EnvStep(None, reward=1.0)  # done, and 1.0 is added to the final score
        if hints >= self.max_hints:
            return EnvStep(None)  # done: out of hints, nothing added
        if not numbers:
            return EnvStep("say a number")  # the next tool turn's text
        return EnvStep("higher" if int(numbers[-1]) < secret else "lower")
