"""A run survives what goes wrong: resume is exact, crashes and signals never lose a checkpoint,
non-finite values never reach the weights, and misconfigured runs stop before doing harm.

Runs go through `tune run` in subprocesses where the process boundary matters (resume, SIGKILL,
SIGINT/SIGTERM) and in-process where faults are injected by wrapping the recipe's
``_rollout``, ``estimate_advantages`` and ``_ppo_loss_step``. Every run uses a small shape and
20 prompts, so an epoch is 2 batches and the data position rolls over epochs within a few steps.

The compiled resume test compiles in 3 processes (~1-2 min each on 2 CPU cores, less with the
shared inductor cache); deselect it with ``-k "not compiled"``.
"""

import collections
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune import config, training

import torchtune_ppo
from torchtune_ppo.checkpointing import store as checkpointing
from torchtune_ppo.config import validate_config
from torchtune_ppo.run.interrupt import stop_on_signals
from torchtune_ppo.run.logs import read_disk_log
from torchtune_ppo.tasks.tiny_sentiment import POLICY_DIMS, REWARD_DIMS

from conftest import ROOT, TUNE
from conftest import SMALL as SHAPE  # 4 optimizer updates a step
from conftest import TINY_CONFIG as CONFIG
# Keep every checkpoint so runs can be compared at each saved step.
SAVE_EVERY_2 = ["save_every_n_steps=2", "keep_last_n_checkpoints=null"]
CRASH_ENV = "TORCHTUNE_PPO_CRASH_DURING_SAVE"
SUBPROCESS_TIMEOUT = 900
COMPILED_TIMEOUT = 1800


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """The first 20 prompts of the tiny task: 2 batches of 8 per epoch (the last 4 dropped)."""
    with open(torchtune_ppo.asset_path("tiny_sentiment/prompts.json")) as f:
        records = json.load(f)
    path = tmp_path_factory.mktemp("data") / "prompts.json"
    path.write_text(json.dumps(records[:20]))
    return path


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    if CRASH_ENV not in extra:
        env.pop(CRASH_ENV, None)
    return env


def _cmd(out, prompts, *overrides):
    return [*TUNE, "run", "ppo_full_finetune", "--config", str(CONFIG), f"output_dir={out}",
            *SHAPE, f"dataset.data_files={prompts}", *overrides]


def _show(proc, cmd):
    return f"{shlex.join(map(str, cmd))}\nrc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"


def _tune(out, prompts, *overrides, rc=0, env=None, timeout=SUBPROCESS_TIMEOUT):
    cmd = _cmd(out, prompts, *overrides)
    proc = subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == rc, _show(proc, cmd)
    return proc


def _newest_log(out):
    files = list((Path(out) / "logs").glob("log_*.txt"))
    return max(files, key=lambda f: f.stat().st_mtime) if files else None


def _logged(out):
    """``{step: metrics}`` of the newest run in ``out`` (a resumed run writes its own file)."""
    rows = read_disk_log(Path(out) / "logs")
    steps = [int(line.split(" | ", 1)[0].split()[1])
             for line in _newest_log(out).read_text().splitlines() if line.startswith("Step ")]
    assert len(steps) == len(rows)
    return dict(zip(steps, rows))


def _timing(key):
    # Wall-clock metrics: phase times and throughputs.
    return key.startswith("time/") or "per_second" in key


def _assert_same_metrics(got, want, step):
    keys = {k for k in want if not _timing(k)}
    assert {"scores", "loss", "policy_loss", "value_loss", "kl", "ratios", "clipfrac",
            "approx_policy_kl", "response_lengths", "skipped_steps"} <= keys
    assert keys == {k for k in got if not _timing(k)}, step
    for k in sorted(keys):
        same = got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k]))
        assert same, f"step {step}: {k} = {got[k]!r}, uninterrupted run has {want[k]!r}"


def _step_dir(out, step):
    return Path(out) / checkpointing.CHECKPOINTS_DIRNAME / f"step_{step}"


def _saved_steps(out):
    root = Path(out) / checkpointing.CHECKPOINTS_DIRNAME
    return sorted(int(p.name[5:]) for p in root.glob("step_*")) if root.is_dir() else []


def _weights(step_dir):
    """``{"policy/<key>": tensor, "value/<key>": tensor}`` from a checkpoint's safetensors."""
    out = {}
    for model in checkpointing.MODEL_NAMES:
        files = sorted((Path(step_dir) / model).glob("*.safetensors"))
        assert files, f"no safetensors in {step_dir / model}"
        for f in files:
            out.update({f"{model}/{k}": v for k, v in load_file(f).items()})
    return out


def _assert_same_tensors(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k}"


