"""The recipe config: its schema, validation before any weights load, and the compile block."""

from torchtune_ppo.config.checks import *  # noqa: F401,F403
from torchtune_ppo.config.checks import (  # noqa: F401
    CompileConfig,
    check_cli_overrides,
    check_compile_mode,
    check_sampling,
    check_sequence_length,
    cpu_threads,
    instantiate_dataset,
    parse_compile,
    validate_config,
    validate_dataset,
    validate_with_tokenizer,
    with_defaults,
)
