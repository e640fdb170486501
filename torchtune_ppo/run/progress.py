"""Where a run is: its counters, its position in the data, value pretraining, and when to save.

:class:`Progress` is the run's books, kept apart from the recipe's PPO decisions. Its state dict
is what a checkpoint's training state holds of it, so a resume puts the run back at the same
batch of the same epoch, in the same phase; with it, what identifies the data that position
counts batches of (:func:`torchtune_ppo.data.identity.data_identity`), which a resume compares
with its own data before anything is built; and the evaluations' record
(:class:`~torchtune_ppo.eval.record.EvalRecord`), so a resumed run keeps its best and its count
towards an early stop.
"""

from typing import Any, Dict, Mapping, Optional, Union

from torchtune_ppo.eval.record import EvalRecord
from torchtune_ppo.ppo.value_pretrain import ValuePretraining


class Progress:
    """A run's counters and its save rule.

    Steps are numbered value pretraining's first: the run's ``global_step`` (which names logged
    rows and checkpoints) is pretraining steps plus PPO steps; ``num_ppo_steps`` counts PPO steps.

    Args:
        num_ppo_steps (int): PPO steps the run trains for.
        batches_per_epoch (int): batches of prompts in one pass over the dataset.
        value_pretrain (ValuePretraining): the pretraining phase (``max_steps`` 0: none).
        save_every_n_steps (Optional[int]): save after every N steps; None: not.
        save_every_n_epochs (Optional[int]): also save after every N epochs; None: not.
        data_identity (Optional[Mapping[str, Any]]): what identifies the run's data (the
            preflight's), saved with the counters; None: not recorded.
        evaluation (Optional[Union[EvalRecord, Mapping[str, Any]]]): the evaluations' record (or the
            config's ``eval`` block to build it from), saved with the counters; its early stop ends
            the run. None: no evaluation.
    """

    def __init__(self, *, num_ppo_steps: int, batches_per_epoch: int, value_pretrain: ValuePretraining,
                 save_every_n_steps: Optional[int] = None, save_every_n_epochs: Optional[int] = None,
                 data_identity: Optional[Mapping[str, Any]] = None,
                 evaluation: Optional[Union[EvalRecord, Mapping[str, Any]]] = None) -> None:
        self.num_ppo_steps, self.batches_per_epoch = num_ppo_steps, batches_per_epoch
        self.data_identity = None if data_identity is None else dict(data_identity)
        self.value_pretrain = value_pretrain
        self.evaluation = (evaluation if isinstance(evaluation, EvalRecord)
                           else EvalRecord() if evaluation is None else EvalRecord.from_config(evaluation))
        self.save_every_n_steps, self.save_every_n_epochs = save_every_n_steps, save_every_n_epochs
        self.steps_run = self.epochs_run = 0
        self.batches_run_in_epoch = 0  # the data position inside the current epoch
        self.last_saved_step: Optional[int] = None

    @property
    def pretraining(self) -> bool:
        """The next step is a value pretraining step."""
        return self.value_pretrain.active

    @property
    def global_step(self) -> int:
        """Steps run, value pretraining's first: names the logged rows and the checkpoints."""
        return self.value_pretrain.steps_run + self.steps_run

    @property
    def all_steps_run(self) -> bool:
        """Every PPO step has run (and pretraining is over)."""
        return not self.pretraining and self.steps_run >= self.num_ppo_steps

    @property
    def done(self) -> bool:
        """Every PPO step has run, or the evaluations stopped the run early."""
        return self.all_steps_run or self.evaluation.stopped

    @property
    def unsaved(self) -> bool:
        """The last step run is not in a checkpoint."""
        return self.last_saved_step != self.global_step

    def start_note(self) -> str:
        """What the run starts with, when it starts with value pretraining."""
        left = self.value_pretrain.max_steps - self.value_pretrain.steps_run
        return f"Value pretraining: up to {left} steps on the starting policy's rollouts before PPO's first step."

    def nothing_to_train(self) -> Optional[str]:
        """Why a run resumed from this state has no step left, and what to change to train on;
        None when it has steps left."""
        if not self.done:
            return None
        record, step = self.evaluation, self.global_step
        ran = f"{self.steps_run} of its num_ppo_steps={self.num_ppo_steps} PPO steps"
        longer = f"a num_ppo_steps above {self.steps_run}"
        if record.stopped:
            best = "none finite" if record.best_value is None else f"{record.best_value:.4g} at step {record.best_step}"
            more = f", and {longer}" if self.all_steps_run else ""
            evaluations = f"{record.since_best} evaluation{'s' if record.since_best != 1 else ''}"
            return (f"Nothing to train: this run stopped early after step {step} ({ran}): {evaluations} "
                    f"in a row without a better {record.best_metric} than the best, {best} "
                    f"(eval.early_stop_patience={record.early_stop_patience}). To train on from step {step}, resume "
                    f"with an eval.early_stop_patience above {record.since_best}, or null{more}.")
        return f"Nothing to train: this run has run all {ran} (step {step}). To train on, resume with {longer}."

    def count_step(self, metrics: Dict[str, float], pretraining: bool) -> Optional[str]:
        """Counts the step just run, and its batch. A PPO step counts in ``steps_run``; a value
        pretraining step apart, its value loss going to the stopping rule and its metrics into
        ``metrics``. Returns a note to log when pretraining has just ended, else None."""
        self.batches_run_in_epoch += 1
        if not pretraining:
            self.steps_run += 1
            if self.value_pretrain.steps_run:  # a run that pretrained: its PPO rows say they are not
                metrics["value_pretrain"] = 0.0
            return None
        self.value_pretrain.record(metrics["value_loss"])
        metrics.update(self.value_pretrain.metrics())
        if not self.value_pretrain.done:
            return None
        return (f"Value pretraining done after {self.value_pretrain.steps_run} steps (value loss moving "
                f"average {metrics['value_pretrain/loss_avg']:.4g}, relative change "
                f"{metrics['value_pretrain/rel_change']:.3g}); PPO starts.")

    def end_epoch(self) -> None:
        self.epochs_run += 1
        self.batches_run_in_epoch = 0

    def save_due(self) -> bool:
        """A checkpoint is due after the step just counted."""
        step = self.global_step
        every_n_steps = self.save_every_n_steps and step % self.save_every_n_steps == 0
        # Saved at an epoch's last batch (not after the loop) so that a resume finds the data
        # iterator and the random state in the same order as the uninterrupted run.
        epoch_done = self.batches_run_in_epoch == self.batches_per_epoch
        every_n_epochs = (self.save_every_n_epochs and epoch_done
                          and (self.epochs_run + 1) % self.save_every_n_epochs == 0)
        return bool(every_n_steps or every_n_epochs)

    def saved(self, step: int) -> None:
        self.last_saved_step = step

    def state_dict(self) -> Dict[str, Any]:
        state = {"steps_run": self.steps_run, "epochs_run": self.epochs_run,
                 "batches_run_in_epoch": self.batches_run_in_epoch, "value_pretrain": self.value_pretrain.state_dict()}
        if self.data_identity is not None:  # checked on resume, by the preflight; never restored
            state["data_identity"] = self.data_identity
        if self.evaluation.history:
            state["evaluation"] = self.evaluation.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a checkpoint's counters; the run is then saved at its step."""
        self.steps_run, self.epochs_run = int(state["steps_run"]), int(state["epochs_run"])
        self.batches_run_in_epoch = int(state["batches_run_in_epoch"])
        self.value_pretrain.load_state_dict(state.get("value_pretrain"), ppo_steps_run=self.steps_run)
        self.evaluation.load_state_dict(state.get("evaluation"))
        self.last_saved_step = self.global_step