def _assert_same_state(got, want, path="training_state"):
    """Recursive exact equality of nested dicts/lists/tuples of tensors and Python values."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            _assert_same_state(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_state(g, w, f"{path}[{i}]")
    elif torch.is_tensor(want):
        assert torch.is_tensor(got) and torch.equal(got, want), path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def _assert_checkpoint_finite(step_dir):
    for k, t in _weights(step_dir).items():
        assert torch.isfinite(t).all(), f"{step_dir}: {k} is not finite"
    state = checkpointing.load_training_state(step_dir)
    for t in _tensors_in(state["optimizer"]):
        if t.is_floating_point():
            assert torch.isfinite(t).all(), f"{step_dir}: optimizer state is not finite"


def _files(root):
    """``{relative path: (size, mtime_ns, bytes)}`` of every file under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- in-process recipe


def _build(out, prompts, *overrides, policy_model=None, reward_and_value_model=None):
    """The recipe set up in this process, as ``recipe_main`` does (minus the CLI checks)."""
    from ppo_full_finetune import PPOFullFinetuneRecipe

    cfg = OmegaConf.load(CONFIG)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(
        [f"output_dir={out}", *SHAPE, f"dataset.data_files={prompts}", *overrides]))
    if policy_model is not None:
        cfg.policy_model = OmegaConf.create(policy_model)
    if reward_and_value_model is not None:
        cfg.reward_and_value_model = OmegaConf.create(reward_and_value_model)
    cfg = validate_config(cfg)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    return recipe


def _params(recipe):
    return {f"{m}/{k}": p.detach().clone()
            for m, model in (("policy", recipe._models.policy), ("value", recipe._models.value))
            for k, p in model.named_parameters()}


def _same_params(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose backward blows up."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _record_updates(recipe):
    """Wrap the update's optimizer step: ``[(step, applied, weights_changed)]`` for every
    minibatch update."""
    updates = []
    step_fn = recipe._update._optimizer_step

    def optimizer_step(minibatch_stats, step, *args):
        before = _params(recipe)
        applied = step_fn(minibatch_stats, step, *args)
        updates.append((recipe._progress.steps_run + 1, applied, not _same_params(before, _params(recipe))))
        return applied

    recipe._update._optimizer_step = optimizer_step
    return updates


def _nonfinite_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "finite" in r.getMessage()]


# ----------------------------------------------------------------------------- exact resume


@pytest.fixture(scope="module")
def straight(tmp_path_factory, prompts):
    """6 uninterrupted eager steps (3 epochs), checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _tune(out, prompts, "num_ppo_steps=6", *SAVE_EVERY_2)
    assert _saved_steps(out) == [2, 4, 6]
    return out


def test_eager_resume_mid_epoch_repeats_the_uninterrupted_run(tmp_path, prompts, straight):
    out = tmp_path / "run"
    _tune(out, prompts, "num_ppo_steps=3", *SAVE_EVERY_2)
    first = _logged(out)
    assert sorted(first) == [1, 2, 3]
    # 2 batches an epoch: step 3 is the first batch of epoch 1, so the run stops mid-epoch.
    assert _saved_steps(out) == [2, 3]

    proc = _tune(out, prompts, "num_ppo_steps=6", *SAVE_EVERY_2, "resume_from_checkpoint=True")
    assert f"Resuming from {_step_dir(out, 3)}" in proc.stderr
    resumed = _logged(out)
    assert sorted(resumed) == [4, 5, 6]
    assert _saved_steps(out) == [2, 3, 4, 6]

    reference = _logged(straight)
    for step in (1, 2, 3):
        _assert_same_metrics(first[step], reference[step], step)
    for step in (4, 5, 6):
        _assert_same_metrics(resumed[step], reference[step], step)
    for step in (2, 4, 6):
        _assert_same_tensors(_weights(_step_dir(out, step)), _weights(_step_dir(straight, step)),
                             f"weights at step {step}")
    _assert_same_state(checkpointing.load_training_state(_step_dir(out, 6)),
                       checkpointing.load_training_state(_step_dir(straight, 6)))
    # Not vacuous: the resumed steps trained.
    at3, at6 = _weights(_step_dir(out, 3)), _weights(_step_dir(out, 6))
    assert any(not torch.equal(at3[k], at6[k]) for k in at3 if k.startswith("policy/"))
    assert any(not torch.equal(at3[k], at6[k]) for k in at3 if k.startswith("value/"))


def test_compiled_resume_repeats_the_uninterrupted_run(tmp_path_factory, prompts):
    """compile=True, resumed in a new process: the same metrics, weights and state as the
    uninterrupted compiled run, and 0 recompiles. The regions are traced by dynamo and run on
    its ``eager`` backend (TORCHTUNE_PPO_COMPILE_BACKEND, tests only): dynamo's guards, the
    static shapes and the compiled code paths are the ones inductor gets, without its ~2-4 min
    of compiling in each of the 3 processes; inductor's own numbers are compared with eager in
    e2e/test_recipe.py."""
    base = tmp_path_factory.mktemp("compiled")
    env = _env(TORCHTUNE_PPO_COMPILE_BACKEND="eager")
    args = dict(env=env, timeout=COMPILED_TIMEOUT)
    straight_out, out = base / "straight", base / "resumed"
    _tune(straight_out, prompts, "num_ppo_steps=4", "compile=True", *SAVE_EVERY_2, **args)
    _tune(out, prompts, "num_ppo_steps=2", "compile=True", *SAVE_EVERY_2, **args)
    first = _logged(out)
    proc = _tune(out, prompts, "num_ppo_steps=4", "compile=True", *SAVE_EVERY_2,
                 "resume_from_checkpoint=True", **args)
    assert f"Resuming from {_step_dir(out, 2)}" in proc.stderr
    assert "generate=True, trajectory=True, loss_step=True" in proc.stderr
    resumed = _logged(out)
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]

    reference = _logged(straight_out)
    for step, row in {**first, **resumed}.items():
        _assert_same_metrics(row, reference[step], step)
        assert row["recompiles"] == 0, step
    for step in (2, 4):
        _assert_same_tensors(_weights(_step_dir(out, step)), _weights(_step_dir(straight_out, step)),
                             f"weights at step {step}")
    _assert_same_state(checkpointing.load_training_state(_step_dir(out, 4)),
                       checkpointing.load_training_state(_step_dir(straight_out, 4)))


# ----------------------------------------------------------------------------- SIGKILL mid-save


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, prompts):
    """A finished 2-step run (one full epoch) with its checkpoint at step 2."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    _tune(out, prompts, "num_ppo_steps=2", "save_every_n_steps=2")
    assert _saved_steps(out) == [2]
    return out


