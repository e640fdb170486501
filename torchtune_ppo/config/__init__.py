"""The recipe config: its schema, validation before any weights load, and the compile block.

``schema`` declares every key once (kind, default, doc); ``checks`` validates a config against
it and checks the rules between keys; ``data_files`` reads the dataset with errors that point
at the data.
"""

from torchtune_ppo.config.checks import (
    CHECKPOINTERS,
    VALID_KEYS,
    check_cli_overrides,
    check_device,
    check_sampling,
    check_sequence_length,
    check_whole_groups,
    check_world_size,
    cpu_threads,
    shares_reward_value_base,
    validate_config,
    validate_with_tokenizer,
    with_defaults,
)
from torchtune_ppo.config.data_files import instantiate_dataset, validate_dataset
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
    "shares_reward_value_base",
    "validate_config",
    "validate_dataset",
    "validate_with_tokenizer",
    "with_defaults",
]
