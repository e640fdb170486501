"""Value pretraining: the stopping rule worked by hand, its state across a resume,
the config's refusals and the resume-config rule for its keys."""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.checkpointing import resume_config as rc
from torchtune_ppo.checkpointing.store import TRAINING_STATE_FNAME
from torchtune_ppo.config import validate_config
from torchtune_ppo.ppo.value_pretrain import ValuePretraining, relative_change, settled

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"

# A made-up value-loss sequence, window w = 2, tolerance 0.1. M_k = mean of the last 2 losses:
#   k = 4: M_4 = (5 + 4.6) / 2 = 4.8,     M_2 = (8 + 6) / 2 = 7    -> |4.8 - 7| / 7     = 0.3142857
#   k = 5: M_5 = (4.6 + 4.5) / 2 = 4.55,  M_3 = (6 + 5) / 2 = 5.5  -> |4.55 - 5.5| / 5.5 = 0.1727273
#   k = 6: M_6 = (4.5 + 4.45) / 2 = 4.475, M_4 = 4.8               -> |4.475 - 4.8| / 4.8 = 0.0677083 < 0.1
LOSSES = [8.0, 6.0, 5.0, 4.6, 4.5, 4.45]
CHANGES = {4: 2.2 / 7, 5: 0.95 / 5.5, 6: 0.325 / 4.8}


def test_relative_change_of_the_moving_average_by_hand():
    for k in (1, 2, 3):
        assert relative_change(LOSSES[:k], 2) is None  # fewer than 2 * window losses
    for k, expected in CHANGES.items():
        assert relative_change(LOSSES[:k], 2) == pytest.approx(expected, rel=1e-12)
    assert [settled(LOSSES[:k], 2, 0.1) for k in range(1, 7)] == [False] * 5 + [True]
    assert not settled(LOSSES, 2, None)  # no tolerance: only max_steps ends it
    assert not settled([0.0, 0.0], 1, 0.1)  # M_{k-w} = 0: the relative change is undefined


def test_pretraining_ends_at_the_step_the_rule_is_met():
    pretrain = ValuePretraining(max_steps=10, tolerance=0.1, window=2, lmbda=1.0)
    assert pretrain.active
    for k, loss in enumerate(LOSSES, 1):
        pretrain.record(loss)
        assert pretrain.done == (k == 6), k
        metrics = pretrain.metrics()
        assert metrics["value_pretrain"] == 1.0
        if k >= 4:
            assert metrics["value_pretrain/rel_change"] == pytest.approx(CHANGES[k], rel=1e-12)
        else:
            assert math.isnan(metrics["value_pretrain/rel_change"])
    assert metrics["value_pretrain/loss_avg"] == pytest.approx(4.475, rel=1e-12)
    assert pretrain.steps_run == 6 and not pretrain.active


def test_a_step_without_an_update_counts_but_records_no_loss():
    pretrain = ValuePretraining(max_steps=10, tolerance=0.1, window=2, lmbda=1.0)
    for loss in [*LOSSES[:3], float("nan"), *LOSSES[3:]]:
        pretrain.record(loss)
    assert pretrain.steps_run == 7 and pretrain.losses == LOSSES and pretrain.done


def test_max_steps_ends_it_and_zero_is_off():
    pretrain = ValuePretraining(max_steps=3, tolerance=None, window=2, lmbda=1.0)
    for k, loss in enumerate(LOSSES[:3], 1):
        pretrain.record(loss)
        assert pretrain.done == (k == 3)
    assert not ValuePretraining(max_steps=0, tolerance=None, window=5, lmbda=1.0).active


def test_resumed_state_applies_the_rule_to_the_saved_record():
    before = ValuePretraining(max_steps=10, tolerance=0.1, window=2, lmbda=1.0)
    for loss in LOSSES[:5]:
        before.record(loss)
    state = before.state_dict()
    assert state == {"steps_run": 5, "losses": LOSSES[:5], "done": False}

    same = ValuePretraining(max_steps=10, tolerance=0.1, window=2, lmbda=1.0)
    same.load_state_dict(state, ppo_steps_run=0)
    same.record(LOSSES[5])
    assert same.done and same.steps_run == 6  # what the uninterrupted run does
    looser = ValuePretraining(max_steps=10, tolerance=0.2, window=2, lmbda=1.0)
    looser.load_state_dict(state, ppo_steps_run=0)
    assert looser.done  # 0.1727 < 0.2: met by the saved record
    shorter = ValuePretraining(max_steps=5, tolerance=None, window=2, lmbda=1.0)
    shorter.load_state_dict(state, ppo_steps_run=0)
    assert shorter.done
    # A checkpoint from before value pretraining: done once PPO has begun.
    older = ValuePretraining(max_steps=10, tolerance=None, window=2, lmbda=1.0)
    older.load_state_dict(None, ppo_steps_run=3)
    assert older.done and older.steps_run == 0


# ----------------------------------------------------------------------------- config