@pytest.mark.parametrize("point", ["after_policy", "before_rename"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, prompts, two_steps, straight, point):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    step2 = _step_dir(out, 2)
    step2_files = _files(step2)

    # Resumed from step 2, trains steps 3 and 4, and is killed while saving step 4.
    proc = _tune(out, prompts, "num_ppo_steps=4", "save_every_n_steps=2", "resume_from_checkpoint=True",
                 rc=-signal.SIGKILL, env=_env(**{CRASH_ENV: point}))
    assert sorted(_logged(out)) == [3, 4]
    root = out / checkpointing.CHECKPOINTS_DIRNAME
    leftovers = [p for p in root.iterdir() if p.name != "step_2"]
    assert [p.name.rsplit("_", 1)[0] for p in leftovers] == [".tmp_step_4"], leftovers
    (tmp,) = leftovers
    if point == "after_policy":
        assert (tmp / "policy").is_dir() and not (tmp / "value").exists()
        assert not (tmp / checkpointing.MARKER_FNAME).exists()
    else:  # everything written, marker included; only the rename into place is missing
        assert {p.name for p in tmp.iterdir()} == {
            "policy", "value", checkpointing.TRAINING_STATE_FNAME, "config.yaml", checkpointing.MARKER_FNAME}
    assert _files(step2) == step2_files
    assert checkpointing.latest_checkpoint(out) == step2
    assert checkpointing.load_training_state(step2)["steps_run"] == 2

    # A resume without the hook starts again from step 2 and repeats the uninterrupted run.
    proc = _tune(out, prompts, "num_ppo_steps=4", "save_every_n_steps=2", "resume_from_checkpoint=True")
    assert f"Resuming from {step2}" in proc.stderr
    resumed = _logged(out)
    assert sorted(resumed) == [3, 4]
    reference = _logged(straight)
    for step in (3, 4):
        _assert_same_metrics(resumed[step], reference[step], step)
    _assert_same_tensors(_weights(_step_dir(out, 4)), _weights(_step_dir(straight, 4)), "step 4")
    assert checkpointing.latest_checkpoint(out) == _step_dir(out, 4)
    # The dead process's temporary folder is gone after the next completed save.
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]


# ----------------------------------------------------------------------------- non-finite values


