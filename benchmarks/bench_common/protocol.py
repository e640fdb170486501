"""Long-lived row workers, driven one step at a time over line-delimited JSON.

Each row runs in its own process (or one process per rank of a multi-process row), set up and
compiled once. The driver writes one command a line to the worker's stdin and reads one reply a
line from its stdout; everything else the worker prints goes to its stderr, the row's log::

    worker -> {"event": "ready", ...}                       after setting up its row
    driver -> {"cmd": "step"}   worker -> {"event": "step", "step": {...}}   one PPO step
    driver -> {"cmd": "stop"}   worker -> {"event": "done", "whole_run_s": ..., ...}
    worker -> {"event": "error", "reason": "..."}           instead of any reply

A worker runs its training loop as it would alone; at the end of each step the loop's
per-step callback replies and then blocks until the next command, so the steps it computes do
not depend on how the driver schedules it. ``whole_run_s`` sums, over the steps, the time from
each "step" command to that step's end: the row's own time, with every wait for the other rows
left out (and what runs between two steps, data loading and logging, kept in).
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .interleave import RowFailed


# -- the worker's side -------------------------------------------------------------------------

class StopRun(Exception):
    """Raised from a step callback when the driver says stop: ends the row's training loop."""


class Channel:
    """The worker's end: replies on the process's original stdout, which from here on is
    private (fd 1 is pointed at stderr, so prints and logs of the row go to its log)."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, message: Dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    def recv(self) -> Dict[str, Any]:
        line = sys.stdin.readline()
        if not line:  # the driver is gone
            raise StopRun
        return json.loads(line)


def serve(setup: Callable[[], Any]) -> None:
    """A worker's main loop.

    Args:
        setup (Callable[[], Any]): builds the row; returns an object with ``info`` (a dict for
            the "ready" reply), ``run(on_step)`` (the training loop; it calls
            ``on_step(step_dict)`` at the end of every step, after syncing the device) and
            ``finish() -> dict`` (cleanup; what the "done" reply adds).
    """
    channel = Channel()
    try:
        row = setup()
    except Exception as e:
        _log_traceback()
        channel.send({"event": "error", "reason": _reason(e)})
        raise
    channel.send({"event": "ready", **getattr(row, "info", {})})
    active: List[float] = []
    started = [time.perf_counter()]

    def next_command() -> None:
        message = channel.recv()
        if message.get("cmd") != "step":
            raise StopRun
        started[0] = time.perf_counter()

    def on_step(step: Dict[str, Any]) -> None:
        active.append(time.perf_counter() - started[0])
        channel.send({"event": "step", "step": {**step, "active_s": active[-1]}})
        next_command()

    try:
        next_command()
        row.run(on_step)
        # The loop ended on its own while the driver wanted another step.
        channel.send({"event": "error", "reason": f"the row's training loop ended after {len(active)} steps"})
        return
    except StopRun:
        pass
    except Exception as e:
        _log_traceback()
        channel.send({"event": "error", "reason": _reason(e)})
        raise
    channel.send({"event": "done", "whole_run_s": sum(active), "steps_run": len(active),
                  **row.finish()})


def _log_traceback() -> None:
    """The traceback into the row's log before the error reply (the driver may then stop the
    process before its own exit would print it)."""
    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()


def _reason(e: BaseException) -> str:
    last = traceback.format_exception_only(type(e), e)[-1].strip()
    return last[:500]


# -- the driver's side -------------------------------------------------------------------------

class _Lines:
    """Whole lines from a pipe, with a timeout (reads the fd directly: no hidden buffer)."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def readline(self, timeout: Optional[float]) -> Optional[str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], wait)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None  # the worker exited
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


class WorkerRow:
    """One row of a benchmark, run by one worker process per rank.

    Args:
        name (str): the row's key (log file names).
        commands (Sequence[Tuple[List[str], Dict[str, str]]]): argv and environment of each
            process (one for a single-process row; one per rank otherwise).
        log_dir (Path): where each process's stderr goes, ``<name>.log`` (``<name>.rank<i>.log``).
        merge (Callable): turns the ranks' step dicts into the row's (default: rank 0's).
        limit_s (Optional[float]): the row's own time at most (setup, compile and steps; waits
            for other rows excluded), after which it is killed and reported as timed out.
    """

    def __init__(self, name: str, commands: Sequence[Tuple[List[str], Dict[str, str]]], log_dir: Path,
                 merge: Optional[Callable[[List[Dict[str, Any]]], Dict[str, Any]]] = None,
                 limit_s: Optional[float] = None, cwd: Optional[Path] = None):
        self.name, self.commands, self.merge = name, list(commands), merge or (lambda steps: steps[0])
        self.limit_s, self.used_s, self.cwd = limit_s, 0.0, cwd
        multi = len(self.commands) > 1
        self.logs = [log_dir / (f"{name}.rank{i}.log" if multi else f"{name}.log")
                     for i in range(len(self.commands))]
        self.procs: List[subprocess.Popen] = []
        self.lines: List[_Lines] = []
        self.info: Dict[str, Any] = {}

    def start(self) -> None:
        for (argv, env), log in zip(self.commands, self.logs):
            with open(log, "w") as err:
                # Own process group: killing the row also ends its compile workers.
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                        env=env, cwd=self.cwd, start_new_session=True)
            self.procs.append(proc)
            self.lines.append(_Lines(proc.stdout.fileno()))

    def _send(self, message: Dict[str, Any]) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write((json.dumps(message) + "\n").encode())
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # the reply read below reports the exit

    def _replies(self, event: str, timeout: Optional[float]) -> List[Dict[str, Any]]:
        if self.limit_s is not None:
            left = self.limit_s - self.used_s
            timeout = left if timeout is None else min(timeout, left)
        start = time.perf_counter()
        out = []
        try:
            for i, lines in enumerate(self.lines):
                wait = None if timeout is None else max(0.0, timeout - (time.perf_counter() - start))
                line = lines.readline(wait)
                if line is None:
                    self.procs[i].wait()
                    raise RowFailed("error", f"exit {self.procs[i].returncode}: {self._tail(i)} "
                                             f"(log: {self.logs[i]})")
                message = json.loads(line)
                if message.get("event") == "error":
                    raise RowFailed("error", f"{message.get('reason')} (log: {self.logs[i]})")
                if message.get("event") != event:
                    raise RowFailed("error", f"expected {event!r}, got {message!r}")
                out.append(message)
        except TimeoutError:
            self.kill()
            limit = self.limit_s if self.limit_s is not None else timeout
            raise RowFailed("timed out", f"ran past its {limit:.0f} s limit") from None
        except RowFailed:
            self.kill()
            raise
        finally:
            self.used_s += time.perf_counter() - start
        return out

    def _tail(self, i: int) -> str:
        try:
            lines = self.logs[i].read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def ready(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Waits for every process to set up its row; returns rank 0's "ready" reply."""
        self.info = self._replies("ready", timeout)[0]
        return self.info

    def step(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Runs one step on every rank; returns the merged step dict."""
        self._send({"cmd": "step"})
        return self.merge([m["step"] for m in self._replies("step", timeout)])

    def stop(self, timeout: Optional[float] = 120.0) -> List[Dict[str, Any]]:
        """Ends the row; returns every rank's "done" reply (whole run, peak memory, ...)."""
        self._send({"cmd": "stop"})
        try:
            done = self._replies("done", timeout)
        finally:
            for proc in self.procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            self.kill()
        return done

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            else:
                # The worker is gone; its compile workers may not be.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