def _cfg(**overrides):
    cfg = OmegaConf.load(CONFIG)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def test_off_by_default_with_the_documented_defaults():
    cfg = validate_config(_cfg())
    assert OmegaConf.to_container(cfg.value_pretrain) == {"max_steps": 0, "tolerance": None, "window": 5, "lmbda": 1.0}
    # a partial block keeps the other defaults
    cfg = validate_config(_cfg(**{"value_pretrain.max_steps": 20}))
    assert OmegaConf.to_container(cfg.value_pretrain) == {"max_steps": 20, "tolerance": None, "window": 5, "lmbda": 1.0}


@pytest.mark.parametrize("overrides,message", [
    ({"value_pretrain.max_steps": -1}, r"^value_pretrain.max_steps must be an integer >= 0, got -1\.$"),
    ({"value_pretrain.max_steps": 2.5}, r"^value_pretrain.max_steps must be an integer >= 0, got 2.5\.$"),
    ({"value_pretrain.tolerance": 0}, r"^value_pretrain.tolerance must be null or a number > 0, got 0\.$"),
    ({"value_pretrain.window": 0}, r"^value_pretrain.window must be a positive integer, got 0\.$"),
    ({"value_pretrain.lmbda": 1.5}, r"^value_pretrain.lmbda must be a number in \[0, 1\], got 1.5\.$"),
    ({"value_pretrain.steps": 3}, r"value_pretrain: unknown key\(s\) \['steps'\]; valid keys are "
                                  r"\['max_steps', 'tolerance', 'window', 'lmbda'\]"),
    ({"value_pretrain": 5}, r"^value_pretrain must be a mapping with keys \['max_steps', 'tolerance', 'window', "
                            r"'lmbda'\], got 5\.$"),
    ({"value_pretrain.max_steps": 3, "advantage_estimator": "grpo", "num_samples_per_prompt": 2},
     r"value_pretrain.max_steps=3 is for the value model and GAE; advantage_estimator=grpo has neither \(no critic\)\. "
     r"Set value_pretrain.max_steps=0, or use advantage_estimator=gae\."),
    ({"value_pretrain.max_steps": 3, "optimizer_in_bwd": True, "gradient_accumulation_steps": 1,
      "clip_grad_norm": "null", "lr_scheduler": "null"},
     r"value_pretrain.max_steps=3 with optimizer_in_bwd=True is not supported .*set value_pretrain.max_steps=0 "
     r"or optimizer_in_bwd=False\."),
])
def test_bad_value_pretrain_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**overrides))


def test_critic_free_run_with_pretraining_off_is_accepted():
    validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=2, **{"value_pretrain.window": 3}))


# ----------------------------------------------------------------------------- resume config

BASE = {"batch_size": 32, "seed": 0, "output_dir": "/a", "resume_from_checkpoint": False,
        "value_pretrain": {"max_steps": 20, "tolerance": 0.05, "window": 5, "lmbda": 1.0}}


def _checkpoint(tmp_path, pretrain_state):
    folder = tmp_path / "step_7"
    folder.mkdir()
    (folder / rc.CONFIG_FNAME).write_text(OmegaConf.to_yaml(OmegaConf.create(BASE)))
    torch.save({"steps_run": 0 if not pretrain_state["done"] else 2, "value_pretrain": pretrain_state},
               folder / TRAINING_STATE_FNAME)
    return folder


def _new(**pretrain):
    return {**BASE, "output_dir": "/b", "resume_from_checkpoint": True,
            "value_pretrain": {**BASE["value_pretrain"], **pretrain}}


MID = {"steps_run": 7, "losses": [3.0, 2.0, 1.5, 1.4, 1.3, 1.2, 1.1], "done": False}
DONE = {"steps_run": 20, "losses": [1.0] * 20, "done": True}


def test_mid_pretraining_resume_refuses_another_lambda(tmp_path):
    ckpt = _checkpoint(tmp_path, MID)
    with pytest.raises(rc.ResumeConfigError) as err:
        rc.check_resume_config(ckpt, _new(lmbda=0.95))
    message = str(err.value)
    assert "  value_pretrain.lmbda: saved 1.0, now 0.95" in message
    assert "saved after 7 of value pretraining's steps" in message
    assert "value_pretrain.lmbda=1.0" in message  # the fix


def test_mid_pretraining_resume_takes_a_new_tolerance_window_or_max_steps(tmp_path, caplog):
    ckpt = _checkpoint(tmp_path, MID)
    with caplog.at_level("INFO"):
        changed = rc.check_resume_config(ckpt, _new(tolerance=0.1, window=3, max_steps=40))
    assert changed == ["value_pretrain.max_steps", "value_pretrain.tolerance", "value_pretrain.window"]
    assert "saved record of 7 value losses" in caplog.text


def test_after_pretraining_every_pretraining_key_may_change(tmp_path, caplog):
    ckpt = _checkpoint(tmp_path, DONE)
    with caplog.at_level("INFO"):
        changed = rc.check_resume_config(ckpt, _new(lmbda=0.9, max_steps=0))
    assert changed == ["value_pretrain.lmbda", "value_pretrain.max_steps"]
    assert "with no effect: value pretraining of the run" in caplog.text
