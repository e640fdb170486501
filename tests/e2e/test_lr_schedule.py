"""The LR scheduler steps after the optimizer, seen in the saved weights: with a warm-up whose
first LR is 0, the first update must leave every weight as it was. The schedule is built for
the optimizer steps the run takes, also when each prompt is sampled several times
(``num_samples_per_prompt``: a step has ``batch_size * n`` responses to split into minibatches).

Runs the recipe in-process on the tiny task through its public steps (``setup``, ``train``,
the checkpoints it saves), 2 PPO steps of one or two optimizer updates each.
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


# ``overrides`` and the optimizer updates U they give a PPO step; the run's 2 steps take 2U.
SAMPLING = {
    # one minibatch of the whole batch of 8 responses
    "one_sample": ([], 1),
    # 4 prompts x 2 samples = 8 responses, minibatches of 4 responses
    "two_samples": (["batch_size=4", "num_samples_per_prompt=2", "ppo_batch_size=4"], 2),
}


@pytest.mark.parametrize("sampling", SAMPLING)
def test_first_update_at_warmup_lr_zero_leaves_the_weights(tmp_path, sampling):
    from ppo_full_finetune import PPOFullFinetuneRecipe

    overrides, updates = SAMPLING[sampling]
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(
        [f"output_dir={tmp_path / 'run'}", *ONE_UPDATE_A_STEP, *overrides]))
    cfg = validate_config(cfg)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    lrs = []
    try:
        recipe.train(on_step=lambda step, metrics: lrs.append(metrics["lr"]))
    finally:
        recipe.cleanup()
    base = float(cfg.optimizer.lr)
    # logged after each step's U updates: the cosine over N = 2U optimizer steps with 1 of
    # warm-up is at 0.5 (1 + cos(pi (U - 1) / (N - 1))): 1 for U = 1, 0.75 for U = 2; then at its
    # end, 0. A schedule built for another number of steps would be elsewhere at both.
    first = {1: 1.0, 2: 0.75}[updates]
    assert lrs == [pytest.approx(base * first, rel=1e-6), pytest.approx(0.0, abs=1e-12)]

    root = tmp_path / "run" / checkpointing.CHECKPOINTS_DIRNAME
    state = checkpointing.load_training_state(root / "step_2")
    # the scheduler stepped once per optimizer step, and the optimizer took 2U of them
    assert state["lr_scheduler"]["last_epoch"] == 2 * updates
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {2 * updates}
    if updates > 1:  # the second update of step 1 ran at the base LR: the weights moved
        return
    for model, asset in STARTING.items():
        start = _weights(torchtune_ppo.asset_path(asset))
        after_1, after_2 = _weights(root / "step_1" / model), _weights(root / "step_2" / model)
        # the first update ran at LR 0 (a scheduler stepped before it would give it the base LR)
        assert _changed(after_1, start) == [], model
        # the second ran at the base LR and trained every weight that had a gradient
        assert len(_changed(after_2, start)) > len(start) // 2, model
