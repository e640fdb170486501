"""Evaluation during training through `tune run`, on the tiny arithmetic config: a run with
evaluation trains exactly as one without; the best checkpoint survives pruning; the run stops
early; a resumed run continues the count and stops where the uninterrupted one does; compiled,
the first evaluation's graphs are not recompiles.

One run with evaluation (``evaluated``) serves most tests. Its held-out trajectory (128 problems,
greedy) is fixed by the seed: by ``val/response_length`` the best is step 4 (steps 0 and 2 tie at
3.438, step 4 reaches 3.453), steps 6 and 8 do not improve on it, and patience 2 stops the run at
step 8 of 16. Saving every 3 steps, step 4 is saved only because it is the new best, and kept
only because pruning (``keep_last_n_checkpoints=2``) spares it.

An evaluation that fails or is killed (``tests/faulty_rewards.py`` as ``eval.reward``, misbehaving
while an environment variable is set) costs no completed step, and the resumed run, evaluating
that step again, ends where the run without evaluation does.
"""

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchtune_ppo
from torchtune_ppo.checkpointing.store import EVALUATION_FNAME, load_training_state
from torchtune_ppo.run.logs import read_disk_log, read_eval_log

from conftest import ROOT, TUNE

CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_arithmetic.yaml"
SHAPE = ["batch_size=8", "forward_batch_size=8", "ppo_batch_size=8", "log_samples_every_n_steps=null"]
EVAL = ["eval.every_n_steps=2", "eval.max_prompts=128", "eval.batch_size=64", "eval.best_metric=val/response_length"]
STOPPING = ["num_ppo_steps=16", "eval.early_stop_patience=2", "save_every_n_steps=3", "keep_last_n_checkpoints=2"]
STOP_STEP, BEST_STEP = 8, 4
FAULT = "TORCHTUNE_PPO_TEST_EVAL_FAULT"  # set: the evaluation's reward misbehaves
FAULTY_EVAL = ["num_ppo_steps=4", "eval.every_n_steps=2", "eval.before_training=False", "eval.max_prompts=16",
               "eval.batch_size=16", f"eval.reward.env={FAULT}"]


def _tune(out: Path, *overrides: str, env=None):
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(CONFIG), f"output_dir={out}", *SHAPE, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return proc


def _fault_env(fault: bool):
    """The environment of a run whose ``eval.reward`` is in tests/faulty_rewards.py; ``fault``: it misbehaves."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop(FAULT, None)
    return {**env, FAULT: "1"} if fault else env


def _faulty(out: Path, reward: str, *overrides: str, fault: bool = True, rc: int = 0):
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(CONFIG), f"output_dir={out}", *SHAPE, *FAULTY_EVAL,
           f"eval.reward._component_=faulty_rewards.{reward}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=_fault_env(fault))
    assert proc.returncode == rc, f"{shlex.join(cmd)}\nrc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return proc


def _timing(key: str) -> bool:
    return key.startswith("time/") or "per_second" in key


def _weights(out: Path, step: int):
    folder = out / "checkpoints" / f"step_{step}"
    return {m: load_file(str(folder / m / "model-00001-of-00001.safetensors")) for m in ("policy", "value")}


def _steps(out: Path):
    return sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluated") / "run"
    proc = _tune(out, *EVAL, *STOPPING)
    return out, proc


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The run without evaluation, saved at steps 4 and 8."""
    out = tmp_path_factory.mktemp("plain") / "run"
    _tune(out, f"num_ppo_steps={STOP_STEP}", "save_every_n_steps=4", "eval.every_n_steps=null")
    return out


def _assert_trains_as(got: Path, want: Path, steps: int) -> None:
    """Every training metric of the first ``steps`` steps, and the weights saved at the last, bit for bit."""
    a, b = read_disk_log(got / "logs"), read_disk_log(want / "logs")[:steps]
    assert len(a) == len(b) == steps
    for step, (x, y) in enumerate(zip(a, b), 1):
        keys = {k for k in y if not _timing(k)}
        assert keys == {k for k in x if not _timing(k)} and {"scores", "loss", "kl", "ratios"} <= keys
        for k in keys:
            assert x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])), (step, k, x[k], y[k])
    wa, wb = _weights(got, steps), _weights(want, steps)
    for model in wb:
        assert all(torch.equal(wa[model][k], wb[model][k]) for k in wb[model]), model


