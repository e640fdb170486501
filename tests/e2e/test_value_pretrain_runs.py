"""Value pretraining (issue #19) through the recipe, in this process, on the tiny task (eager).

Two shared runs: ``fixed``, greedy on one batch of 8 prompts, so every pretraining step fits the
value model to the same returns; ``straight``, sampled over 20 prompts (2 batches an epoch),
ended by the tolerance, with a checkpoint at every step, against which a run stopped mid-way
through pretraining and a run resumed after it are compared bit for bit. And 2 processes
(torchrun, gloo) against 1.
"""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_ppo
from torchtune_ppo.checkpointing import store as checkpointing
from torchtune_ppo.config import validate_config
from torchtune_ppo.ppo.value_pretrain import relative_change, settled
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy

from conftest import TINY_CONFIG
from test_recipe import _load_policy
from test_reliability import _assert_same_metrics, _assert_same_state, _assert_same_tensors, _step_dir, _weights

# 8 prompts a step: 2 minibatches of 2 micro-batches, one epoch: 2 optimizer steps a step.
SHAPE = ["batch_size=8", "forward_batch_size=4", "ppo_batch_size=4", "gradient_accumulation_steps=2",
         "ppo_epochs=1", "max_generated_tokens=12", "compile=False", "log_samples_every_n_steps=null"]
# window 2, tolerance 10: the rule is met as soon as it can be read, after 2 * window = 4 steps
STRAIGHT = ["value_pretrain.max_steps=6", "value_pretrain.window=2", "value_pretrain.tolerance=10",
            "num_ppo_steps=2", "save_every_n_steps=1", "keep_last_n_checkpoints=null"]


def _prompts(folder: Path, n: int) -> Path:
    with open(torchtune_ppo.asset_path("tiny_sentiment/prompts.json")) as f:
        records = json.load(f)
    path = folder / f"prompts_{n}.json"
    path.write_text(json.dumps(records[:n]))
    return path


def _run(out: Path, prompts: Path, *overrides: str, stop_after: int = 0):
    """Runs the recipe; returns ``{step: metrics}``. ``stop_after``: SIGINT after that step (the
    recipe finishes it, saves and exits)."""
    from ppo_full_finetune import PPOFullFinetuneRecipe

    cfg = OmegaConf.merge(OmegaConf.load(TINY_CONFIG), OmegaConf.from_dotlist(
        [f"output_dir={out}", f"dataset.data_files={prompts}", *SHAPE, *overrides]))
    cfg = validate_config(cfg)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    logged = {}

    def on_step(step, metrics):
        logged[step] = metrics
        if step == stop_after:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        recipe.train(on_step=on_step)
    except SystemExit as e:
        assert stop_after and e.code == 128 + signal.SIGINT, e
    finally:
        recipe.cleanup()
    return logged


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """4 pretraining steps on the same greedy batch, then 1 PPO step; saved at steps 4 and 5."""
    base = tmp_path_factory.mktemp("fixed")
    out = base / "run"
    logged = _run(out, _prompts(base, 8), "top_k=1", "value_pretrain.max_steps=4", "num_ppo_steps=1",
                  "save_every_n_steps=4", "keep_last_n_checkpoints=null")
    return out, logged


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    base = tmp_path_factory.mktemp("straight")
    prompts = _prompts(base, 20)
    out = base / "run"
    return out, prompts, _run(out, prompts, *STRAIGHT)


def test_pretraining_steps_are_logged_apart_and_not_counted_as_ppo_steps(fixed):
    out, logged = fixed
    assert sorted(logged) == [1, 2, 3, 4, 5]  # 4 pretraining steps, then num_ppo_steps=1
    assert [logged[s]["value_pretrain"] for s in range(1, 6)] == [1, 1, 1, 1, 0]
    assert checkpointing.load_training_state(_step_dir(out, 5))["steps_run"] == 1
    assert checkpointing.load_training_state(_step_dir(out, 4))["value_pretrain"]["done"] is True


