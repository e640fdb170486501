"""What the recipe does around an evaluation that fails, is killed or is resumed, without a model:
the recipe's ``train`` on stand-ins for its steps, evaluations and checkpoints (the order of
saves and evaluations, and what a failure saves and says), the evaluator's ``eval.on_error``,
the record of an evaluation kept beside its checkpoint, and what a resumed run with nothing left
to train says."""

import json
import logging
import types

import pytest
import torch

from torchtune_ppo import distributed
from torchtune_ppo.checkpointing import store as ckpt
from torchtune_ppo.eval import EvalRecord, Evaluator
from torchtune_ppo.ppo.value_pretrain import ValuePretraining
from torchtune_ppo.run.guards import StepInProgress
from torchtune_ppo.run.progress import Progress
from torchtune_ppo.run.watch import run_summary

LOG = logging.getLogger("test_evaluation_failures")
VP = ValuePretraining(max_steps=0, tolerance=None, window=5, lmbda=1.0)  # no value pretraining
METRICS = {"scores": 0.0, "kl": 0.0, "time/generate": 0.0}  # what the progress bar reads


# ----------------------------------------------------------------------------- the recipe on stand-ins


class _Checkpoints:
    """The recipe's CheckpointClient: each save and each evaluation recorded in a saved step."""

    def __init__(self, events):
        self.events = events

    def save(self, step, progress, rng=None, final=False):
        self.events.append(("save", step))
        return f"step_{step}"

    def record_evaluation(self, step, evaluation):
        self.events.append(("record", step, [h["step"] for h in evaluation["history"]]))

    def capture_rng(self):
        return "rng"

    def restore_pending_rng(self):
        pass


def _recipe(tmp_path, events, evaluate, *, num_ppo_steps=4, save_every_n_steps=100, patience=None,
            on_error="stop", state=None):
    """``PPOFullFinetuneRecipe`` with its steps, evaluations and checkpoints stood in for: a step
    begins and reaches its update as the real one does; ``evaluate(step)`` gives the ``val/x``
    metrics or raises; every event lands in ``events``. ``state``: a saved progress to resume."""
    from ppo_full_finetune import PPOFullFinetuneRecipe

    recipe = PPOFullFinetuneRecipe.__new__(PPOFullFinetuneRecipe)
    block = {"every_n_steps": 2, "before_training": False, "best_metric": "val/x", "best_mode": "max",
             "early_stop_patience": patience}
    recipe._progress = Progress(num_ppo_steps=num_ppo_steps, batches_per_epoch=num_ppo_steps, value_pretrain=VP,
                                save_every_n_steps=save_every_n_steps, evaluation=block)
    if state is not None:
        recipe._progress.load_state_dict(state)
    evaluator = Evaluator(None, None, None, recipe._progress.evaluation, log=LOG,
                          **({} if on_error == "stop" else {"on_error": on_error}))  # the default left to it
    evaluator.evaluate = lambda step: events.append(("evaluate", step)) or evaluate(step)
    recipe._evaluator, recipe._checkpoints = evaluator, _Checkpoints(events)
    recipe._step = StepInProgress(recipe._checkpoints.capture_rng)
    recipe._is_rank_zero, recipe._world_size, recipe._output_dir = True, 1, str(tmp_path)
    recipe._device = torch.device("cpu")
    recipe._score_history, recipe._log_every_n_steps = [], 1
    recipe._profiler = types.SimpleNamespace(start=lambda: None, stop=lambda: None, step=lambda: None)
    recipe._metric_logger = types.SimpleNamespace(log_dict=lambda metrics, step: None)
    recipe._recompiles = types.SimpleNamespace(marked=True, mark=lambda: None)
    recipe._sampler = types.SimpleNamespace(set_epoch=lambda epoch: None)
    batch = {"tokens": torch.zeros(1, 2, dtype=torch.long), "prompt_lens": torch.ones(1), "num_truncated": 0}
    recipe._dataloader = [batch] * num_ppo_steps

    def train_step(tokens, prompt_lens, num_truncated, references=None):
        recipe._step.begin()
        recipe._step.update_begins()
        events.append(("step", recipe._progress.steps_run + 1))
        return dict(METRICS)

    recipe.train_step = train_step
    return recipe


def _values(by_step):
    return lambda step: {"val/x": by_step[step]}