def test_a_run_with_sampled_evaluation_trains_exactly_as_one_without(plain, tmp_path):
    """Evaluations that sample (2 responses a prompt at temperature 1) draw from their own stream:
    the training's metrics and weights are those of the run without evaluation."""
    sampled = tmp_path / "sampled"
    _tune(sampled, "num_ppo_steps=4", "save_every_n_steps=null", "eval.every_n_steps=2", "eval.max_prompts=64",
          "eval.batch_size=64", "eval.num_samples=2", "eval.top_k=null")
    _assert_trains_as(sampled, plain, 4)
    evals = read_eval_log(sampled / "logs")
    assert [s for s, _ in evals] == [0, 2, 4] and read_eval_log(plain / "logs") == []
    for _, m in evals:  # two samples: a prompt passes when either is right
        assert 0 < m["val/pass@1"] <= m["val/pass@2"] <= min(1.0, 2 * m["val/pass@1"])


def test_the_run_that_saves_its_best_and_stops_early_trains_as_one_without(evaluated, plain):
    out, _ = evaluated
    assert read_eval_log(plain / "logs") == []
    _assert_trains_as(out, plain, STOP_STEP)


def test_the_first_evaluation_scores_the_held_out_accuracy(evaluated):
    """Step 0's val/pass@1 is the shipped policy's greedy accuracy on the first 128 held-out problems,
    as the task's own builder measures it (full forwards, no KV cache, a response correct when it
    ends in EOS and its last number is the answer)."""
    sys.path.insert(0, str(ROOT / "tools/tasks"))
    sys.path.insert(0, str(ROOT / "benchmarks/tasks"))
    import build_tiny_arithmetic as build
    from arithmetic_accuracy import load_policy

    from torchtune_ppo.tasks.tiny_arithmetic import tiny_tokenizer

    problems = json.loads(Path(torchtune_ppo.asset_path("tiny_arithmetic/problems.json")).read_text())["heldout"]
    policy = load_policy(Path(torchtune_ppo.asset_path("tiny_arithmetic/policy")))
    with torch.no_grad():
        accuracy = build.accuracy(policy, tiny_tokenizer(), [(r["prompt"], r["answer"]) for r in problems[:128]])[0]
    out, _ = evaluated
    step, first = read_eval_log(out / "logs")[0]
    assert step == 0 and first["val/pass@1"] == pytest.approx(accuracy, abs=1e-12)
    assert 0.2 < accuracy < 0.5  # about a third, as the task documents


def test_the_best_checkpoint_is_saved_kept_from_pruning_and_named(evaluated):
    out, proc = evaluated
    evals = read_eval_log(out / "logs")
    values = [m["val/response_length"] for _, m in evals]
    assert [s for s, _ in evals] == [0, 2, 4, 6, 8]
    # the rule, from the logged values: strictly better than every earlier one
    best = [s for i, (s, _) in enumerate(evals) if all(values[i] > v for v in values[:i])]
    assert best[-1] == BEST_STEP, (values, "the seeded trajectory moved: re-pick BEST_STEP and STOP_STEP")
    # saved every 3 steps (3, 6) and at the end (8); 4 only as the new best, and kept while
    # keep_last_n_checkpoints=2 keeps 6 and 8
    assert _steps(out) == [BEST_STEP, 6, STOP_STEP]
    assert f"Pruned checkpoint {out / 'checkpoints' / 'step_3'}" in proc.stderr
    state = load_training_state(out / "checkpoints" / f"step_{STOP_STEP}")["evaluation"]
    assert (state["best_step"], state["best_value"], state["since_best"]) == (BEST_STEP, values[2], 2)
    assert [h["step"] for h in state["history"]] == [0, 2, 4, 6, 8]
    assert f"best {values[2]:.4g} at step {BEST_STEP} (checkpoint {out / 'checkpoints' / f'step_{BEST_STEP}'})" in proc.stderr


def test_patience_stops_the_run_after_saving(evaluated):
    out, proc = evaluated
    assert len(read_disk_log(out / "logs")) == STOP_STEP  # of num_ppo_steps=16
    assert re.search(rf"Early stop after step {STOP_STEP}: 2 evaluations without a better val/response_length "
                     rf"than [\d.]+ at step {BEST_STEP}", proc.stderr)
    assert (out / "checkpoints" / f"step_{STOP_STEP}" / "COMPLETE").is_file()