def test_value_loss_falls_over_pretraining_on_a_fixed_batch(fixed):
    # Greedy responses to the same 8 prompts from a policy that does not move: every step fits
    # the value model to the same Monte-Carlo returns.
    _, logged = fixed
    losses = [logged[s]["value_loss"] for s in range(1, 5)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    scores = [logged[s]["scores"] for s in range(1, 5)]
    assert scores == [scores[0]] * 4  # the same batch each time


def test_policy_and_its_optimizer_state_do_not_change_in_pretraining(fixed, tmp_path):
    out, _ = fixed
    start = _load_policy(Path(torchtune_ppo.asset_path("tiny_sentiment/policy")), tmp_path / "a", "model.safetensors")
    after = _load_policy(_step_dir(out, 4) / "policy", tmp_path / "b")
    for (name, a), b in zip(start.state_dict().items(), after.state_dict().values()):
        assert torch.equal(a, b), name
    optimizer = checkpointing.load_training_state(_step_dir(out, 4))["optimizer"]
    n_policy = len(list(tiny_policy().parameters()))  # the optimizer's first parameters
    assert optimizer["state"] and all(i >= n_policy for i in optimizer["state"])
    assert all(int(s["step"]) == 4 * 2 for s in optimizer["state"].values())  # 2 updates a step
    # not vacuous: PPO's first step, right after, moves the policy
    pretrained, ppo = _weights(_step_dir(out, 4)), _weights(_step_dir(out, 5))
    assert any(not torch.equal(pretrained[k], ppo[k]) for k in pretrained if k.startswith("policy/"))


def test_tolerance_ends_pretraining_where_the_rule_says(straight):
    _, _, logged = straight
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    flags = [logged[s]["value_pretrain"] for s in range(1, 7)]
    losses = [logged[s]["value_loss"] for s in range(1, 7)]
    # the rule by hand on the logged losses: the first k at which it holds, before max_steps=6
    ends = next(k for k in range(1, 7) if settled(losses[:k], 2, 10.0))
    assert ends == 4 and flags == [1, 1, 1, 1, 0, 0]
    assert logged[4]["value_pretrain/rel_change"] == pytest.approx(relative_change(losses[:4], 2), rel=1e-6)
    assert logged[4]["value_pretrain/loss_avg"] == pytest.approx((losses[2] + losses[3]) / 2, rel=1e-6)


def test_run_stopped_mid_pretraining_resumes_there_and_matches(straight, tmp_path):
    reference_out, prompts, reference = straight
    out = tmp_path / "run"
    first = _run(out, prompts, *STRAIGHT, stop_after=3)  # mid-pretraining and mid-epoch
    assert sorted(first) == [1, 2, 3]
    saved = checkpointing.load_training_state(_step_dir(out, 3))
    assert saved["steps_run"] == 0 and saved["batches_run_in_epoch"] == 1
    assert saved["value_pretrain"] == {"steps_run": 3, "losses": [first[s]["value_loss"] for s in (1, 2, 3)],
                                       "done": False}

    resumed = _run(out, prompts, *STRAIGHT, "resume_from_checkpoint=True")
    # step 4 meets the rule only with the saved losses of steps 1-3
    assert sorted(resumed) == [4, 5, 6] and resumed[4]["value_pretrain"] == 1 and resumed[5]["value_pretrain"] == 0
    for step, row in {**first, **resumed}.items():
        _assert_same_metrics(row, reference[step], step)
    _assert_same_tensors(_weights(_step_dir(out, 6)), _weights(_step_dir(reference_out, 6)), "weights at step 6")
    _assert_same_state(checkpointing.load_training_state(_step_dir(out, 6)),
                       checkpointing.load_training_state(_step_dir(reference_out, 6)))


def test_run_saved_after_pretraining_resumes_in_ppo(straight, tmp_path):
    reference_out, prompts, reference = straight
    out = tmp_path / "run"
    shutil.copytree(reference_out, out)
    for step in (5, 6):
        shutil.rmtree(_step_dir(out, step))
    shutil.rmtree(out / "logs")
    resumed = _run(out, prompts, *STRAIGHT, "resume_from_checkpoint=True")
    assert sorted(resumed) == [5, 6]
    for step, row in resumed.items():
        _assert_same_metrics(row, reference[step], step)
    _assert_same_tensors(_weights(_step_dir(out, 6)), _weights(_step_dir(reference_out, 6)), "weights at step 6")


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_two_processes_pretrain_as_one(tmp_path):
    """On 2 processes (greedy, test_distributed's shape) every rank reads the same global value
    loss, so the ranks end pretraining together, at the step the 1-process run does."""
    from test_distributed import _assert_rows_match, _run as _launch_run

    options = ("value_pretrain.max_steps=4", "value_pretrain.window=1", "value_pretrain.tolerance=10",
               "num_ppo_steps=2")  # window 1, tolerance 10: ends after step 2
    one = _launch_run(tmp_path / "one", 1, *options)
    two = _launch_run(tmp_path / "two", 2, *options)
    assert [r["value_pretrain"] for r in one] == [r["value_pretrain"] for r in two] == [1, 1, 0, 0]
    _assert_rows_match(one, two)
    assert two[1]["value_pretrain/rel_change"] == pytest.approx(one[1]["value_pretrain/rel_change"], rel=1e-5)
