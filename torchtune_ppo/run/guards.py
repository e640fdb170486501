"""Counting PPO steps whose update was skipped for non-finite values, and stopping a run that
keeps producing them; what a step that raised leaves saved."""

import logging
from typing import Any, Callable, Dict, Optional


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


class StepInProgress:
    """What a checkpoint may hold when a step fails midway: the state after the last completed
    step. The rule: a failure before the step's update (rollout, scoring, advantages) changed
    nothing a checkpoint holds but the random states, so the checkpoint is saved with the random
    states captured when the step began; once the update has begun, the optimizer may have
    stepped some minibatches and the weights are no longer the last completed step's, so
    nothing is saved (the last checkpoint stays the one to resume from).

    An evaluation between steps is no step: a failure there leaves every step run complete, so
    the checkpoint is of the last one, with the random states captured when the evaluation
    began (it draws from a stream of its own, but a reward function may draw from the global ones).
    So is what follows a step once it is counted (logging it, the caller's ``on_step``, its
    checkpoint): a failure there saves that step, with the random states captured as it ended.

    Args:
        capture_rng (Callable[[], Any]): returns the run's random states now.
    """

    def __init__(self, capture_rng: Callable[[], Any]) -> None:
        self._capture_rng = capture_rng
        self.rng: Any = None
        self.updating = False
        self.evaluating = False  # between steps: the evaluation after the last one
        self.completed = False  # between steps: the last one counted, not yet evaluated

    def begin(self) -> None:
        self.rng, self.updating, self.evaluating, self.completed = self._capture_rng(), False, False, False

    def complete(self) -> None:
        """The step is counted: every step run is complete."""
        self.rng, self.updating, self.evaluating, self.completed = self._capture_rng(), False, False, True

    def update_begins(self) -> None:
        self.updating = True

    def evaluation_begins(self) -> None:
        """The evaluation after the steps run begins; they are all complete."""
        self.rng, self.updating, self.evaluating, self.completed = self._capture_rng(), False, True, False


def evaluate_when_due(evaluator: Any, progress: Any, step: StepInProgress, checkpoints: Any,
                      save: Callable[[int], Any]) -> None:
    """The evaluation due after the steps run, if any (``evaluator.when_due``). A new best after
    step 0 gets its checkpoint (``save(step)``); when the step's checkpoint was written before
    the evaluation, the evaluation is recorded in it (``checkpoints.record_evaluation``), so that
    a resume from it neither repeats nor loses that evaluation (one that never finished runs
    again). ``step`` learns that the evaluation began: a failure in it is the evaluation's, and
    every step run is complete (``eval.on_error``)."""
    if not evaluator.due(progress):
        return
    done = progress.global_step
    step.evaluation_begins()
    best = evaluator.when_due(progress)
    record = progress.evaluation
    if progress.last_saved_step != done:
        if best:
            save(done)
    elif record.history and record.history[-1]["step"] == done:
        checkpoints.record_evaluation(done, record.state_dict())


def on_step_failure(error: BaseException, step: StepInProgress, *, steps_run: int, saved_step: Optional[int],
                    save: Callable[[Any], Optional[str]], world_size: int, resume: str,
                    log: logging.Logger, rank_zero: bool) -> None:
    """Saves the state after the last completed step when ``step`` allows it (see
    :class:`StepInProgress`), then logs where the run is and the command that resumes it.

    ``save(rng)`` writes the checkpoint of ``steps_run`` and returns its path. A failed save
    (``CheckpointWriteError``) is not retried; under several processes nothing is saved either
    (the other ranks may never reach the collective gather of the weights). A failure in the
    evaluation after ``steps_run`` steps is named as the evaluation's, and the command to continue
    says that the resumed run evaluates that step again first.
    """
    from torchtune_ppo.checkpointing import CheckpointWriteError

    failed = f"step {steps_run + 1} failed ({type(error).__name__}: {error})"
    after = ""
    if step.evaluating:
        when = "before step 1" if steps_run == 0 else f"after step {steps_run}"
        failed = f"evaluation {when} failed ({type(error).__name__}: {error})"
        after = " With eval.on_error=skip an evaluation that fails is logged and training goes on."
        if steps_run:
            after = f" A resumed run evaluates step {steps_run} again first.{after}"
    elif step.completed:
        failed = f"run failed after step {steps_run} ({type(error).__name__}: {error})"
    if isinstance(error, CheckpointWriteError):
        failed, where, after = f"checkpoint of step {steps_run} not saved: {error}", "the run stops here", ""
    elif saved_step == steps_run:
        where = f"the state after step {steps_run} is already saved"
    elif world_size > 1:
        where = (f"not saved: with {world_size} processes the other ranks cannot join the save; "
                 f"the last checkpoint is of step {saved_step}")
    elif step.updating:
        where = (f"not saved: the failure came during the update, after which the weights and "
                 f"optimizer may hold part of step {steps_run + 1}; the last checkpoint is of "
                 f"step {saved_step}")
    elif steps_run == 0:
        where = "nothing to save: no step completed"
    else:
        try:
            where = f"the state after step {steps_run} is saved to {save(step.rng)}"
        except Exception as e:  # noqa: BLE001 - report it, then the original error goes on
            where = f"saving the state after step {steps_run} failed too: {e}"
    if rank_zero:
        log.error(f"PPO {failed}; {where}.{after} To continue: {resume}")
