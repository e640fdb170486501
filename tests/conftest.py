import os
import sys
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (the test command runs 2 workers on 2 cores) each worker and every process
# it starts uses one thread: an OpenMP thread whose peer is descheduled spins waiting for it,
# which made two 2-thread processes on 2 cores 30-70x slower here. The recipe's `cpu_threads:
# auto` reads OMP_NUM_THREADS too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
from torchtune.models.llama2 import llama2, llama2_classifier

ROOT = Path(__file__).parents[1]
TINY_CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
TUNE = [sys.executable, "-m", "torchtune._cli.tune"]  # `tune`, in this interpreter
# The tiny task at test size: 8 prompts a step in 2 generation chunks; 2 PPO epochs of 2
# minibatches of 2 micro-batches each.
SMALL = [
    "batch_size=8",
    "forward_batch_size=4",
    "ppo_batch_size=4",
    "gradient_accumulation_steps=2",
    "ppo_epochs=2",
    "max_generated_tokens=12",
]

VOCAB = 64
PAD_ID = 0
EOS_ID = 2


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    """2-layer GQA llama (4 heads, 2 kv heads), random weights."""
    torch.manual_seed(seed)
    return llama2(
        vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        max_seq_len=64, intermediate_dim=64,
    )


def tiny_classifier(seed: int = 1) -> torch.nn.Module:
    """2-layer llama classifier with one output, random weights."""
    torch.manual_seed(seed)
    return llama2_classifier(
        num_classes=1, vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2,
        embed_dim=32, max_seq_len=64, intermediate_dim=64,
    )


def left_padded_prompts(lengths, prompt_len, seed=0):
    """[len(lengths), prompt_len] prompts of the given real lengths, no pad/eos tokens inside."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), prompt_len), PAD_ID, dtype=torch.long)
    for i, n in enumerate(lengths):
        if n:
            out[i, prompt_len - n:] = torch.randint(3, VOCAB, (n,), generator=g)
    return out


def assert_compiled_matches_eager(compiled, eager, steps: int) -> None:
    """A compiled run's logged metrics against the eager run's, step by step.

    Same seed, same sampled tokens: the trajectories match closely. fp32 kernels differ in
    summation order between inductor and eager (~1e-6 relative per op); a few PPO steps of
    AdamW at lr 3e-4 amplify that to ~1e-4 in the logged values, far below a real bug (a wrong
    mask or position moves scores and losses by >1e-2).
    """
    for step in range(steps):
        for key in ("scores", "response_lengths", "num_stop_tokens"):
            assert compiled[step][key] == pytest.approx(eager[step][key], rel=1e-3, abs=1e-3), (step, key)
        for key in ("loss", "policy_loss", "value_loss", "kl", "approx_policy_kl"):
            assert compiled[step][key] == pytest.approx(eager[step][key], rel=2e-2, abs=2e-4), (step, key)
        # ratios sit within ~1e-2 of 1: compare their deviation from 1, not the ratio itself
        assert compiled[step]["ratios"] - 1 == pytest.approx(eager[step]["ratios"] - 1, rel=2e-2, abs=2e-5), step


@pytest.fixture
def models():
    policy, ref = tiny_policy(0), tiny_policy(0)
    value, reward = tiny_classifier(1), tiny_classifier(2)
    for m in (ref, reward):
        m.eval().requires_grad_(False)
    return policy, ref, value, reward


# In-process recipes: 8 prompts a step in 2 generation chunks of 4, 8 response tokens.
RECIPE_SHAPE = dict(batch_size=8, forward_batch_size=4, ppo_batch_size=4, gradient_accumulation_steps=2,
                    max_generated_tokens=8, log_samples_every_n_steps="null")


def recipe_config(output_dir, name: str = "ppo_tiny_sentiment.yaml", **overrides):
    """A shipped tiny config (``recipes/configs/tiny/<name>``) at ``RECIPE_SHAPE``, with
    ``overrides`` (dotted keys), validated."""
    from omegaconf import OmegaConf

    from torchtune_ppo.config import validate_config

    items = {**RECIPE_SHAPE, "output_dir": output_dir, **overrides}
    cfg = OmegaConf.merge(OmegaConf.load(TINY_CONFIG.parent / name),
                          OmegaConf.from_dotlist([f"{k}={v}" for k, v in items.items()]))
    return validate_config(cfg)


@pytest.fixture
def make_recipe(tmp_path):
    """``make_recipe(name=..., output_dir=..., **overrides) -> (recipe, cfg)``: the recipe set up in
    this process (``output_dir`` defaults to a folder of its own), cleaned up after the test."""
    from ppo_full_finetune import PPOFullFinetuneRecipe

    recipes = []

    def make(name="ppo_tiny_sentiment.yaml", output_dir=None, **overrides):
        cfg = recipe_config(output_dir or tmp_path / f"run{len(recipes)}", name, **overrides)
        recipe = PPOFullFinetuneRecipe(cfg)
        recipe.setup(cfg)
        recipes.append(recipe)
        return recipe, cfg

    yield make
    for recipe in recipes:
        recipe.cleanup()


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e (``tune run``, torchrun, subprocesses) is ``slow``; unit and
    parity tests that compile or load real weights carry the marker themselves."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)
