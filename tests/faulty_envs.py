"""Environments that misbehave, for the tests of ``safe_step`` and of runs with ``env``: one that
exits, one that holds the interpreter lock in a regular expression that backtracks for ever, one
that spins in pure Python, one that sleeps, one that ends its process. Importable by name
(``faulty_envs.Backtracks``) from a ``tune run`` whose ``PYTHONPATH`` holds ``tests/``.

Each answers like the tiny task's calculator when it does not misbehave, and ``mark``, when
given, is a file each misbehaving call appends its process id to (the call's process: the run's
with ``turns.isolation: thread``, a worker's with ``process``), so a test can wait for a call to
be under way and see whether that process is still there afterwards.
"""

import os
import re
import sys
import time
from typing import Optional

from torchtune_ppo.envs import Calculator, Conversation, EnvStep

# (a+)+$ against a's and a b backtracks through every split of the a's: 2**40 tries, one C call
# of the regex engine that never releases the interpreter lock.
CATASTROPHIC = re.compile(r"(a+)+$")
CATASTROPHIC_TEXT = "a" * 40 + "b"


class _Faulty:
    """Misbehaves on a turn holding ``when`` (every turn by default), else the calculator."""

    def __init__(self, when: str = "", mark: Optional[str] = None, call_pattern: str = r"^(-?[0-9]+)$"):
        self.when, self.mark = when, mark
        self._calculator = Calculator(call_pattern=call_pattern)

    def step(self, conversation: Conversation, turn: str) -> EnvStep:
        if self.when not in turn:
            return self._calculator.step(conversation, turn)
        if self.mark:
            with open(self.mark, "a") as f:
                f.write(f"{os.getpid()}\n")
        return self.misbehave()

    def misbehave(self) -> EnvStep:
        raise NotImplementedError


class Exits(_Faulty):
    """``sys.exit(3)``."""

    def misbehave(self) -> EnvStep:
        sys.exit(3)


class Backtracks(_Faulty):
    """A regular expression that runs for hours in one call, holding the interpreter lock."""

    def misbehave(self) -> EnvStep:
        CATASTROPHIC.match(CATASTROPHIC_TEXT)
        return EnvStep("never")


class Spins(_Faulty):
    """A pure-Python busy loop that never ends."""

    def misbehave(self) -> EnvStep:
        n = 0
        while True:
            n += 1


class Sleeps(_Faulty):
    """Sleeps for ``seconds``, then answers."""

    def __init__(self, seconds: float = 3600.0, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def misbehave(self) -> EnvStep:
        time.sleep(self.seconds)
        return EnvStep("late")


class Crashes(_Faulty):
    """Ends its process at once (``os._exit(7)``): no exception, no cleanup."""

    def misbehave(self) -> EnvStep:
        os._exit(7)