def test_a_resumed_run_continues_the_count_and_stops_where_the_run_did(evaluated, tmp_path):
    """Resumed from step 6 (one evaluation without improvement since the best), the run
    evaluates at step 8 as the uninterrupted run did and stops there; with the count started
    afresh it would go on (step 10 improves)."""
    out, _ = evaluated
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{STOP_STEP}")
    shutil.rmtree(resumed / "logs")
    proc = _tune(resumed, *EVAL, *STOPPING, "resume_from_checkpoint=True")
    def untimed(log):
        return [(step, {k: v for k, v in m.items() if not _timing(k)}) for step, m in read_eval_log(log)]

    assert untimed(resumed / "logs") == [(s, m) for s, m in untimed(out / "logs") if s == STOP_STEP]
    assert len(read_disk_log(resumed / "logs")) == STOP_STEP - 6
    assert f"Early stop after step {STOP_STEP}" in proc.stderr
    assert _steps(resumed) == [BEST_STEP, 6, STOP_STEP]
    got, want = _weights(resumed, STOP_STEP), _weights(out, STOP_STEP)
    assert all(torch.equal(got["policy"][k], want["policy"][k]) for k in want["policy"])


def test_compiled_the_first_evaluation_after_step_1_is_not_a_recompile(evaluated, tmp_path):
    """compile.generate (dynamo's guards, on its eager backend) with the first evaluation at step 2:
    its greedy prefill and decode are traced then, after step 1, yet ``recompiles`` stays 0; its
    metrics are the eager run's."""
    out, _ = evaluated
    compiled = tmp_path / "compiled"
    proc = _tune(compiled, *EVAL, "num_ppo_steps=3", "eval.before_training=False", "compile.generate=True",
                 "compile.trajectory=False", "compile.loss_step=False", "compile.rollout=False",
                 env={"TORCHTUNE_PPO_COMPILE_BACKEND": "eager", "TORCH_LOGS": "dynamo"})
    traced = re.findall(r"torchdynamo done tracing (\w+)", proc.stderr)
    # training's sampled steps, then the evaluation's greedy ones: two graphs each
    assert traced.count("prefill") == 2 and traced.count("generate_next_token") == 2, traced
    rows = read_disk_log(compiled / "logs")
    assert len(rows) == 3 and all(r["recompiles"] == 0 for r in rows), [r["recompiles"] for r in rows]
    evals, eager = read_eval_log(compiled / "logs"), dict(read_eval_log(out / "logs"))
    assert [s for s, _ in evals] == [2, 3]  # every 2 steps, and after the last
    for key, value in evals[0][1].items():  # step 2, which the eager run evaluated too
        if key != "time/eval":
            assert value == pytest.approx(eager[2][key], rel=1e-6), key


