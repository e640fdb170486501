"""Validation of the recipe config, done in one place before any model is loaded."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config as tt_config

COMPILE_KEYS = ("generate", "trajectory", "loss_step", "rollout", "mode")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CHECKPOINTERS = (
    "checkpointer",
    "ref_policy_checkpointer",
    "value_checkpointer",
    "reward_checkpointer",
)
REQUIRED_KEYS = (
    "output_dir",
    "tokenizer",
    "dataset",
    "policy_model",
    "reward_and_value_model",
    *CHECKPOINTERS,
    "optimizer",
    "batch_size",
    "forward_batch_size",
    "ppo_batch_size",
    "num_steps",
    "max_prompt_len",
    "max_generated_tokens",
    "stop_token_ids",
)
OPTIONAL_KEYS = {
    "device": "cpu",
    "dtype": "fp32",
    "seed": None,
    "shuffle": True,
    "ppo_epochs": 1,
    "gradient_accumulation_steps": 1,
    "temperature": 1.0,
    "top_k": None,
    "top_p": None,
    "long_prompts": "truncate",
    "penalise_no_eos": True,
    "min_response_length": None,
    "reward_penalty": -3.0,
    "kl_coeff": 0.05,
    "gamma": 1.0,
    "lmbda": 0.95,
    "loss": {"epsilon": 0.2, "value_clip_range": 0.2, "value_coeff": 0.1},
    "clip_grad_norm": None,
    "compile": False,
    "enable_activation_checkpointing": False,
    "save_every_n_steps": None,
    "metric_logger": None,
    "log_every_n_steps": 1,
    "log_peak_memory_stats": False,
    "resume_from_checkpoint": False,
}
VALID_KEYS = tuple(REQUIRED_KEYS) + tuple(OPTIONAL_KEYS)
LONG_PROMPTS = ("truncate", "error")


@dataclass(frozen=True)
class CompileConfig:
    """Which regions run compiled (``compile:`` in the YAML)."""

    generate: bool = False
    trajectory: bool = False
    loss_step: bool = False
    # Steps 1-6 as one region (unrolled generation + scoring); replaces generate/trajectory.
    rollout: bool = False
    mode: str = "default"


def parse_compile(value: Any) -> CompileConfig:
    """``compile: true|false`` sets every region; a mapping sets them one by one."""
    if isinstance(value, bool):
        return CompileConfig(value, value, value)
    if isinstance(value, (dict, DictConfig)):
        value = dict(value)
        unknown = sorted(set(value) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(
                f"compile: unknown key(s) {unknown}; valid keys are {list(COMPILE_KEYS)}, "
                "or write a bare `compile: true|false` to set all regions."
            )
        for key in ("generate", "trajectory", "loss_step", "rollout"):
            if key in value and not isinstance(value[key], bool):
                raise ValueError(f"compile.{key} must be true or false, got {value[key]!r}.")
        mode = value.get("mode", "default")
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile.mode must be one of {list(COMPILE_MODES)}, got {mode!r}.")
        return CompileConfig(
            generate=value.get("generate", False),
            trajectory=value.get("trajectory", False),
            loss_step=value.get("loss_step", False),
            rollout=value.get("rollout", False),
            mode=mode,
        )
    raise ValueError(
        f"compile must be true, false or a mapping with keys {list(COMPILE_KEYS)}, got {value!r}."
    )


def with_defaults(cfg: DictConfig) -> DictConfig:
    """Fill optional keys with their defaults (a copy; the user's config is left as given)."""
    merged = OmegaConf.create(OPTIONAL_KEYS)
    return OmegaConf.merge(merged, cfg)


def _positive_int(cfg: DictConfig, key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}.")
    return value


def _checkpoint_files(cfg_ckpt: DictConfig, key: str) -> List[Path]:
    if "checkpoint_dir" not in cfg_ckpt or "checkpoint_files" not in cfg_ckpt:
        raise ValueError(f"{key} needs checkpoint_dir and checkpoint_files.")
    ckpt_dir = Path(cfg_ckpt.checkpoint_dir)
    files = cfg_ckpt.checkpoint_files
    if isinstance(files, (DictConfig, dict)):  # torchtune's {filename_format, max_filename}
        from torchtune.training.checkpointing._utils import FormattedCheckpointFiles

        files = FormattedCheckpointFiles.from_dict(
            OmegaConf.to_container(cfg_ckpt.checkpoint_files)
        ).build_checkpoint_filenames()
    return [ckpt_dir / f for f in files]


def _model_max_seq_len(cfg_model: DictConfig, key: str) -> Optional[int]:
    # Built on the meta device: no memory, no weights, just the module's settings.
    with torch.device("meta"):
        model = tt_config.instantiate(cfg_model)
    return getattr(model, "max_seq_len", None)


def validate_config(cfg: DictConfig) -> DictConfig:
    """Check a recipe config and return it with defaults filled in.

    Every check runs before any weights are read, and each error names the key, quotes the
    value and says what would be valid.

    Raises:
        ValueError: on a missing, unknown or inconsistent key.
        FileNotFoundError: when a checkpoint file named in a checkpointer does not exist.
    """
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}.")
    unknown = sorted(set(cfg.keys()) - set(VALID_KEYS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys are {sorted(VALID_KEYS)}.")
    cfg = with_defaults(cfg)

    for key in (
        "batch_size",
        "forward_batch_size",
        "ppo_batch_size",
        "ppo_epochs",
        "gradient_accumulation_steps",
        "num_steps",
        "max_prompt_len",
        "max_generated_tokens",
        "log_every_n_steps",
    ):
        _positive_int(cfg, key)
    if cfg.batch_size % cfg.forward_batch_size:
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by forward_batch_size "
            f"({cfg.forward_batch_size}); e.g. forward_batch_size={_divisor(cfg.batch_size, cfg.forward_batch_size)}."
        )
    if cfg.batch_size % cfg.ppo_batch_size:
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by ppo_batch_size "
            f"({cfg.ppo_batch_size}); e.g. ppo_batch_size={_divisor(cfg.batch_size, cfg.ppo_batch_size)}."
        )
    if cfg.ppo_batch_size % cfg.gradient_accumulation_steps:
        raise ValueError(
            f"ppo_batch_size ({cfg.ppo_batch_size}) must be divisible by "
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps})."
        )
    if cfg.save_every_n_steps is not None:
        _positive_int(cfg, "save_every_n_steps")

    stop = cfg.stop_token_ids
    if (
        not isinstance(stop, (list, ListConfig))
        or len(stop) == 0
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop)
    ):
        raise ValueError(
            f"stop_token_ids must be a non-empty list of token ids (e.g. [<eos_id>]), got {stop!r}: "
            "responses are truncated at the first stop token."
        )
    if not (isinstance(cfg.temperature, (int, float)) and cfg.temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {cfg.temperature!r}.")
    if cfg.top_k is not None and (not isinstance(cfg.top_k, int) or cfg.top_k < 1):
        raise ValueError(f"top_k must be null or an integer >= 1, got {cfg.top_k!r}.")
    if cfg.top_p is not None and not (isinstance(cfg.top_p, (int, float)) and 0 < cfg.top_p <= 1):
        raise ValueError(f"top_p must be null or a number in (0, 1], got {cfg.top_p!r}.")
    if cfg.long_prompts not in LONG_PROMPTS:
        raise ValueError(f"long_prompts must be one of {list(LONG_PROMPTS)}, got {cfg.long_prompts!r}.")
    if cfg.dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {cfg.dtype!r}.")
    if cfg.min_response_length is not None:
        _positive_int(cfg, "min_response_length")
    parse_compile(cfg.compile)

    for key in CHECKPOINTERS:
        for path in _checkpoint_files(cfg[key], key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{key}: checkpoint file {str(path)!r} does not exist; check "
                    f"{key}.checkpoint_dir and {key}.checkpoint_files."
                )

    total = cfg.max_prompt_len + cfg.max_generated_tokens
    for key in ("policy_model", "reward_and_value_model"):
        max_seq_len = _model_max_seq_len(cfg[key], key)
        if max_seq_len is not None and total > max_seq_len:
            raise ValueError(
                f"max_prompt_len + max_generated_tokens ({cfg.max_prompt_len} + "
                f"{cfg.max_generated_tokens} = {total}) exceeds {key}'s max_seq_len "
                f"({max_seq_len}); lower one of them."
            )
    return cfg


def _divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), -d))