def test_nonfinite_score_loss_and_gradient_skip_only_their_update(tmp_path, prompts, caplog, monkeypatch):
    out = tmp_path / "run"
    # Skips at steps 2, 4 and 6 never come two in a row: with the limit at 2 the run must finish.
    recipe = _build(out, prompts, "num_ppo_steps=6", *SAVE_EVERY_2, "max_consecutive_skipped_steps=2")
    updates = _record_updates(recipe)

    rollout = recipe._rollout

    def rollout_with_nan(*args, **kwargs):
        trajectory = rollout(*args, **kwargs)
        if recipe._progress.steps_run + 1 == 2:
            scores = trajectory.scores.clone()
            scores[5] = float("nan")
            trajectory = trajectory._replace(scores=scores)
        return trajectory

    import ppo_full_finetune

    estimate_advantages = ppo_full_finetune.estimate_advantages

    def advantages_with_nan(*args, **kwargs):
        adv = estimate_advantages(*args, **kwargs)
        if recipe._progress.steps_run + 1 == 4:
            # One row's advantages: the one minibatch holding it in each PPO epoch has a NaN loss.
            advantages = adv.advantages.clone()
            advantages[3] = float("nan")
            adv = adv._replace(advantages=advantages)
        return adv

    loss_step = recipe._update.loss_step
    calls = collections.Counter()

    def loss_step_with_nan_gradient(*args, **kwargs):
        step = recipe._progress.steps_run + 1
        calls[step] += 1
        loss, stats, pi_logprobs = loss_step(*args, **kwargs)
        if step == 6 and calls[step] == 1:  # first minibatch of step 6: finite loss, NaN gradients
            loss = _NanGrad.apply(loss)
        return loss, stats, pi_logprobs

    recipe._rollout = rollout_with_nan
    monkeypatch.setattr(ppo_full_finetune, "estimate_advantages", advantages_with_nan)
    recipe._update.loss_step = loss_step_with_nan_gradient

    metrics, weights = {}, {0: _params(recipe)}

    def on_step(step, m):
        metrics[step] = m
        weights[step] = _params(recipe)

    with caplog.at_level(logging.WARNING):
        try:
            recipe.train(on_step)
        finally:
            recipe.cleanup()

    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    # No loss step at all for the step whose batch had a NaN score.
    assert sorted(calls) == [1, 3, 4, 5, 6]
    # Every minibatch update, in order: skipped ones leave the weights as they were.
    assert [s for s, _, _ in updates] == [1] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [6] * 4
    applied = {s: [a for t, a, _ in updates if t == s] for s in (1, 3, 4, 5, 6)}
    assert applied[1] == applied[3] == applied[5] == [True] * 4
    # Step 4: 2 PPO epochs of 2 minibatches; the NaN row is in one minibatch of each epoch.
    assert sorted(applied[4][:2]) == sorted(applied[4][2:]) == [False, True]
    assert applied[6] == [False, True, True, True]
    assert [changed for _, _, changed in updates] == [applied for _, applied, _ in updates]
    assert _same_params(weights[2], weights[1])  # the NaN-score step changed nothing
    for step in (1, 3, 4, 5, 6):
        assert not _same_params(weights[step], weights[step - 1]), step
    for step, w in weights.items():
        assert all(torch.isfinite(t).all() for t in w.values()), step

    got = {s: (m["nonfinite_score_rows"], m["skipped_updates"], m["skipped_steps"])
           for s, m in metrics.items()}
    assert got == {1: (0, 0, 0), 2: (1, 4, 1), 3: (0, 0, 1), 4: (0, 2, 2), 5: (0, 0, 2), 6: (0, 1, 3)}
    assert math.isnan(metrics[2]["loss"])  # no update applied in step 2
    assert all(math.isfinite(metrics[s]["loss"]) for s in (1, 3, 4, 5, 6))
    # Only applied updates reach the optimizer: 4 + 0 + 4 + 2 + 4 + 3.
    adam_steps = {float(s["step"]) for s in recipe._update.optimizer.state_dict()["state"].values()}
    assert adam_steps == {17.0}

    warnings = _nonfinite_warnings(caplog)
    assert len(warnings) == 4, warnings
    assert warnings[0] == "step 2: the reward is not finite in 1 of 8 rows; the update is skipped."
    for w in warnings[1:3]:
        assert w.startswith("step 4: non-finite loss (loss nan, grad norm "), w
    assert warnings[3].startswith("step 6: non-finite gradient norm (loss "), warnings[3]
    assert warnings[3].endswith("grad norm nan); this minibatch update is skipped."), warnings[3]

    assert _saved_steps(out) == [2, 4, 6]
    for step in (2, 4, 6):
        _assert_checkpoint_finite(_step_dir(out, step))
    logged = _logged(out)
    assert [logged[s]["skipped_steps"] for s in range(1, 7)] == [0, 1, 1, 2, 2, 3]


