"""A key inside a component block that its ``_component_`` does not take (``optimizer.lrr``) stops
``validate_config`` before anything is built, naming the full key, the component and the
closest valid names; the shipped configs all pass."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.config import validate_config
from torchtune_ppo.config.components import check_component_arguments

CONFIGS = Path(__file__).parents[2] / "recipes/configs"
SHIPPED = sorted(CONFIGS.rglob("*.yaml"))
SENTIMENT, ARITHMETIC = CONFIGS / "tiny/ppo_tiny_sentiment.yaml", CONFIGS / "tiny/ppo_tiny_arithmetic.yaml"
SCHEDULER = "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup"


def _cfg(config=SENTIMENT, *overrides):
    return OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist(list(overrides)))


@pytest.mark.parametrize("config", SHIPPED, ids=[str(c.relative_to(CONFIGS)) for c in SHIPPED])
def test_every_shipped_config_passes(config):
    check_component_arguments(OmegaConf.load(config))


@pytest.mark.parametrize("override, key, component, close", [
    ("optimizer.lrr=1e-5", "optimizer.lrr", "torch.optim.AdamW", "'lr'"),
    ("dataset.colum=prompt", "dataset.colum", "torchtune.datasets.text_completion_dataset", "'column'"),
    ("dataset.fild=train", "dataset.fild", "torchtune.datasets.text_completion_dataset", "'field'"),
    ("tokenizer.pth=x", "tokenizer.pth", "torchtune.models.llama2.llama2_tokenizer", "'path'"),
    ("checkpointer.model_typ=LLAMA2", "checkpointer.model_typ", "torchtune.training.FullModelHFCheckpointer",
     "'model_type'"),
    ("value_checkpointer.checkpoint_file=[a]", "value_checkpointer.checkpoint_file",
     "torchtune.training.FullModelHFCheckpointer", "'checkpoint_files'"),
])
def test_a_typo_in_a_block_names_the_key_the_component_and_the_closest_names(override, key, component, close):
    with pytest.raises(ValueError) as info:
        validate_config(_cfg(SENTIMENT, override))
    message = str(info.value)
    name = key.rsplit(".", 1)[1]
    assert message.startswith(f"{key}: {component} takes no argument {name!r}. Did you mean {close}")
    assert "Its arguments are [" in message


def test_the_optimizer_lists_its_arguments_but_not_the_recipes():
    with pytest.raises(ValueError) as info:
        validate_config(_cfg(SENTIMENT, "optimizer.lrr=1e-5"))
    message = str(info.value)
    assert "Its arguments are ['lr', 'betas', 'eps', 'weight_decay'," in message
    assert "(params: given by the recipe)." in message


def test_a_model_builder_without_arguments_is_named_before_it_is_built():
    # Before this check the meta-device build of the policy raised a bare TypeError.
    with pytest.raises(ValueError, match=re.escape(
            "policy_model.dim: torchtune_ppo.tasks.tiny_sentiment.tiny_policy takes no argument 'dim'. "
            "It takes no arguments.")):
        validate_config(_cfg(SENTIMENT, "policy_model.dim=8"))


def test_an_lr_scheduler_typo_is_named():
    cfg = _cfg(SENTIMENT)
    cfg.lr_scheduler = {"_component_": SCHEDULER, "num_warmup_step": 2}
    with pytest.raises(ValueError, match=re.escape(
            f"lr_scheduler.num_warmup_step: {SCHEDULER} takes no argument 'num_warmup_step'. "
            "Did you mean 'num_warmup_steps'?")):
        validate_config(cfg)
    cfg.lr_scheduler = {"_component_": SCHEDULER, "num_warmup_steps": 2}  # the rest the recipe passes
    validate_config(cfg)


def test_a_nested_reward_block_is_checked():
    cfg = _cfg(ARITHMETIC)
    cfg.reward = {"_component_": "torchtune_ppo.rewards.WeightedSum", "weights": [1.0, 0.1],
                  "rewards": [{"_component_": "torchtune_ppo.rewards.ExactMatch"},
                              {"_component_": "torchtune_ppo.rewards.FormatMatch", "patern": "^x$"}]}
    with pytest.raises(ValueError, match=re.escape(
            "reward.rewards[1].patern: torchtune_ppo.rewards.FormatMatch takes no argument 'patern'. "
            "Did you mean 'pattern'?")):
        validate_config(cfg)
    cfg.reward.rewards[1] = {"_component_": "torchtune_ppo.rewards.FormatMatch", "pattern": "^x$"}
    validate_config(cfg)


@pytest.mark.parametrize("override, key", [
    ("optimizer.params=[]", "optimizer.params"),
    ("dataset.tokenizer=x", "dataset.tokenizer"),
])
def test_an_argument_the_recipe_passes_is_refused(override, key):
    with pytest.raises(ValueError, match=re.escape(f"{key}: the recipe passes {key.split('.')[1]!r} to ")):
        validate_config(_cfg(SENTIMENT, override))


def test_a_component_that_takes_any_keyword_accepts_anything():
    # torchtune's DiskLogger takes **kwargs.
    validate_config(_cfg(SENTIMENT, "metric_logger.flush_every=3"))


def test_missing_arguments_are_not_errors():
    cfg = _cfg(SENTIMENT)
    del cfg.checkpointer["output_dir"]  # required by the checkpointer, but only extra keys are refused here
    check_component_arguments(cfg)


def test_a_misspelt_component_is_named_with_the_closest_paths():
    with pytest.raises(ValueError, match=re.escape(
            "optimizer._component_: cannot import 'torch.optim.AdamWW': torch.optim has no 'AdamWW'. "
            "Did you mean 'torch.optim.AdamW'")):
        validate_config(_cfg(SENTIMENT, "optimizer._component_=torch.optim.AdamWW"))


def test_a_component_of_a_package_not_installed_is_left_to_where_it_is_built():
    # e.g. the Mistral config's bitsandbytes optimizer on a machine without bitsandbytes
    check_component_arguments(_cfg(SENTIMENT, "optimizer._component_=not_installed_here.optim.Adam"))
