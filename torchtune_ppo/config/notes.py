"""Notes on how a key is read (a torchtune key mapped onto ours, a setting that has no effect, a
default chosen for this run), each logged once per process whichever check says it."""

from torchtune import utils

NOTED: set = set()


def note(message: str) -> None:
    """Logs a note about how a key is read, once per process."""
    if message not in NOTED:
        NOTED.add(message)
        utils.get_logger("INFO").info(f"Note: {message}")