def test_logged_score_of_a_step_with_a_nan_row_is_the_mean_of_its_finite_rows(tmp_path, prompts):
    recipe = _build(tmp_path / "run", prompts, "num_ppo_steps=1")
    rollout, scores = recipe._rollout, []

    def rollout_with_nan(*args, **kwargs):
        trajectory = rollout(*args, **kwargs)
        scores.append(trajectory.scores.clone())
        scores[0][5] = float("nan")
        return trajectory._replace(scores=scores[0].clone())

    recipe._rollout = rollout_with_nan
    metrics = {}
    try:
        recipe.train(lambda step, m: metrics.update(m))
    finally:
        recipe.cleanup()
    finite = scores[0][torch.isfinite(scores[0])]
    assert len(finite) == 7 and metrics["nonfinite_score_rows"] == 1
    assert metrics["scores"] == pytest.approx(float(finite.mean()), rel=1e-6)


def test_consecutive_nonfinite_scores_stop_the_run(tmp_path, prompts, caplog):
    out = tmp_path / "run"
    recipe = _build(out, prompts, "num_ppo_steps=10", "save_every_n_steps=1",
                    "keep_last_n_checkpoints=null", "max_consecutive_skipped_steps=3")
    rollout = recipe._rollout

    def rollout_with_nan(*args, **kwargs):
        trajectory = rollout(*args, **kwargs)
        return trajectory._replace(scores=torch.full_like(trajectory.scores, float("nan")))

    recipe._rollout = rollout_with_nan
    initial = _params(recipe)
    steps = []
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as err:
        try:
            recipe.train(lambda step, m: steps.append(step))
        finally:
            recipe.cleanup()
    assert "3 consecutive steps" in str(err.value)
    assert "max_consecutive_skipped_steps=3" in str(err.value)
    assert "resume_from_checkpoint=True" in str(err.value)
    # The third skipped step raises before it counts as run or is saved.
    assert steps == [1, 2] and recipe._progress.steps_run == 2
    assert _nonfinite_warnings(caplog) == [
        f"step {s}: the reward is not finite in 8 of 8 rows; the update is skipped." for s in (1, 2, 3)]
    assert _same_params(_params(recipe), initial)
    assert _saved_steps(out) == [1, 2]
    for step in (1, 2):
        _assert_checkpoint_finite(_step_dir(out, step))


def test_diverging_learning_rate_stops_with_finite_checkpoints(tmp_path, prompts, caplog):
    out = tmp_path / "run"
    recipe = _build(out, prompts, "num_ppo_steps=20", "save_every_n_steps=1",
                    "keep_last_n_checkpoints=null", "optimizer.lr=1e3")
    steps = []
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="max_consecutive_skipped_steps=3"):
        try:
            recipe.train(lambda step, m: steps.append(step))
        finally:
            recipe.cleanup()
    assert steps and steps[-1] < 20
    assert _nonfinite_warnings(caplog)
    assert _saved_steps(out) == steps
    for step in steps:
        _assert_checkpoint_finite(_step_dir(out, step))


# ----------------------------------------------------------------------------- SIGINT / SIGTERM


