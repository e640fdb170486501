"""The environment protocol of multi-turn rollouts, and the guarded call the rollout makes.

An episode alternates turns: the policy writes an assistant turn (ending in its stop token),
an :class:`Environment` reads it and answers with an :class:`EnvStep`: the text of the next
tool turn, or ``None`` when the episode is done, and optionally a reward added to the
episode's final score. Environments are stateless across rows: all a row's state is its
:class:`Conversation`, so a resumed step re-runs its episodes exactly from the seed.

:func:`safe_step` is how the rollout calls one: an environment that raises, hangs or answers
something other than an ``EnvStep`` ends that episode with a cause to log, never the run.
"""

import math
import numbers
import queue
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, NamedTuple, Optional, Protocol, Tuple, runtime_checkable

__all__ = ["Conversation", "EnvStep", "Environment", "EnvFailure", "safe_step", "check_environment"]


class Conversation(NamedTuple):
    """What an environment sees of one row's episode before the current assistant turn.

    Attributes:
        prompt (str): the decoded prompt (the chat template's text, as the tokenizer decodes it).
        turns (Tuple[Tuple[str, str], ...]): the earlier ``("assistant", text)`` and
            ``("tool", text)`` turns, in order, not counting the current one.
        reference (Optional[str]): the row's reference answer, or None.
        seed (int): the row's seed; the same (run seed, step, row) gives the same value.
    """

    prompt: str
    turns: Tuple[Tuple[str, str], ...]
    reference: Optional[str]
    seed: int


class EnvStep(NamedTuple):
    """An environment's answer to one assistant turn.

    Attributes:
        observation (Optional[str]): the next tool turn's text; None: the episode is done.
        reward (Optional[float]): added to the episode's final score; None: nothing.
    """

    observation: Optional[str] = None
    reward: Optional[float] = None


@runtime_checkable
class Environment(Protocol):
    """Anything with ``step(conversation, turn) -> EnvStep``.

    ``turn`` is the text of the assistant turn just written (decoded, special tokens skipped).
    """

    def step(self, conversation: Conversation, turn: str) -> EnvStep: ...


class EnvFailure(NamedTuple):
    """Why an episode was ended by its environment rather than by the policy.

    Attributes:
        cause (str): one line naming the environment class and what went wrong.
    """

    cause: str


def check_environment(env: Any) -> None:
    """Raise unless ``env`` is an environment instance with a callable ``step``.

    Raises:
        TypeError: ``env`` is a class, or has no callable ``step``; the message names the class.
    """
    if isinstance(env, type):
        raise TypeError(f"{env.__name__} is a class; pass an instance of it (an environment with a step method).")
    if not callable(getattr(env, "step", None)):
        raise TypeError(f"{type(env).__name__} is not an environment: it has no callable "
                        "step(conversation, turn) -> EnvStep.")


class _DaemonPool:
    """A module-level pool of daemon worker threads, started as needed.

    ``concurrent.futures.ThreadPoolExecutor`` joins its workers at interpreter exit, so one hung
    ``step`` would keep a finished run from exiting, and a few would take every worker and make
    each later call time out in the queue. Here a call that runs past its timeout is abandoned
    to its thread, which never blocks exit; a new thread serves the next call. Idle threads are
    reused, so a rollout's thousands of calls start a handful of threads.
    """

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Tuple[Future, Callable[..., Any], tuple]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self._started += 1
                threading.Thread(target=self._work, name=f"env-step-{self._started}", daemon=True).start()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the caller, which decides
                    future.set_exception(e)
            del future, fn, args  # hold nothing of a finished call while idle
            with self._lock:
                self._idle += 1


_POOL = _DaemonPool()


def _describe(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"


def _invalid(step: Any, name: str) -> Optional[str]:
    """What is wrong with ``step`` as an answer of ``name``'s ``step``, or None."""
    if not isinstance(step, EnvStep):
        return f"{name}.step returned {_describe(step)}, not an EnvStep"
    if step.observation is not None and not isinstance(step.observation, str):
        return f"{name}.step returned an observation of {_describe(step.observation)}, not str or None"
    reward = step.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        return f"{name}.step returned a reward of {_describe(reward)}, not a finite real number"
    return None


def safe_step(env: Environment, conversation: Conversation, turn: str, *,
              timeout_s: Optional[float]) -> Tuple[EnvStep, Optional[str]]:
    """``env.step(conversation, turn)``, with any failure turned into the end of the episode.

    Args:
        env (Environment): the environment.
        conversation (Conversation): the row's episode so far.
        turn (str): the assistant turn just written.
        timeout_s (Optional[float]): how long the call may run, in a worker thread; a call
            still running then is abandoned. None: called directly, no thread.

    Returns:
        Tuple[EnvStep, Optional[str]]: ``(step, None)`` when ``env`` answered a valid
        ``EnvStep`` (its reward as a float); ``(EnvStep(None), cause)`` when it raised, ran
        past ``timeout_s`` or answered something else, ``cause`` naming the class and what
        happened (e.g. ``"Calculator raised ZeroDivisionError: division by zero"``).

    Raises:
        ValueError: ``timeout_s`` is not None and not a positive number.
    """
    name = type(env).__name__
    if timeout_s is None:
        try:
            step = env.step(conversation, turn)
        except Exception as e:
            return EnvStep(None), f"{name} raised {type(e).__name__}: {e}"
    else:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds or None.")
        future = _POOL.submit(env.step, conversation, turn)
        # wait() rather than result(timeout): an env.step that itself raises TimeoutError is an
        # exception of the environment, not a timeout.
        done, _ = wait([future], timeout=timeout_s)
        if not done:
            return EnvStep(None), f"{name}.step did not return within {float(timeout_s)} s"
        error = future.exception()
        if error is not None:
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: not ours to swallow
                raise error
            return EnvStep(None), f"{name} raised {type(error).__name__}: {error}"
        step = future.result()
    problem = _invalid(step, name)
    if problem is not None:
        return EnvStep(None), problem
    return (step if step.reward is None else step._replace(reward=float(step.reward))), None