def test_a_due_checkpoint_is_written_before_its_steps_evaluation_which_is_then_recorded_in_it(tmp_path):
    """``save_every_n_steps=2`` and an evaluation every 2 steps: each due checkpoint comes before
    the evaluation of its step (a kill during the evaluation keeps it), and that evaluation is
    recorded in it afterwards (a resume from it does not evaluate again)."""
    events = []
    _recipe(tmp_path, events, _values({2: 0.5, 4: 0.25}), save_every_n_steps=2).train()
    assert events == [("step", 1), ("step", 2), ("save", 2), ("evaluate", 2), ("record", 2, [2]),
                      ("step", 3), ("step", 4), ("save", 4), ("evaluate", 4), ("record", 4, [2, 4])]


def test_the_last_steps_checkpoint_is_written_before_its_evaluation_and_a_new_best_is_saved_after_it(tmp_path):
    events = []
    _recipe(tmp_path, events, _values({2: 0.5, 4: 0.25, 5: 0.125}), num_ppo_steps=5).train()
    # step 2: a new best, saved after its evaluation; step 5, the last: saved first, then evaluated
    assert events == [("step", 1), ("step", 2), ("evaluate", 2), ("save", 2), ("step", 3), ("step", 4),
                      ("evaluate", 4), ("step", 5), ("save", 5), ("evaluate", 5), ("record", 5, [2, 4, 5])]


def _fails_at(step):
    def evaluate(s):
        if s == step:
            raise ZeroDivisionError("the evaluation's reward failed")
        return {"val/x": float(s)}
    return evaluate


def test_a_failing_evaluation_saves_the_completed_step_and_is_named_as_the_evaluations(tmp_path, caplog):
    """Steps 1 and 2 complete, nothing due for saving, the evaluation after step 2 raises: step 2
    is saved (with the random states of when the evaluation began), and the message names the
    evaluation, not a step 3 that never began."""
    events = []
    recipe = _recipe(tmp_path, events, _fails_at(2))
    with caplog.at_level(logging.ERROR), pytest.raises(ZeroDivisionError):
        recipe.train()
    assert events == [("step", 1), ("step", 2), ("evaluate", 2), ("save", 2)]
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert message.startswith(
        "PPO evaluation after step 2 failed (ZeroDivisionError: the evaluation's reward failed); the state after "
        "step 2 is saved to step_2. A resumed run evaluates step 2 again first. With eval.on_error=skip an "
        "evaluation that fails is logged and training goes on. To continue: tune run ")
    assert message.endswith(f"output_dir={tmp_path} resume_from_checkpoint=True")
    assert recipe._progress.evaluation.history == []  # the failed evaluation is not in the saved record


def test_a_failing_evaluation_of_a_saved_step_saves_nothing_more(tmp_path, caplog):
    events = []
    with caplog.at_level(logging.ERROR), pytest.raises(ZeroDivisionError):
        _recipe(tmp_path, events, _fails_at(2), save_every_n_steps=2).train()
    assert events == [("step", 1), ("step", 2), ("save", 2), ("evaluate", 2)]
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "PPO evaluation after step 2 failed" in message and "the state after step 2 is already saved" in message


def test_under_on_error_skip_a_failing_evaluation_is_logged_and_training_goes_on(tmp_path, caplog):
    events = []
    with caplog.at_level(logging.WARNING):
        recipe = _recipe(tmp_path, events, _fails_at(2), on_error="skip")
        recipe.train()
    assert events == [("step", 1), ("step", 2), ("evaluate", 2), ("step", 3), ("step", 4), ("save", 4),
                      ("evaluate", 4), ("record", 4, [4])]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and "evaluation" in r.getMessage()]
    assert warning.getMessage().startswith(
        "The evaluation after step 2 failed (ZeroDivisionError: the evaluation's reward failed). "
        "eval.on_error=skip: training goes on without it")
    assert warning.exc_info is not None  # the first failure's traceback, for its cause
    assert [h["step"] for h in recipe._progress.evaluation.history] == [4]


# ----------------------------------------------------------------------------- the evaluator's eval.on_error


def _evaluator(on_error, fails=True):
    record = EvalRecord(every_n_steps=2, before_training=False, best_metric="val/x")
    ev = Evaluator(None, None, None, record, log=LOG, on_error=on_error)

    def evaluate(step):
        if fails:
            raise RuntimeError(f"no score at step {step}")
        return {"val/x": 1.0}

    ev.evaluate = evaluate
    return ev


def _at(step):
    return types.SimpleNamespace(global_step=step, all_steps_run=False)


def test_an_evaluation_that_raises_raises_by_default(caplog):
    ev = _evaluator("stop")
    with pytest.raises(RuntimeError, match="no score at step 2"):
        ev.when_due(_at(2))
    assert ev.record.history == [] and ev.due(_at(2))  # still due: a resume evaluates it again


