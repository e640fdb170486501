"""A forked worker process that runs one function, call after call, and can be stopped at any time.

A thread cannot be stopped: an environment step that loops in pure Python, or sits in one long C
call that holds the interpreter lock (a catastrophic regular expression), keeps its thread, and
the lock, for as long as it likes. A process can: :class:`ForkedWorker` runs the calls in a child
forked from the run, and a call that overruns is ended by killing the child (SIGKILL), after
which the next call forks a fresh one.

The child is forked, not spawned: it starts with the run's memory, so the function (and the
environment bound into it) needs no pickling and no import, and starting one costs a few
milliseconds rather than an interpreter start. Only the call's arguments and its result cross
the pipe, pickled.

The child ignores SIGINT, SIGTERM and SIGHUP (the run decides what a signal means; a Ctrl-C sent
to the terminal's whole process group must not end a call half-way), runs torch on one thread
(the thread pool of a forked process is not the parent's), and on Linux dies with the run
(``PR_SET_PDEATHSIG``), so a run killed with SIGKILL leaves no worker behind. It never returns
into the run's code: it ends with ``os._exit``.
"""

import os
import signal
import sys
import threading
import warnings
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable, Optional

__all__ = ["ForkedWorker", "WorkerDied", "WorkerOverran", "can_fork"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def can_fork() -> bool:
    """Whether this platform has ``os.fork`` (Linux, macOS; not Windows)."""
    return hasattr(os, "fork")


class WorkerOverran(Exception):
    """The call did not return within its timeout; the worker was killed."""


class WorkerDied(Exception):
    """The worker process ended during the call (``os._exit``, a crash, a signal); the message
    says how, e.g. ``"exit code 3"`` or ``"killed by SIGSEGV"``."""


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that forked it ends (the run, normally)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except Exception:  # no prctl: the closed pipe still ends an idle worker
            pass
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(0)


def _serve(conn: Connection, fn: Callable[..., Any], parent: int) -> None:
    """The child's loop: receive a tuple of arguments, send back ``("ok", fn(*args))`` or
    ``("error", text)``; return when the parent's end closes."""
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent(parent)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # fn is expected to catch its own; a reply is owed regardless
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # e.g. a result that cannot be pickled
            conn.send(("error", f"its result could not be sent back: {type(e).__name__}: {e}"))


class ForkedWorker:
    """A child process, forked now, that runs ``fn(*args)`` for each :meth:`call`.

    Args:
        fn (Callable[..., Any]): what the child runs; its result must pickle.

    Raises:
        OSError: the fork failed.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        parent_end, child_end = Pipe()
        parent = os.getpid()
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork in a process with threads: the child here runs only
            # `fn` and this module's loop, never the other threads' locks.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                parent_end.close()
                _serve(child_end, fn, parent)
            except BaseException:
                code = 1
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        child_end.close()
        self.pid: Optional[int] = pid
        self._conn = parent_end
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        """Whether the child is still running (reaps it if it ended)."""
        if self.pid is None:
            return False
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done = self.pid
        if done:
            self.pid = None
            self._conn.close()
        return self.pid is not None

    def call(self, args: tuple, timeout: Optional[float]) -> Any:
        """``fn(*args)`` in the child, waiting at most ``timeout`` seconds (None: as long as it takes).

        Returns:
            Any: the child's reply, ``("ok", result)`` or ``("error", text)``.

        Raises:
            WorkerOverran: no reply within ``timeout``; the child was killed.
            WorkerDied: the child ended before it replied; the message says how.
        """
        with self._lock:
            if self.pid is None:
                raise WorkerDied("it had already ended")
            try:
                self._conn.send(args)
                # Connection.poll waits in select(): the interpreter lock is free, and a signal's
                # Python handler runs during the wait (the recipe's stop request is set at once).
                if not self._conn.poll(timeout):
                    self.close()
                    raise WorkerOverran()
                return self._conn.recv()
            except (EOFError, OSError):
                raise WorkerDied(self._reap()) from None

    def _reap(self) -> str:
        """Waits for the ended child; how it ended."""
        pid, self.pid = self.pid, None
        self._conn.close()
        if pid is None:
            return "it had already ended"
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return "it had ended"
        return _how(status)

    def close(self) -> None:
        """Kills the child (SIGKILL: whatever it is doing) and reaps it; a no-op once closed."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        self._conn.close()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass

    def forget(self) -> None:
        """In a process forked from the owner: drop this copy without touching the child (it is
        the owner's to stop)."""
        self.pid = None
        self._conn.close()
