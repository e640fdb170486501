"""Turning SIGINT, SIGTERM and SIGHUP into "finish this step, save, and stop".

SIGHUP is what a run gets when its terminal closes or its ssh connection drops; it is treated as
SIGTERM. A run started with SIGHUP ignored (``nohup``) keeps ignoring it.
"""

import contextlib
import shlex
import signal
from typing import Iterator, Optional, Sequence

from torchtune import utils

log = utils.get_logger("INFO")


class StopRequest:
    """Set by the first SIGINT, SIGTERM or SIGHUP; a second one stops at once (the default
    handler)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def agree(self) -> None:
        """A stop any rank received becomes every rank's, so that all of them leave the loop
        after the same step and save together (torchrun signals ranks at slightly different
        times); a no-op with one process."""
        from torchtune_ppo import distributed

        distributed.agree_on_stop(self)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        # The next signal of this kind acts as usual: a second Ctrl-C interrupts right away.
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        log.warning(f"{signal.Signals(signum).name} received: finishing the current step, then "
                    "saving a checkpoint. Send it again to stop at once without saving.")


# SIGHUP: a closed terminal or a dropped ssh connection (none on Windows).
SIGHUP = getattr(signal, "SIGHUP", None)
SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, SIGHUP) if s is not None)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, SIGINT, SIGTERM and SIGHUP set the yielded :class:`StopRequest` instead
    of raising or ending the process.

    A SIGHUP ignored when the block starts stays ignored (``nohup``, which asks the run to
    outlive its terminal). The previous handlers are restored on exit. Outside the main
    thread (where Python cannot install handlers) the request simply never fires.
    """
    request = StopRequest()
    previous = {}
    try:
        for signum in SIGNALS:
            if signum == SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:
                continue  # `nohup`: the run is to outlive its terminal
            previous[signum] = signal.signal(signum, request._handle)
    except ValueError:  # not the main thread
        pass
    try:
        yield request
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def resume_command(argv: Sequence[str], output_dir: str) -> str:
    """The command that continues this run: ``argv`` without its own ``output_dir=`` and
    ``resume_from_checkpoint=`` overrides, then both, once each."""
    kept = [a for a in argv if not a.startswith(("output_dir=", "resume_from_checkpoint="))]
    return shlex.join(["tune", "run", *kept, f"output_dir={output_dir}", "resume_from_checkpoint=True"])
