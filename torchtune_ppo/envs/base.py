"""The environment protocol of multi-turn rollouts, and the guarded call the rollout makes.

An episode alternates turns: the policy writes an assistant turn (ending in its stop token),
an :class:`Environment` reads it and answers with an :class:`EnvStep`: the text of the next
tool turn, or ``None`` when the episode is done, and optionally a reward added to the
episode's final score. Environments are stateless across rows: all a row's state is its
:class:`Conversation`, so a resumed step re-runs its episodes exactly from the seed.

:func:`safe_step` is how the rollout calls one: an environment that raises (``SystemExit``
included), hangs, crashes or answers something other than an ``EnvStep`` ends that episode with
a cause to log, never the run. With a timeout the call runs in a worker process forked from the
run (:mod:`torchtune_ppo.envs.worker`), killed and replaced when the call overruns, or, by
choice, in a worker thread, which is abandoned instead (a thread cannot be stopped).
"""

import atexit
import functools
import math
import numbers
import os
import queue
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, NamedTuple, Optional, Protocol, Tuple, runtime_checkable

from torchtune_ppo.envs.worker import ForkedWorker, WorkerDied, WorkerOverran, can_fork

__all__ = ["Conversation", "EnvStep", "Environment", "ISOLATIONS", "safe_step", "check_environment"]

# Where a step with a timeout runs: `process` (killed when it overruns) or `thread` (abandoned).
ISOLATIONS = ("process", "thread")


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


def _raised(name: str, error: BaseException) -> str:
    text = str(error)
    return f"{name} raised {type(error).__name__}" + (f": {text}" if text else "")


def _checked(env: Environment, conversation: Conversation, turn: str,
             interrupt: bool = False) -> Tuple[EnvStep, Optional[str]]:
    """``env.step`` called here, its answer checked: :func:`safe_step`'s result.

    Whatever the step raises is its failure, ``BaseException`` included: an environment that
    calls ``sys.exit`` (or raises ``SystemExit``, ``GeneratorExit``, asyncio's
    ``CancelledError``) ends its episode like any other error, it does not end the run. Only
    ``KeyboardInterrupt`` passes when ``interrupt``: called in the run's own thread, it is the
    user's second Ctrl-C, which stops the run at once (the first only asks to stop after the step).
    """
    name = type(env).__name__
    try:
        step = env.step(conversation, turn)
    except KeyboardInterrupt as e:
        if interrupt:
            raise
        return EnvStep(None), _raised(name, e)
    except BaseException as e:  # the environment's, whatever it is (see above)
        return EnvStep(None), _raised(name, e)
    problem = _invalid(step, name)
    if problem is not None:
        return EnvStep(None), problem
    return (step if step.reward is None else step._replace(reward=float(step.reward))), None


class _Workers:
    """The worker process of the environment in use, forked at its first call with a timeout.

    One at a time: the rollout and the evaluation share one environment. A call for another
    environment closes the worker and forks one for it; a worker killed after an overrun, or
    ended by its step, is replaced at the next call. Workers are killed at exit, and a process
    forked from this one (a data loader's worker) forgets them: they are not its to stop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._env: Any = None
        self._worker: Optional[ForkedWorker] = None

    def get(self, env: Environment) -> ForkedWorker:
        """The live worker of ``env``, forked if needed. Raises ``OSError`` if the fork fails."""
        with self._lock:
            if self._worker is not None and (self._env is not env or not self._worker.alive):
                self._worker.close()
                self._env = self._worker = None
            if self._worker is None:
                # The child holds its own copy of `env`, as it is now.
                self._worker = ForkedWorker(functools.partial(_checked, env))
                self._env = env
            return self._worker

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()
            self._env = self._worker = None

    def _forget(self) -> None:
        self._lock = threading.Lock()  # a fork may have copied it held
        if self._worker is not None:
            self._worker.forget()
        self._env = self._worker = None


_WORKERS = _Workers()
atexit.register(_WORKERS.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKERS._forget)


def _in_process(env: Environment, conversation: Conversation, turn: str,
                timeout_s: float) -> Tuple[EnvStep, Optional[str]]:
    name = type(env).__name__
    try:
        worker = _WORKERS.get(env)
    except OSError as e:
        return EnvStep(None), f"{name}.step could not start its worker process: {e}"
    try:
        kind, value = worker.call((conversation, turn), timeout_s)
    except WorkerOverran:
        return EnvStep(None), f"{name}.step did not return within {float(timeout_s)} s (its worker process was killed)"
    except WorkerDied as e:
        return EnvStep(None), f"{name}.step ended its worker process ({e})"
    if kind != "ok":
        return EnvStep(None), f"{name}.step failed in its worker process: {value}"
    return value


def _in_thread(env: Environment, conversation: Conversation, turn: str,
               timeout_s: float) -> Tuple[EnvStep, Optional[str]]:
    future = _POOL.submit(_checked, env, conversation, turn)
    # wait() rather than result(timeout): an env.step that itself raises TimeoutError is an
    # exception of the environment, not a timeout.
    done, _ = wait([future], timeout=timeout_s)
    if not done:
        return EnvStep(None), (f"{type(env).__name__}.step did not return within {float(timeout_s)} s "
                               "(abandoned: it may still be running in its thread)")
    return future.result()


def safe_step(env: Environment, conversation: Conversation, turn: str, *,
              timeout_s: Optional[float], isolation: str = "process") -> Tuple[EnvStep, Optional[str]]:
    """``env.step(conversation, turn)``, with any failure turned into the end of the episode.

    Args:
        env (Environment): the environment.
        conversation (Conversation): the row's episode so far.
        turn (str): the assistant turn just written.
        timeout_s (Optional[float]): how long the call may run; None: called directly in this
            thread, for as long as it takes.
        isolation (str): where a call with a timeout runs. ``"process"``: in a worker process
            forked from this one (see :class:`_Workers`), killed when the call overruns; the
            step sees the environment as it was at the fork, and what it changes in it stays
            there. ``"thread"``: in a worker thread, abandoned when the call overruns (it runs on,
            and a step that holds the interpreter lock stalls this process). Default: process

    Returns:
        Tuple[EnvStep, Optional[str]]: ``(step, None)`` when ``env`` answered a valid
        ``EnvStep`` (its reward as a float); ``(EnvStep(None), cause)`` when it raised (any
        ``BaseException``: ``SystemExit`` too), ran past ``timeout_s``, ended its worker process
        or answered something else, ``cause`` naming the class and what happened (e.g.
        ``"Calculator raised ZeroDivisionError: division by zero"``). Called directly, a
        ``KeyboardInterrupt`` is raised on: it is the user's.

    Raises:
        ValueError: ``timeout_s`` is not None and not a positive number, or ``isolation`` is not
            one of :data:`ISOLATIONS`; ``isolation="process"`` where the platform cannot fork.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"turns.isolation={isolation!r}: must be one of {', '.join(ISOLATIONS)}.")
    if timeout_s is None:
        return _checked(env, conversation, turn, interrupt=True)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds or None.")
    if isolation == "thread":
        return _in_thread(env, conversation, turn, timeout_s)
    if not can_fork():
        raise ValueError("turns.isolation='process' needs os.fork, which this platform lacks; set "
                         "turns.isolation=thread (an overrunning step is then abandoned, not stopped) or "
                         "turns.timeout_s=null.")
    return _in_process(env, conversation, turn, timeout_s)
