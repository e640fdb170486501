"""The LR scheduler steps after the optimizer, seen in the saved weights: with a warm-up whose
first LR is 0, the first update must leave every weight as it was.

Runs the recipe in-process on the tiny task through its public steps (``setup``, ``train``,
the checkpoints it saves), 2 PPO steps of one optimizer update each.
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import torchtune_ppo
from torchtune_ppo import checkpointing
from torchtune_ppo.config import validate_config

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
COSINE = "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup"
# One minibatch of the whole batch, one PPO epoch: one optimizer update per PPO step.
ONE_UPDATE_A_STEP = [
    "batch_size=8", "forward_batch_size=8", "ppo_batch_size=8", "gradient_accumulation_steps=2",
    "ppo_epochs=1", "max_generated_tokens=8", "num_ppo_steps=2",
    "save_every_n_steps=1", "keep_last_n_checkpoints=null", "log_samples_every_n_steps=null",
    # warm-up over 1 optimizer step: LR 0 for the first update, then the base LR
    f"lr_scheduler._component_={COSINE}", "lr_scheduler.num_warmup_steps=1",
]
STARTING = {"policy": "tiny_sentiment/policy", "value": "tiny_sentiment/reward"}


def _weights(folder):
    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}


def _changed(a, b):
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_first_update_at_warmup_lr_zero_leaves_the_weights(tmp_path):
    from ppo_full_finetune import PPOFullFinetuneRecipe

    cfg = OmegaConf.merge(OmegaConf.load(CONFIG),
                          OmegaConf.from_dotlist([f"output_dir={tmp_path / 'run'}", *ONE_UPDATE_A_STEP]))
    cfg = validate_config(cfg)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    lrs = []
    try:
        recipe.train(on_step=lambda step, metrics: lrs.append(metrics["lr"]))
    finally:
        recipe.cleanup()
    base = float(cfg.optimizer.lr)
    # logged after each step's update: the scheduler moved on from 0 to the base LR, then the
    # cosine's end (2 of 2 optimizer steps)
    assert lrs == [pytest.approx(base, rel=1e-6), pytest.approx(0.0, abs=1e-12)]

    root = tmp_path / "run" / checkpointing.CHECKPOINTS_DIRNAME
    for model, asset in STARTING.items():
        start = _weights(torchtune_ppo.asset_path(asset))
        after_1, after_2 = _weights(root / "step_1" / model), _weights(root / "step_2" / model)
        # the first update ran at LR 0 (a scheduler stepped before it would give it the base LR)
        assert _changed(after_1, start) == [], model
        # the second ran at the base LR and trained every weight that had a gradient
        assert len(_changed(after_2, start)) > len(start) // 2, model
