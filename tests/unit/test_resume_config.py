"""A resume checks its config against the one saved in the checkpoint: keys the saved state
depends on must match (the run stops before any weights load), the others take the new value,
and the optimizer's hyperparameters from the config replace the restored ones."""

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training

import torchtune_ppo
from torchtune_ppo.checkpointing import resume_config as rc
from torchtune_ppo.checkpointing import store
from torchtune_ppo.config import validate_config

from conftest import SMALL, TINY_CONFIG

BASE = {"batch_size": 32, "ppo_batch_size": 16, "seed": 0, "shuffle": True, "num_ppo_steps": 40,
        "output_dir": "/a", "resume_from_checkpoint": False,
        "dataset": {"_component_": "d", "data_files": "p.json"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-4, "weight_decay": 0.0}}


def _checkpoint(tmp_path, saved):
    folder = tmp_path / "step_2"
    folder.mkdir()
    (folder / rc.CONFIG_FNAME).write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    return folder


def _with(**changes):
    cfg = json.loads(json.dumps(BASE))
    for key, value in changes.items():
        node, *path = key.split("__")
        target = cfg
        for p in [node, *path][:-1]:
            target = target[p]
        target[[node, *path][-1]] = value
    return cfg


@pytest.mark.parametrize("changes,key,saved,new", [
    ({"batch_size": 16}, "batch_size", 32, 16),
    ({"seed": 7}, "seed", 0, 7),
    ({"shuffle": False}, "shuffle", True, False),
    ({"dataset__data_files": "q.json"}, "dataset.data_files", "p.json", "q.json"),
    ({"optimizer___component_": "torch.optim.SGD"}, "optimizer._component_", "torch.optim.AdamW",
     "torch.optim.SGD"),
])
def test_a_key_the_saved_state_depends_on_must_match(tmp_path, changes, key, saved, new):
    ckpt = _checkpoint(tmp_path, BASE)
    with pytest.raises(rc.ResumeConfigError) as err:
        rc.check_resume_config(ckpt, _with(**changes, output_dir="/b", resume_from_checkpoint=True))
    message = str(err.value)
    assert f"  {key}: saved {saved!r}, now {new!r}" in message
    assert str(ckpt) in message and "another output_dir" in message
    # Only the key that differs is listed (output_dir and resume_from_checkpoint never are).
    assert message.count(", now ") == 1


def test_every_differing_key_is_listed(tmp_path):
    ckpt = _checkpoint(tmp_path, BASE)
    with pytest.raises(rc.ResumeConfigError) as err:
        rc.check_resume_config(ckpt, _with(batch_size=16, seed=7))
    assert "batch_size: saved 32, now 16" in str(err.value)
    assert "seed: saved 0, now 7" in str(err.value)
    assert "batch_size=32 seed=0" in str(err.value)


def test_keys_that_may_change_take_the_new_value_with_a_note(tmp_path, caplog):
    ckpt = _checkpoint(tmp_path, BASE)
    with caplog.at_level(logging.INFO):
        changed = rc.check_resume_config(ckpt, _with(num_ppo_steps=80, optimizer__lr=1e-5))
    assert changed == ["num_ppo_steps", "optimizer.lr"]
    assert "num_ppo_steps: 40 -> 80" in caplog.text and "optimizer.lr: 0.0003 -> 1e-05" in caplog.text


def test_same_config_says_nothing(tmp_path, caplog):
    ckpt = _checkpoint(tmp_path, BASE)
    with caplog.at_level(logging.INFO):
        assert rc.check_resume_config(ckpt, _with(batch_size=32.0)) == []
    assert "config changes" not in caplog.text


def test_checkpoint_of_the_older_format_resumes_with_a_warning(tmp_path, caplog):
    (tmp_path / "step_2").mkdir()
    with caplog.at_level(logging.WARNING):
        assert rc.check_resume_config(tmp_path / "step_2", _with(batch_size=16)) == []
    assert "no saved config.yaml" in caplog.text


