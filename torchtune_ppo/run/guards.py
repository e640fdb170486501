"""Counting PPO steps whose update was skipped for non-finite values, and stopping a run that
keeps producing them."""

from typing import Dict


class SkippedSteps:
    """Skipped-step counters of a run, saved with its checkpoints.

    Args:
        max_consecutive (int): this many skipped steps in a row stop the run.
    """

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.total = 0
        self.consecutive = 0

    def count(self, skipped: bool) -> None:
        """Records one step.

        Raises:
            RuntimeError: after ``max_consecutive`` skipped steps in a row.
        """
        self.total += skipped
        self.consecutive = self.consecutive + 1 if skipped else 0
        if self.consecutive >= self.max_consecutive:
            raise RuntimeError(
                f"{self.consecutive} consecutive steps had non-finite rewards, losses or "
                f"gradients (max_consecutive_skipped_steps={self.max_consecutive}); stopping. "
                "Lower optimizer.lr, check the reward model, or resume from the last checkpoint "
                "with resume_from_checkpoint=True."
            )

    def state_dict(self) -> Dict[str, int]:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.total, self.consecutive = state["total"], state["consecutive"]
