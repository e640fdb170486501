"""The recipe config: its schema, validation before any weights load, and the compile block.

``schema`` declares every key once (kind, default, doc); ``checks`` validates a config against
it and calls the rules between keys, which live by subject: ``batches``, ``weights``,
``generation``, ``training``, ``machine``; ``data_files`` reads the dataset with errors that
point at the data.
"""

from torchtune_ppo.config.batches import check_whole_groups, check_world_size, prompt_sharing, share_group_prompt
from torchtune_ppo.config.checks import VALID_KEYS, check_cli_overrides, validate_config, with_defaults
from torchtune_ppo.config.data_files import instantiate_dataset, validate_dataset
from torchtune_ppo.config.generation import check_sampling, validate_with_tokenizer
from torchtune_ppo.config.machine import check_device, cpu_threads
from torchtune_ppo.config.schema import (
    BOOL_KEYS,
    COMPILE_KEYS,
    COMPILE_MODES,
    COMPILE_REGIONS,
    DEVICES,
    KEYS,
    LONG_PROMPTS,
    LOSS_KEYS,
    NOTED_KEYS,
    OPTIONAL_KEYS,
    REQUIRED,
    REQUIRED_KEYS,
    SCHEMA,
    CompileConfig,
    Key,
    check_compile_mode,
    markdown_table,
    parse_compile,
)
from torchtune_ppo.config.weights import CHECKPOINTERS, check_sequence_length, shares_reward_value_base

__all__ = [
    "BOOL_KEYS",
    "CHECKPOINTERS",
    "COMPILE_KEYS",
    "COMPILE_MODES",
    "COMPILE_REGIONS",
    "DEVICES",
    "KEYS",
    "LONG_PROMPTS",
    "LOSS_KEYS",
    "NOTED_KEYS",
    "OPTIONAL_KEYS",
    "REQUIRED",
    "REQUIRED_KEYS",
    "SCHEMA",
    "VALID_KEYS",
    "CompileConfig",
    "Key",
    "check_cli_overrides",
    "check_compile_mode",
    "check_device",
    "check_sampling",
    "check_sequence_length",
    "check_whole_groups",
    "check_world_size",
    "cpu_threads",
    "instantiate_dataset",
    "markdown_table",
    "parse_compile",
    "prompt_sharing",
    "share_group_prompt",
    "shares_reward_value_base",
    "validate_config",
    "validate_dataset",
    "validate_with_tokenizer",
    "with_defaults",
]