def _signal_self(sig, until=lambda: False, seconds=2.0):
    """Send ``sig`` to this process, then wait in short sleeps (between which Python runs
    signal handlers, whichever thread the signal reached) until ``until()`` or ``seconds``."""
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_first_signal_asks_to_stop_a_second_stops_at_once(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals() as stop:
        assert not stop
        _signal_self(sig, until=lambda: bool(stop))
        assert stop and stop.signum == sig  # no exception: the step goes on
        if sig == signal.SIGINT:
            with pytest.raises(KeyboardInterrupt):
                _signal_self(sig)  # raises from inside the wait
                pytest.fail("the second SIGINT did not interrupt")
        else:
            # Sending it would end this process: the second SIGTERM gets the default action.
            assert signal.getsignal(sig) is signal.SIG_DFL
    assert {s: signal.getsignal(s) for s in before} == before


def test_second_sigint_stops_the_run_without_finishing_the_step_or_saving(tmp_path, prompts):
    # Both signals arrive during step 2 (in on_step, before the step's stop check and save).
    out = tmp_path / "run"
    recipe = _build(out, prompts, "num_ppo_steps=6", "save_every_n_steps=1000")
    steps, before = [], signal.getsignal(signal.SIGINT)

    def on_step(step, metrics):
        steps.append(step)
        if step == 2:
            _signal_self(signal.SIGINT, seconds=0.3)  # asks to stop after this step
            _signal_self(signal.SIGINT, seconds=10)  # stops now

    try:
        with pytest.raises(KeyboardInterrupt):
            recipe.train(on_step)
    finally:
        recipe.cleanup()
    assert steps == [1, 2]
    # Nothing saved: not the step the signals came in, not a final checkpoint.
    assert checkpointing.existing_checkpoints(out) == []
    assert signal.getsignal(signal.SIGINT) is before


def _wait_for_steps(out, n, proc):
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT  # only a guard against hanging
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run exited (rc={proc.returncode}) before step {n}"
        log = _newest_log(out)
        if log is not None and sum(l.startswith("Step ") for l in log.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    pytest.fail(f"no step {n} logged in {out / 'logs'}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_finishes_the_step_saves_and_resumes(tmp_path, prompts, sig):
    out = tmp_path / "run"
    cmd = _cmd(out, prompts, "num_ppo_steps=200", "save_every_n_steps=1000")
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout, "w") as so, open(stderr, "w") as se:
        # SIGHUP as a closed terminal sends it, not ignored as under a `nohup` test run.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=so, stderr=se,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        try:
            _wait_for_steps(out, 3, proc)
            proc.send_signal(sig)
            rc = proc.wait(timeout=SUBPROCESS_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = stderr.read_text()
    assert rc == 128 + sig, f"rc={rc}\n{err[-6000:]}"

    logged = _logged(out)
    stopped = max(logged)
    assert sorted(logged) == list(range(1, stopped + 1)) and 3 <= stopped < 200
    assert f"{sig.name} received" in err
    assert f"Stopped after step {stopped}." in err
    # The only checkpoint is the one saved on the signal, at the step the run stopped at.
    assert checkpointing.existing_checkpoints(out) == [_step_dir(out, stopped)]
    assert checkpointing.latest_checkpoint(out) == _step_dir(out, stopped)
    assert checkpointing.load_training_state(_step_dir(out, stopped))["steps_run"] == stopped

    # The logged command resumes the run; only num_ppo_steps is added to end it soon.
    (resume,) = re.findall(r"To continue: (tune run .*)$", err, flags=re.M)
    resume = shlex.split(resume)
    assert resume[-2:] == [f"output_dir={out}", "resume_from_checkpoint=True"]
    cmd = [*TUNE, *resume[1:], f"num_ppo_steps={stopped + 2}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, _show(proc, cmd)
    assert f"Resuming from {_step_dir(out, stopped)}" in proc.stderr
    assert sorted(_logged(out)) == [stopped + 1, stopped + 2]
    assert checkpointing.latest_checkpoint(out) == _step_dir(out, stopped + 2)


# ----------------------------------------------------------------------------- refusals


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any checkpointer loads weights."""

    def load_checkpoint(self, *args, **kwargs):
        raise AssertionError(f"weights were loaded from {getattr(self, '_checkpoint_dir', '?')}")

    monkeypatch.setattr(training.FullModelHFCheckpointer, "load_checkpoint", load_checkpoint)


def test_fresh_run_into_a_folder_with_checkpoints_refuses(tmp_path, prompts, straight, no_model_loads):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = _files(out)
    with pytest.raises(FileExistsError) as err:
        _build(out, prompts, "num_ppo_steps=6")
    message = str(err.value)
    assert "resume_from_checkpoint=True" in message
    assert str(_step_dir(out, 2)) in message
    # Nothing in output_dir is touched: same files, bytes and mtimes, no new log or checkpoint.
    assert _files(out) == before


def test_resume_without_a_checkpoint_refuses(tmp_path, prompts, no_model_loads):
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        _build(out, prompts, "num_ppo_steps=6", "resume_from_checkpoint=True")
    assert not out.exists()


LLAMA2 = "torchtune.models.llama2._component_builders.llama2"
LLAMA2_CLASSIFIER = "torchtune.models.llama2._component_builders.llama2_classifier"
SHIPPED = {"checkpointer": ("tiny_sentiment/policy", "LLAMA2"),
           "value_checkpointer": ("tiny_sentiment/reward", "REWARD")}


@pytest.mark.parametrize("model_key,checkpointer_key,builder,dims", [
    ("policy_model", "checkpointer", LLAMA2, POLICY_DIMS),
    ("reward_and_value_model", "value_checkpointer", LLAMA2_CLASSIFIER,
     {**REWARD_DIMS, "num_classes": 1}),
], ids=["policy", "value"])
def test_checkpoint_of_another_model_size_is_named(tmp_path, prompts, model_key, checkpointer_key,
                                                   builder, dims):
    # Half the embedding width of the shipped model (same heads, so the model itself is valid).
    block = {"_component_": builder, **dims, "embed_dim": dims["embed_dim"] // 2}
    with pytest.raises(ValueError) as err:
        _build(tmp_path / "run", prompts, "num_ppo_steps=1", **{model_key: block})
    message = str(err.value)
    m = re.match(r"(\w+): parameter '([\w.]+)' has shape \(([\d, ]+)\) in the checkpoint "
                 r"but \(([\d, ]+)\) in the model", message)
    assert m, message
    key, name, in_checkpoint, in_model = m.groups()
    assert key == checkpointer_key
    # Both shapes as they really are: the shipped checkpoint's and the configured model's.
    asset, model_type = SHIPPED[checkpointer_key]
    shipped = training.FullModelHFCheckpointer(
        checkpoint_dir=torchtune_ppo.asset_path(asset), checkpoint_files=["model.safetensors"],
        model_type=model_type, output_dir=str(tmp_path / "load"),
    ).load_checkpoint()[training.MODEL_KEY]
    with torch.device("meta"):
        model = config.instantiate(OmegaConf.create(block))
    shape = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    assert shape(in_checkpoint) == tuple(shipped[name].shape)
    assert shape(in_model) == tuple(model.state_dict()[name].shape)
    assert shape(in_checkpoint) != shape(in_model)


# ----------------------------------------------------------------------------- an exception in a step


def _train_collecting(recipe):
    metrics = {}
    try:
        recipe.train(lambda step, m: metrics.__setitem__(step, m))
    finally:
        recipe.cleanup()
    return metrics


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory, prompts):
    """5 uninterrupted in-process steps, saved only at the end: metrics and final weights."""
    out = tmp_path_factory.mktemp("five") / "run"
    metrics = _train_collecting(_build(out, prompts, "num_ppo_steps=5", "save_every_n_steps=1000"))
    return out, metrics


def test_exception_in_the_rollout_saves_the_last_completed_step_and_resumes_exactly(
        tmp_path, prompts, five_steps, caplog):
    straight_out, straight_metrics = five_steps
    out = tmp_path / "run"
    recipe = _build(out, prompts, "num_ppo_steps=5", "save_every_n_steps=1000")
    rollout = recipe._rollout

    def reward_raises_at_step_3(*args, **kwargs):
        trajectory = rollout(*args, **kwargs)  # the failed step has drawn its samples
        if recipe._progress.steps_run == 2:
            raise ZeroDivisionError("the reward function failed")
        return trajectory

    recipe._rollout = reward_raises_at_step_3
    metrics = {}
    with caplog.at_level(logging.ERROR), pytest.raises(ZeroDivisionError):
        metrics.update(_train_collecting(recipe))
    assert _saved_steps(out) == [2]
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert message.startswith("PPO step 3 failed (ZeroDivisionError: the reward function failed); "
                              f"the state after step 2 is saved to {_step_dir(out, 2)}. To continue: tune run ")
    assert message.endswith(f"output_dir={out} resume_from_checkpoint=True")

    resumed = _train_collecting(_build(out, prompts, "num_ppo_steps=5", "save_every_n_steps=1000",
                                       "resume_from_checkpoint=True"))
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        _assert_same_metrics(resumed[step], straight_metrics[step], step)
    _assert_same_tensors(_weights(_step_dir(out, 5)), _weights(_step_dir(straight_out, 5)), "final weights")


def test_exception_after_an_optimizer_step_saves_nothing_and_says_why(tmp_path, prompts, caplog):
    out = tmp_path / "run"
    recipe = _build(out, prompts, "num_ppo_steps=5", "save_every_n_steps=1000")
    step_fn = recipe._update._optimizer_step

    def fails_after_stepping(minibatch_stats, step, *args):
        applied = step_fn(minibatch_stats, step, *args)
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return applied

    recipe._update._optimizer_step = fails_after_stepping
    with caplog.at_level(logging.ERROR), pytest.raises(torch.OutOfMemoryError):
        _train_collecting(recipe)
    assert _saved_steps(out) == []
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "PPO step 3 failed (OutOfMemoryError: CUDA out of memory (simulated)); not saved: the failure " \
           "came during the update" in message
    assert "the last checkpoint is of step None" in message


def test_full_disk_at_a_save_stops_cleanly_and_keeps_the_earlier_checkpoint(tmp_path, prompts, caplog, monkeypatch):
    out = tmp_path / "run"
    recipe = _build(out, prompts, "num_ppo_steps=4", "save_every_n_steps=2", "keep_last_n_checkpoints=null")
    save = checkpointing.CheckpointManager.save

    def full_disk_at_step_4(self, step, *args, **kwargs):
        if step == 4:
            monkeypatch.setenv("TORCHTUNE_PPO_FULL_DISK_DURING_SAVE", "1")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpointing.CheckpointManager, "save", full_disk_at_step_4)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        _train_collecting(recipe)
    assert exit_.value.code == 1
    assert _saved_steps(out) == [2]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"Could not write checkpoint {_step_dir(out, 4)}: No space left on device" in message
    assert "earlier checkpoints are kept (step_2)" in message and "resume_from_checkpoint=True" in message


# ----------------------------------------------------------------------------- smaller refusals


def _config(*overrides):
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(["output_dir=/tmp/x", *overrides]))
    return validate_config(cfg, check_machine=False)


@pytest.mark.parametrize("lr", ["nan", "inf", "0", "-1e-5"])
def test_optimizer_lr_must_be_finite_and_positive(lr):
    with pytest.raises(ValueError, match=r"optimizer.lr must be a finite number > 0, got "):
        _config(f"optimizer.lr={lr}")


def test_one_generated_token_with_the_no_stop_penalty_refuses():
    with pytest.raises(ValueError, match=r"max_generated_tokens=1 with penalise_no_eos=True: .* every one "
                                         r"would score reward_penalty \(-3.0\)"):
        _config("max_generated_tokens=1")
    _config("max_generated_tokens=1", "penalise_no_eos=False")


def test_cpu_threads_above_the_cores_are_capped_with_a_warning(caplog):
    from torchtune_ppo.config import cpu_threads

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.WARNING):
        assert cpu_threads(cores + 7) == cores
    assert f"cpu_threads={cores + 7} is more than the {cores} cores" in caplog.text
    assert cpu_threads(cores) == cores


def test_unwritable_output_dir_says_the_path_and_the_os_error(tmp_path, prompts):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run"
    with pytest.raises(checkpointing.CheckpointWriteError,
                       match=rf"output_dir '{re.escape(str(out))}' is not writable: Not a directory"):
        _build(out, prompts, "num_ppo_steps=1")


def test_resume_command_names_output_dir_once():
    from torchtune_ppo.run.interrupt import resume_command

    argv = ["ppo_full_finetune", "--config", "c.yaml", "output_dir=/o", "seed=1", "resume_from_checkpoint=False"]
    assert resume_command(argv, "/o") == ("tune run ppo_full_finetune --config c.yaml seed=1 output_dir=/o "
                                          "resume_from_checkpoint=True")


def test_characters_the_tokenizer_does_not_know_are_warned_once(tmp_path, caplog):
    from torchtune.models.llama2 import llama2_tokenizer

    from torchtune_ppo.config.generation import warn_unknown_tokens

    tokenizer = llama2_tokenizer(torchtune_ppo.asset_path("tiny_sentiment/tokenizer.model"))
    texts = ["the movie was", "a film about 漢字", "great ☃ and ☃"]
    dataset = [{"tokens": tokenizer.encode(t, add_bos=True, add_eos=False)} for t in texts]
    with caplog.at_level(logging.WARNING):
        assert warn_unknown_tokens(dataset, tokenizer) == 3  # 漢字 is one <unk>
    (message,) = [r.getMessage() for r in caplog.records if "unknown token" in r.getMessage()]
    assert message.startswith("dataset: 3 token(s) in 2 of 3 prompts are the tokenizer's unknown token "
                              "(id 0, also the pad id)")
    assert "prompt #1: 'a film about" in message
    caplog.clear()
    assert warn_unknown_tokens(dataset[:1], tokenizer) == 0 and not caplog.records


# ----------------------------------------------------------------------------- a damaged checkpoint


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_resumed_run_repeats_the_uninterrupted_one(
        tmp_path, prompts, straight):
    # The newest checkpoint damaged in place (same size): the resume used to skip it, reach its
    # step again and stop on "refusing to overwrite it", in a loop.
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(_step_dir(out, 6))  # as if the run had stopped after saving step 4
    (weights,) = _step_dir(out, 4).glob("policy/*.safetensors")
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        f.write(b"\0" * 4000)
    damaged = weights.read_bytes()

    proc = _tune(out, prompts, "num_ppo_steps=6", *SAVE_EVERY_2, "resume_from_checkpoint=True")
    assert f"Resuming from {_step_dir(out, 2)}" in proc.stderr
    root = out / checkpointing.CHECKPOINTS_DIRNAME
    (aside,) = root.glob("step_4.damaged-*")
    assert f"Set aside checkpoint {_step_dir(out, 4)} as {aside.name}" in proc.stderr
    assert (aside / "policy" / weights.name).read_bytes() == damaged  # kept as it was
    resumed, reference = _logged(out), _logged(straight)
    assert sorted(resumed) == [3, 4, 5, 6]
    for step in resumed:
        _assert_same_metrics(resumed[step], reference[step], step)
    for step in (4, 6):
        _assert_same_tensors(_weights(_step_dir(out, step)), _weights(_step_dir(straight, step)), f"step {step}")