def _optimizer(lr, scheduler=False):
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = training.get_cosine_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=20) if scheduler else None
    return params, opt, sched


def _steps(params, opt, sched, n):
    for _ in range(n):
        params[0].grad = torch.ones(2)
        opt.step()
        if sched is not None:
            sched.step()


def test_optimizer_settings_from_the_config_replace_the_restored_ones():
    params, opt, _ = _optimizer(3e-4)
    _steps(params, opt, None, 2)
    _, restored, _ = _optimizer(1e-5)
    restored.load_state_dict(opt.state_dict())
    assert restored.param_groups[0]["lr"] == 3e-4  # what loading the state alone does
    changed = rc.apply_optimizer_overrides(
        restored, {"_component_": "torch.optim.AdamW", "lr": 1e-5, "weight_decay": 0.1})
    assert changed == {"lr": (3e-4, 1e-5), "weight_decay": (0.0, 0.1)}
    assert restored.param_groups[0]["lr"] == 1e-5 and restored.param_groups[0]["weight_decay"] == 0.1


def test_a_new_lr_keeps_the_schedule_position():
    params, opt, sched = _optimizer(3e-4, scheduler=True)
    _steps(params, opt, sched, 2)  # warm-up: lr is 2/4 of the base
    p2, restored, rsched = _optimizer(3e-4, scheduler=True)
    restored.load_state_dict(opt.state_dict())
    rsched.load_state_dict(sched.state_dict())
    rc.apply_optimizer_overrides(restored, {"lr": 1e-5}, rsched)
    assert restored.param_groups[0]["lr"] == pytest.approx(0.5e-5)
    _steps(p2, restored, rsched, 1)
    assert restored.param_groups[0]["lr"] == pytest.approx(0.75e-5)


# ----------------------------------------------------------------------------- through the recipe


def _build(out, *overrides):
    from ppo_full_finetune import PPOFullFinetuneRecipe

    cfg = OmegaConf.merge(OmegaConf.load(TINY_CONFIG), OmegaConf.from_dotlist(
        [f"output_dir={out}", *SMALL, *overrides]))
    cfg = validate_config(cfg)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    return recipe


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """A run of 1 step saved at step 1 (in this process)."""
    out = tmp_path_factory.mktemp("one") / "run"
    recipe = _build(out, "num_ppo_steps=1", "keep_last_n_checkpoints=null")
    recipe.train()
    recipe.cleanup()
    return out


@pytest.mark.slow
def test_the_checkpoint_holds_the_resolved_config(one_step):
    saved = rc.saved_config(one_step / "checkpoints/step_1")
    assert saved["batch_size"] == 8 and saved["output_dir"] == str(one_step)
    assert "${" not in json.dumps(saved)
    marker = json.loads((one_step / "checkpoints/step_1" / store.MARKER_FNAME).read_text())
    assert rc.CONFIG_FNAME in marker["files"] and rc.CONFIG_FNAME in marker["sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [("batch_size=16", "batch_size"), ("seed=7", "seed")])
def test_resume_with_a_key_that_must_match_stops_before_loading_weights(one_step, monkeypatch, override, key):
    def load_checkpoint(self, *args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(training.FullModelHFCheckpointer, "load_checkpoint", load_checkpoint)
    with pytest.raises(rc.ResumeConfigError, match=rf"  {key}: saved \d+, now \d+"):
        _build(one_step, "num_ppo_steps=2", "resume_from_checkpoint=True", override)


@pytest.mark.slow
def test_resume_trains_at_the_new_lr(one_step):
    recipe = _build(one_step, "num_ppo_steps=2", "resume_from_checkpoint=True", "optimizer.lr=1e-5")
    assert recipe._progress.steps_run == 1
    assert [g["lr"] for g in recipe._update.optimizer.param_groups] == [1e-5]
    # and the restored optimizer state is still the saved one
    assert all(int(s["step"]) > 0 for s in recipe._update.optimizer.state.values())
    recipe.cleanup()