def test_skip_leaves_the_evaluation_out_with_a_warning_on_one_process_and_raises_on_several(caplog, monkeypatch):
    ev = _evaluator("skip")
    with caplog.at_level(logging.WARNING):
        assert ev.when_due(_at(2)) is False and ev.when_due(_at(4)) is False
    messages = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.getMessage().split(" failed (")[0] for m in messages] == [
        "The evaluation after step 2", "The evaluation after step 4"]
    assert "RuntimeError: no score at step 4" in messages[1].getMessage() and "so far: 2" in messages[1].getMessage()
    assert messages[0].exc_info is not None and messages[1].exc_info is None  # the traceback once
    assert ev.record.history == [] and ev.failed == 2
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(RuntimeError):  # the other processes may wait in a collective
        ev.when_due(_at(6))


def test_on_error_takes_stop_or_skip_only():
    with pytest.raises(ValueError, match=r"eval.on_error must be one of \['stop', 'skip'\], got 'ignore'"):
        Evaluator(None, None, None, EvalRecord(), on_error="ignore")


def test_on_error_is_a_config_key_that_defaults_to_stop():
    from torchtune_ppo.config.schema import EVAL

    (key,) = [k for k in EVAL.keys if k.name == "on_error"]
    assert key.default == "stop" and key.kind.options == ("stop", "skip")


# ----------------------------------------------------------------------------- the record beside a checkpoint


def _complete_folder(root, step, evaluation):
    """A complete ``step_<step>`` folder (marker, a weight file) whose training state holds ``evaluation``."""
    folder = root / ckpt.CHECKPOINTS_DIRNAME / f"step_{step}"
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "model-00001-of-00001.safetensors").write_bytes(b"weights")
    torch.save({"steps_run": step, "evaluation": evaluation}, folder / ckpt.TRAINING_STATE_FNAME)
    ckpt._write_marker(folder, step)
    return folder


def _record_after(values):
    record = EvalRecord(every_n_steps=2, best_metric="val/x")
    for step, v in values:
        record.add(step, {"val/x": v})
    return record.state_dict()


def test_an_evaluation_recorded_after_its_checkpoint_is_read_back_in_place_of_the_saved_record(tmp_path, caplog):
    before, after = _record_after([(2, 0.5)]), _record_after([(2, 0.5), (4, 0.75)])
    folder = _complete_folder(tmp_path, 4, before)
    assert ckpt.load_training_state(folder)["evaluation"] == before  # killed during the evaluation: none
    ckpt.write_evaluation(folder, after)
    assert ckpt.load_training_state(folder)["evaluation"] == after
    assert ckpt._invalid_reason(folder, verify=True) is None  # the folder stays complete and verified
    with pytest.raises(ValueError, match="must end with the evaluation of step 4"):
        ckpt.write_evaluation(folder, before)
    # one of another step (a copied folder) is named and left out: the resumed run evaluates again
    (folder / ckpt.EVALUATION_FNAME).write_text(json.dumps({"step": 2, "evaluation": before}))
    with caplog.at_level(logging.WARNING):
        assert ckpt.load_training_state(folder)["evaluation"] == before
    assert any("evaluates step 4 again" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- nothing left to train


def test_a_resumed_run_that_stopped_early_says_where_why_and_what_to_change(tmp_path, caplog):
    events = []
    first = _recipe(tmp_path, events, _values({2: 1.0, 4: 0.5}), num_ppo_steps=8, patience=1)
    first.train()
    assert events[-2:] == [("evaluate", 4), ("save", 4)] and first._progress.done  # stopped at step 4 of 8
    state = first._progress.state_dict()
    with caplog.at_level(logging.INFO):
        _recipe(tmp_path, events, _values({}), num_ppo_steps=8, patience=1, state=state).train()
    summary = caplog.records[-1].getMessage()
    assert summary.startswith(
        "Nothing to train: this run stopped early after step 4 (4 of its num_ppo_steps=8 PPO steps): 1 evaluation in "
        "a row without a better val/x than the best, 1 at step 2 (eval.early_stop_patience=1). To train on from "
        "step 4, resume with an eval.early_stop_patience above 1, or null.")
    assert "No step was logged" not in summary


def test_a_resumed_run_that_ran_all_its_steps_says_so_and_what_to_change():
    progress = Progress(num_ppo_steps=3, batches_per_epoch=3, value_pretrain=VP)
    assert progress.nothing_to_train() is None
    progress.load_state_dict({"steps_run": 3, "epochs_run": 1, "batches_run_in_epoch": 0})
    note = progress.nothing_to_train()
    assert note == ("Nothing to train: this run has run all 3 of its num_ppo_steps=3 PPO steps (step 3). "
                    "To train on, resume with a num_ppo_steps above 3.")
    assert run_summary([], [], None, note) == note
