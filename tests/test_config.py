"""A bad config stops in validation, before any weights are read, with a message naming the key."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.config import CompileConfig, parse_compile, validate_config

CONFIG = Path(__file__).parents[1] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"


def _cfg(**overrides):
    cfg = OmegaConf.load(CONFIG)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def test_shipped_config_is_valid():
    cfg = validate_config(_cfg())
    assert cfg.batch_size == 32 and cfg.ppo_epochs == 2


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"forward_batch_size": 12}, r"batch_size \(32\) must be divisible by forward_batch_size \(12\)"),
        ({"ppo_batch_size": 10}, r"batch_size \(32\) must be divisible by ppo_batch_size \(10\)"),
        (
            {"gradient_accumulation_steps": 3},
            r"ppo_batch_size \(16\) must be divisible by gradient_accumulation_steps \(3\)",
        ),
        ({"max_generated_tokens": 500}, r"max_prompt_len \+ max_generated_tokens .*exceeds policy_model's max_seq_len"),
        ({"stop_token_ids": "[]"}, r"stop_token_ids must be a non-empty list"),
        ({"stop_token_ids": "null"}, r"stop_token_ids must be a non-empty list"),
        ({"batch_size": 0}, r"batch_size must be a positive integer, got 0"),
        ({"temperature": 0}, r"temperature must be a number > 0"),
        ({"top_p": 1.5}, r"top_p must be null or a number in \(0, 1\]"),
        ({"long_prompts": "drop"}, r"long_prompts must be one of \['truncate', 'error'\]"),
        ({"compile.generate": True, "compile.decode": True}, r"compile: unknown key\(s\) \['decode'\]; valid keys are \['generate', 'trajectory', 'loss_step', 'rollout', 'mode'\]"),
        ({"btach_size": 4}, r"unknown config key\(s\) \['btach_size'\]"),
    ],
)
def test_bad_values_name_the_key(overrides, pattern):
    cfg = _cfg(**{k: v for k, v in overrides.items() if not k.startswith("compile.")})
    if any(k.startswith("compile.") for k in overrides):
        cfg.compile = {k.split(".", 1)[1]: v for k, v in overrides.items()}
    with pytest.raises(ValueError, match=pattern):
        validate_config(cfg)


def test_missing_checkpoint_file_names_checkpointer_and_path(tmp_path):
    cfg = _cfg()
    cfg.value_checkpointer.checkpoint_files = ["missing.safetensors"]
    with pytest.raises(FileNotFoundError, match=r"value_checkpointer: checkpoint file .*missing.safetensors"):
        validate_config(cfg)


def test_missing_required_key():
    cfg = _cfg()
    del cfg["stop_token_ids"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['stop_token_ids'\]"):
        validate_config(cfg)


def test_compile_bare_bool_and_mapping():
    assert parse_compile(True) == CompileConfig(True, True, True)
    assert parse_compile(False) == CompileConfig(False, False, False)
    assert parse_compile({"loss_step": True}) == CompileConfig(False, False, True)
    assert parse_compile({"generate": True, "mode": "reduce-overhead"}).mode == "reduce-overhead"
    with pytest.raises(ValueError, match=r"compile.mode must be one of"):
        parse_compile({"mode": "fast"})
    with pytest.raises(ValueError, match=r"compile.trajectory must be true or false"):
        parse_compile({"trajectory": "yes"})