def test_a_reward_models_evaluation_compiled_with_layers_recompiles_nothing(tmp_path):
    """A reward model instead of the function reward (the policy's checkpoint with a random head),
    the shipped compile block (one layer compiled per use; dynamo's eager backend), an
    evaluation before step 1 and after each step: the evaluation's reward model scores packed
    rows through the compiled layers with the graph the training's scoring uses for frozen
    weights (the layer's inference use traced twice, as without evaluation: frozen and trainable
    weights), and nothing is compiled after step 1."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(CONFIG)
    cfg.reward, cfg.dataset.reference_column = None, None
    cfg.reward_checkpointer = OmegaConf.create({
        "_component_": "torchtune_ppo.models.ClassifierHFCheckpointer", "checkpoint_dir": "${ppo_asset:tiny_arithmetic/policy}",
        "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA2", "value_head_init": "normal",
        "output_dir": "${output_dir}/reward"})
    config = tmp_path / "reward_model.yaml"
    OmegaConf.save(cfg, config)
    out = tmp_path / "run"
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(config), f"output_dir={out}", *SHAPE, "num_ppo_steps=2",
           "eval.every_n_steps=1", "eval.before_training=True", "eval.max_prompts=32", "eval.batch_size=16",
           "compile=True"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHTUNE_PPO_COMPILE_BACKEND": "eager",
                               "TORCH_LOGS": "dynamo"})
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stderr[-5000:]}"
    assert "layers=True" in proc.stderr
    traced = re.findall(r"torchdynamo done tracing (\w+)", proc.stderr)
    assert traced.count("_layer_infer") == 2, traced
    rows, evals = read_disk_log(out / "logs"), read_eval_log(out / "logs")
    assert [r["recompiles"] for r in rows] == [0, 0] and [s for s, _ in evals] == [0, 1, 2], (rows, evals)
    assert all(math.isfinite(e["val/reward_mean"]) for _, e in evals)


def test_resuming_a_run_that_stopped_early_says_where_why_and_what_to_change(evaluated, tmp_path):
    out, _ = evaluated
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    proc = _tune(resumed, *EVAL, *STOPPING, "resume_from_checkpoint=True")
    assert re.search(
        rf"Nothing to train: this run stopped early after step {STOP_STEP} \({STOP_STEP} of its num_ppo_steps=16 PPO "
        rf"steps\): 2 evaluations in a row without a better val/response_length than the best, [\d.]+ at step "
        rf"{BEST_STEP} \(eval.early_stop_patience=2\)\. To train on from step {STOP_STEP}, resume with an "
        r"eval.early_stop_patience above 2, or null\.", proc.stderr), proc.stderr[-3000:]
    assert "No step was logged" not in proc.stderr
    assert _steps(resumed) == [BEST_STEP, 6, STOP_STEP]  # nothing trained, nothing saved


def _assert_resumed_to_the_end(out: Path, plain: Path) -> None:
    """Steps 3 and 4 trained after the resume, step 2 evaluated again first and step 4 after it (each
    once in the record), and the weights of step 4 those of the run without evaluation."""
    assert [s for s, _ in read_eval_log(out / "logs")] == [2, 4]
    assert len(read_disk_log(out / "logs")) == 2
    assert [h["step"] for h in load_training_state(out / "checkpoints" / "step_4")["evaluation"]["history"]] == [2, 4]
    got, want = _weights(out, 4), _weights(plain, 4)
    for model in want:
        assert all(torch.equal(got[model][k], want[model][k]) for k in want[model]), model


def test_a_stop_during_the_evaluation_before_step_1_resumes_as_the_run_without_it(plain, tmp_path):
    """SIGTERM during the evaluation before training: the run stops before step 1 and saves step 0
    (nothing trained). Its random states were captured before the first epoch's data iterator
    drew from torch's generator, so the resumed run puts them back before that iterator, not
    after: it trains as the uninterrupted run, to the weights of step 4 of the run without
    evaluation (put back after the iterator, the minibatch order differs by one draw)."""
    out = tmp_path / "run"
    _faulty(out, "sigterms_while", "eval.before_training=True", rc=143)
    assert _steps(out) == [0]
    _faulty(out, "sigterms_while", "eval.before_training=True", "resume_from_checkpoint=True", fault=False)
    got, want = _weights(out, 4), _weights(plain, 4)
    for model in want:
        assert all(torch.equal(got[model][k], want[model][k]) for k in want[model]), model


def test_a_failing_evaluation_saves_the_completed_steps_and_the_printed_command_resumes(plain, tmp_path):
    """Nothing due for saving, the evaluation after step 2 raises: the run names the evaluation, saves
    step 2 and prints a command that, run as printed once the reward is fixed, continues the run."""
    out = tmp_path / "run"
    proc = _faulty(out, "raises_while", "save_every_n_steps=100", rc=1)
    assert re.search(r"PPO evaluation after step 2 failed \(\w+: .*the evaluation's reward failed", proc.stderr)
    assert f"the state after step 2 is saved to {out / 'checkpoints' / 'step_2'}" in proc.stderr
    assert "A resumed run evaluates step 2 again first" in proc.stderr and "during the update" not in proc.stderr
    assert _steps(out) == [2]
    (resume,) = re.findall(r"To continue: (tune run .*)$", proc.stderr, flags=re.M)
    resume = shlex.split(resume)
    assert resume[-2:] == [f"output_dir={out}", "resume_from_checkpoint=True"]
    cmd = [*TUNE, *resume[1:]]
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=_fault_env(False))
    assert again.returncode == 0, f"{shlex.join(cmd)}\n{again.stderr[-5000:]}"
    _assert_resumed_to_the_end(out, plain)


def test_a_kill_during_an_evaluation_keeps_the_checkpoint_due_before_it(plain, tmp_path):
    """``save_every_n_steps=2``: step 2's checkpoint is written before step 2's evaluation, which
    SIGKILLs the run; the resumed run evaluates step 2 again (it never finished) and trains on."""
    out = tmp_path / "run"
    _faulty(out, "kills_while", "save_every_n_steps=2", rc=-signal.SIGKILL)
    assert _steps(out) == [2]
    assert not (out / "checkpoints" / "step_2" / EVALUATION_FNAME).exists()
    _faulty(out, "kills_while", "save_every_n_steps=2", "resume_from_checkpoint=True", fault=False)
    _assert_resumed_to_the_end(out, plain)
