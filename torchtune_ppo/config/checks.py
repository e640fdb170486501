"""Validation of the recipe config, done in one place before any model is loaded.

A PPO run spends minutes loading four models and compiling before its first step, and a bad
value can surface hundreds of steps later (or never, as a silently different run). Everything
that can be checked without weights is checked here, in this order by the recipe:

1. ``check_cli_overrides(sys.argv[1:])`` and ``validate_config(cfg)``: keys, types, ranges,
   the compile block, the device, checkpoint files, and the models' settings read from a
   build on the meta device.
2. ``validate_with_tokenizer(cfg, tokenizer)``: right after the tokenizer is instantiated.
3. ``instantiate_dataset(cfg.dataset, tokenizer)`` then ``validate_dataset(dataset, cfg)``:
   before any weights are read.

Every error names the key (dotted, e.g. ``loss.epsilon``), quotes the value and says what
would be valid.
"""

import importlib
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config as tt_config

COMPILE_REGIONS = ("generate", "trajectory", "loss_step", "rollout")
COMPILE_KEYS = (*COMPILE_REGIONS, "mode")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEVICES = ("cpu", "cuda", "mps", "xpu", "npu")
LOSS_KEYS = ("epsilon", "value_clip_range", "value_coeff")
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
    *CHECKPOINTERS[:3],  # reward_checkpointer: unless `reward` is a function
    "optimizer",
    "batch_size",
    "forward_batch_size",
    "ppo_batch_size",
    "max_generated_tokens",
    "stop_token_ids",
)
OPTIONAL_KEYS = {
    # PPO steps to run. A config written for torchtune's recipe gives `num_steps` instead,
    # which counts prompts there (num_steps // batch_size PPO steps); exactly one is required.
    "num_ppo_steps": None,
    # null: the longest prompt of the dataset (read once before any model loads).
    "max_prompt_len": None,
    "device": "cpu",
    # Threads for CPU work. "auto": every core but one, so that one other busy process does
    # not deschedule an OpenMP thread its peers spin-wait for (measured on 2 cores with one
    # busy process: 2 threads 1.16 s a step, 1 thread 0.36 s; quiet: 0.26 s and 0.37 s). An
    # OMP_NUM_THREADS in the environment wins over "auto". An int: exactly that many.
    "cpu_threads": "auto",
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
    # Plain keys. A `_component_` block (torchtune's PPOLoss) keeps its own defaults instead.
    "loss": {"epsilon": 0.2, "value_clip_range": 0.2, "value_coeff": 0.1},
    "clip_grad_norm": None,
    "compile": False,
    "enable_activation_checkpointing": False,
    # null: save only at the end; N: also every N PPO steps.
    "save_every_n_steps": None,
    # null: keep every checkpoint; N: delete all but the newest N, so long runs fit on disk.
    "keep_last_n_checkpoints": None,
    # An update whose loss or gradients are not finite is skipped; this many skipped in a row
    # means the run has diverged, so it stops instead of burning the rest of its steps.
    "max_consecutive_skipped_steps": 3,
    # null: none; N: also save after every N passes over the dataset (torchtune's key).
    "save_every_n_epochs": None,
    "metric_logger": None,
    "log_every_n_steps": 1,
    # null: never; N: print a few (prompt, response, score) rows every N steps and append them
    # to <output_dir>/logs/samples.jsonl (and to wandb as a table when a wandb run is active).
    "log_samples_every_n_steps": None,
    "log_peak_memory_stats": False,
    "resume_from_checkpoint": False,
    # Whiten the per-token rewards before GAE (torchtune's key; its default is off).
    "whiten_rewards": False,
    # One optimizer per parameter, stepped during backward: no full set of gradients is ever
    # held (how torchtune fits 7B on one GPU). Needs gradient_accumulation_steps=1.
    "optimizer_in_bwd": False,
    # On several processes (torchrun): shard the frozen reference policy and reward model with
    # FSDP2 like the trained models (1/W of their weights per rank, gathered layer by layer
    # for their no-grad forwards) instead of a whole copy on every rank. No effect on 1 process.
    "shard_frozen_models": False,
    # torchtune's learning-rate schedulers, e.g. torchtune.training.lr_schedulers.
    # get_cosine_schedule_with_warmup with num_warmup_steps; the recipe passes the optimizer
    # and num_training_steps (optimizer steps of the whole run). null: constant lr.
    "lr_scheduler": None,
    # torchtune's profiler block (torchtune.training.setup_torch_profiler); null: off.
    "profiler": None,
    # null: the reward model of reward_checkpointer. A mapping with `_component_`: a reward
    # function of the decoded texts (torchtune_ppo.rewards), instead of a reward model.
    "reward": None,
    "reward_checkpointer": None,
}
# Keys of torchtune 0.6.1's PPO recipe config that mean nothing here, with the note printed
# once when a config gives them.
NOTED_KEYS = {
    "enable_kv_cache": "generation always uses a static KV cache here; enable_kv_cache is ignored.",
}
VALID_KEYS = tuple(REQUIRED_KEYS) + tuple(OPTIONAL_KEYS) + ("num_steps",)
LONG_PROMPTS = ("truncate", "error")
BOOL_KEYS = (
    "whiten_rewards",
    "optimizer_in_bwd",
    "shard_frozen_models",
    "shuffle",
    "penalise_no_eos",
    "enable_activation_checkpointing",
    "log_peak_memory_stats",
    "resume_from_checkpoint",
)
# How many over-long prompts an error lists by index; the count covers all of them.
_LISTED_PROMPTS = 5


@dataclass(frozen=True)
class CompileConfig:
    """Which regions run compiled (``compile:`` in the YAML)."""

    generate: bool = False
    trajectory: bool = False
    loss_step: bool = False
    # Steps 1-6 as one region (unrolled generation + scoring); replaces generate/trajectory.
    rollout: bool = False
    mode: str = "default"


# --------------------------------------------------------------------------------------------
# Checks shared with the modules that take these values as plain arguments (e.g. Generator).
# --------------------------------------------------------------------------------------------


def check_sampling(temperature: Any, top_k: Any, top_p: Any, prefix: str = "") -> None:
    """Check the sampling settings of generation.

    Args:
        temperature (Any): must be a finite number > 0.
        top_k (Any): ``None`` or an integer >= 1.
        top_p (Any): ``None`` or a number in (0, 1].
        prefix (str): text put before each key name in the message, e.g. ``"Generator: "``
            or a dotted parent such as ``"sampling."``.

    Raises:
        ValueError: naming the first invalid setting, its value and the valid range.
    """
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"{prefix}temperature must be a number > 0 (for greedy decoding use top_k=1), "
            f"got {_show(temperature)}."
        )
    if top_k is not None and not (_is_int(top_k) and top_k >= 1):
        raise ValueError(f"{prefix}top_k must be null or an integer >= 1, got {_show(top_k)}.")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"{prefix}top_p must be null or a number in (0, 1], got {_show(top_p)}.")


def check_compile_mode(mode: Any, key: str = "compile.mode") -> None:
    """Check a ``torch.compile`` mode.

    Args:
        mode (Any): the mode to check.
        key (str): how the message names the setting.

    Raises:
        ValueError: when ``mode`` is not one of ``COMPILE_MODES``.
    """
    if not isinstance(mode, str) or mode not in COMPILE_MODES:
        raise ValueError(f"{key} must be one of {list(COMPILE_MODES)}, got {_show(mode)}.")


def check_device(device: Any, key: str = "device") -> None:
    """Check that a device string names a device this machine has.

    torchtune's ``get_device("cuda")`` runs on the CPU without a word when no GPU is present,
    which turns a GPU run into a CPU run that looks like it is merely slow.

    Args:
        device (Any): ``None`` (torchtune picks from the machine), or ``cpu``, ``cuda``,
            ``cuda:N``, ``mps``, ``xpu``, ``npu`` (``:N`` allowed for all but cpu/mps).
        key (str): how the message names the setting.

    Raises:
        ValueError: on an unknown device string or a device that is not available.
    """
    if device is None:
        return
    valid = "one of cpu, cuda, cuda:N, mps, xpu, npu (or null to pick from the machine)"
    try:
        parsed = torch.device(device) if isinstance(device, str) else None
    except (RuntimeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in DEVICES:
        raise ValueError(f"{key} must be {valid}, got {_show(device)}.")
    kind = parsed.type
    if kind == "cpu":
        return
    available, count, backend = _device_availability(kind)
    if not available:
        raise ValueError(
            f"{key} is {device!r} but this machine has no {kind} device ({backend} is "
            f"False; torch {torch.__version__}). torchtune would run on the CPU instead without "
            f"saying so; set {key}=cpu or install a torch build for {kind}."
        )
    if parsed.index is not None and count is not None and parsed.index >= count:
        raise ValueError(
            f"{key} is {device!r} but only {count} {kind} device(s) are visible; "
            f"use {kind}:0 to {kind}:{count - 1}, or plain {kind}."
        )


def _device_availability(kind: str) -> Tuple[bool, Optional[int], str]:
    if kind == "cuda":
        ok = torch.cuda.is_available()
        return ok, torch.cuda.device_count() if ok else 0, "torch.cuda.is_available()"
    if kind == "mps":
        return torch.backends.mps.is_available(), 1, "torch.backends.mps.is_available()"
    if kind == "xpu":
        ok = hasattr(torch, "xpu") and torch.xpu.is_available()
        return ok, torch.xpu.device_count() if ok else 0, "torch.xpu.is_available()"
    from torchtune.utils._device import is_npu_available  # npu needs the torch_npu plugin

    return bool(is_npu_available), None, "torchtune.utils.is_npu_available"


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------


def parse_compile(value: Any) -> CompileConfig:
    """Read the ``compile`` setting.

    ``compile: true|false`` sets every region (``rollout`` stays off: it replaces
    ``generate`` + ``trajectory``). A mapping must name every region; only ``mode`` is optional.
    A partial mapping is refused because it is what OmegaConf makes of
    ``compile=True compile.generate=False`` on the command line: the bool is dropped, so the
    regions left out could mean either on or off.

    Args:
        value (Any): a bool, or a mapping with keys ``COMPILE_KEYS``.

    Returns:
        CompileConfig: the regions to compile and the mode.

    Raises:
        ValueError: on an unknown key, a missing region, a non-bool region or a bad mode.
    """
    if isinstance(value, bool):
        return CompileConfig(value, value, value)
    if isinstance(value, (dict, DictConfig)):
        block = OmegaConf.to_container(value) if isinstance(value, DictConfig) else dict(value)
        unknown = sorted(set(block) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(
                f"compile: unknown key(s) {unknown}; valid keys are {list(COMPILE_KEYS)}, "
                "or write a bare `compile: true|false` to set all regions."
            )
        for key in COMPILE_REGIONS:
            if key in block and not isinstance(block[key], bool):
                raise ValueError(f"compile.{key} must be true or false, got {_show(block[key])}.")
        missing = [k for k in COMPILE_REGIONS if k not in block]
        if missing:
            example = {k: block.get(k, k != "rollout") for k in COMPILE_REGIONS}
            if "mode" in block:
                example["mode"] = block["mode"]
            raise ValueError(
                f"compile: the block {_flow(block)} does not name the region(s) {missing}. "
                "On the command line `compile=True compile.generate=False` arrives as just "
                "such a block, with the bool dropped, so a region left out could mean on or "
                f"off. Name every region, e.g. compile={_flow(example)}, or use the bare "
                "compile=True|False for all regions."
            )
        mode = block.get("mode", "default")
        check_compile_mode(mode)
        return CompileConfig(**{k: block[k] for k in COMPILE_REGIONS}, mode=mode)
    raise ValueError(
        f"compile must be true, false or a mapping with keys {list(COMPILE_KEYS)}, "
        f"got {_show(value)}."
    )


def check_cli_overrides(args: Sequence[str]) -> None:
    """Refuse command-line overrides that OmegaConf would merge into something else.

    ``compile=True compile.generate=False`` becomes ``{compile: {generate: False}}``: the
    bool is dropped. Merged over a YAML that has a full compile block, the regions not named
    keep the YAML's values, so "everything but generation" silently runs what the YAML says.
    The same holds for any key given both a bare true/false/null and dotted sub-keys.

    Args:
        args (Sequence[str]): the command line after the program name (``sys.argv[1:]``);
            items that are not ``key=value`` are ignored.

    Raises:
        ValueError: naming both overrides and what to write instead.
    """
    bare: Dict[str, str] = {}
    dotted: Dict[str, Dict[str, str]] = {}
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "~")):
            continue
        key, value = arg.split("=", 1)
        if "." in key:
            head, sub = key.split(".", 1)
            dotted.setdefault(head, {})[sub] = value
        else:
            bare[key] = value
    for key, value in bare.items():
        if key not in dotted or value.lower() not in ("true", "false", "null", "none"):
            continue
        subs = dotted[key]
        given = " ".join(f"{key}.{k}={v}" for k, v in subs.items())
        hint = ""
        if key == "compile" and value.lower() in ("true", "false"):
            on = value.lower() == "true"
            full = {k: subs.get(k, str(on and k != "rollout")) for k in COMPILE_REGIONS}
            full.update({k: v for k, v in subs.items() if k not in full})
            hint = " Write every region instead: " + " ".join(
                f"compile.{k}={v}" for k, v in full.items()
            ) + "."
        raise ValueError(
            f"{key}={value} and {given} on one command line: OmegaConf keeps only the "
            f"{key}.* overrides and drops {key}={value}, so the keys not named keep the YAML's "
            f"values instead of following {key}={value}.{hint}"
        )


# --------------------------------------------------------------------------------------------
# validate_config
# --------------------------------------------------------------------------------------------


def with_defaults(cfg: DictConfig) -> DictConfig:
    """Fill optional keys with their defaults (a copy; the user's config is left as given).

    Args:
        cfg (DictConfig): the recipe config.

    Returns:
        DictConfig: a merged copy.
    """
    defaults = dict(OPTIONAL_KEYS)
    loss = cfg.get("loss")
    if isinstance(loss, (DictConfig, dict)) and "_component_" in loss:
        # torchtune's PPOLoss defaults epsilon to 0.1; merging our plain defaults into its
        # block would change what a torchtune config that leaves a key out means.
        del defaults["loss"]
    return OmegaConf.merge(OmegaConf.create(defaults), cfg)


def validate_config(cfg: DictConfig, *, check_machine: bool = True) -> DictConfig:
    """Check a recipe config and return it with defaults filled in.

    Every check runs before any weights are read: the models are built on the meta device to
    read their ``max_seq_len`` and vocabulary size.

    Args:
        cfg (DictConfig): the recipe config as parsed from YAML and the command line.
        check_machine (bool): also check that the checkpoint files exist and the device is
            available here; off to plan a run for another machine (``torchtune_ppo.run.memory``).

    Returns:
        DictConfig: a copy with every optional key set (``OPTIONAL_KEYS``).

    Raises:
        ValueError: on a missing, unknown, mistyped, out-of-range or inconsistent key.
        FileNotFoundError: when a checkpoint file named in a checkpointer does not exist.
    """
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}.")
    cfg = _map_torchtune_keys(cfg)
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
        "num_ppo_steps",
        "max_generated_tokens",
        "log_every_n_steps",
        "max_consecutive_skipped_steps",
    ):
        _positive_int(cfg, key)
    for key in ("save_every_n_steps", "save_every_n_epochs", "keep_last_n_checkpoints",
                "min_response_length", "max_prompt_len", "log_samples_every_n_steps"):
        _positive_int(cfg, key, allow_none=True)
    if cfg.optimizer_in_bwd and cfg.gradient_accumulation_steps != 1:
        raise ValueError(
            f"optimizer_in_bwd=True steps each parameter during backward, so gradients cannot "
            f"accumulate: set gradient_accumulation_steps=1 (got "
            f"{cfg.gradient_accumulation_steps}) or optimizer_in_bwd=False."
        )
    if cfg.optimizer_in_bwd and cfg.lr_scheduler is not None:
        raise ValueError(
            "optimizer_in_bwd=True with an lr_scheduler is not supported (each parameter has its "
            "own optimizer); set lr_scheduler=null or optimizer_in_bwd=False."
        )
    if cfg.optimizer_in_bwd and cfg.clip_grad_norm is not None:
        raise ValueError(
            f"optimizer_in_bwd=True steps each parameter before the global gradient norm is "
            f"known, so clip_grad_norm={cfg.clip_grad_norm} cannot apply: set clip_grad_norm=null "
            "or optimizer_in_bwd=False."
        )
    if cfg.cpu_threads != "auto" and not (_is_int(cfg.cpu_threads) and cfg.cpu_threads >= 1):
        raise ValueError(f"cpu_threads must be 'auto' or a positive integer, got {_show(cfg.cpu_threads)}.")
    if cfg.seed is not None and not _is_int(cfg.seed):
        raise ValueError(f"seed must be null or an integer, got {_show(cfg.seed)}.")
    for key in BOOL_KEYS:
        # A quoted "False" is a non-empty string, so `if cfg.shuffle:` would read it as True.
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be true or false, got {_show(cfg[key])}.")

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
    if cfg.min_response_length is not None and cfg.min_response_length > cfg.max_generated_tokens:
        raise ValueError(
            f"min_response_length ({cfg.min_response_length}) must not exceed "
            f"max_generated_tokens ({cfg.max_generated_tokens}): no response could reach it, "
            "so every one would get reward_penalty. Lower min_response_length, raise "
            "max_generated_tokens, or set min_response_length=null."
        )

    _check_number("kl_coeff", cfg.kl_coeff, "a number >= 0", lambda x: x >= 0)
    _check_number(
        "clip_grad_norm", cfg.clip_grad_norm, "null or a number > 0", lambda x: x > 0,
        allow_none=True,
    )
    _check_number("reward_penalty", cfg.reward_penalty, "a number (usually < 0)")
    for key in ("gamma", "lmbda"):
        _check_number(key, cfg[key], "a number in [0, 1]", lambda x: 0 <= x <= 1)
    cfg.loss = _validate_loss(cfg.loss)
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)

    if cfg.long_prompts not in LONG_PROMPTS:
        raise ValueError(
            f"long_prompts must be one of {list(LONG_PROMPTS)}, got {_show(cfg.long_prompts)}."
        )
    if cfg.dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {_show(cfg.dtype)}.")
    parse_compile(cfg.compile)
    if check_machine:
        check_device(cfg.device)

    stop = cfg.stop_token_ids
    if (
        not isinstance(stop, (list, ListConfig))
        or len(stop) == 0
        or not all(_is_int(t) and t >= 0 for t in stop)
    ):
        raise ValueError(
            f"stop_token_ids must be a non-empty list of token ids (e.g. [<eos_id>]), got {stop!r}: "
            "responses are truncated at the first stop token."
        )

    _check_reward(cfg)
    for key in [k for k in CHECKPOINTERS if cfg[k] is not None] if check_machine else ():
        for path in _checkpoint_files(cfg[key], key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{key}: checkpoint file {str(path)!r} does not exist; check "
                    f"{key}.checkpoint_dir and {key}.checkpoint_files."
                )

    models = {key: _meta_model(cfg[key]) for key in ("policy_model", "reward_and_value_model")}
    if cfg.max_prompt_len is not None:
        check_sequence_length(cfg, cfg.max_prompt_len, models)
    vocab = _vocab_size(models["policy_model"])
    if vocab is not None:
        bad = [t for t in stop if t >= vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids {bad} are outside policy_model's vocabulary [0, {vocab}) "
                f"(policy_model.tok_embeddings.num_embeddings = {vocab}); use ids of the "
                "policy's tokenizer, e.g. its eos_id."
            )
        value_vocab = _vocab_size(models["reward_and_value_model"])
        if value_vocab is not None and value_vocab < vocab:
            raise ValueError(
                f"reward_and_value_model's vocabulary ({value_vocab} tokens) is smaller than "
                f"policy_model's ({vocab}): the value and reward models read every token the "
                "policy writes, so they must share its tokenizer."
            )
    return cfg


def _check_reward(cfg: DictConfig) -> None:
    """Exactly one reward source: ``reward_checkpointer`` (a model) or ``reward`` (a function)."""
    if cfg.reward is None and cfg.reward_checkpointer is None:
        raise ValueError(
            "config has no reward: give reward_checkpointer (a reward model, built with "
            "reward_and_value_model) or reward: {_component_: ...} (a function of the texts, "
            "e.g. torchtune_ppo.rewards.exact_match)."
        )
    if cfg.reward is not None and cfg.reward_checkpointer is not None:
        raise ValueError(
            "config gives both reward (a function) and reward_checkpointer (a reward model); "
            "keep one. With a function reward, reward_and_value_model builds the value model only."
        )
    if cfg.reward is not None:
        if not isinstance(cfg.reward, DictConfig) or "_component_" not in cfg.reward:
            raise ValueError(
                f"reward must be a mapping with a _component_ (a factory returning the reward "
                f"function, e.g. torchtune_ppo.rewards.exact_match), got {_show(cfg.reward)}."
            )
        _import_component(cfg.reward._component_, "reward._component_")
        if parse_compile(cfg.compile).rollout:
            raise ValueError(
                "compile.rollout traces the reward model into one region with generation; a "
                "function reward runs eagerly: set compile.rollout=False (compile.generate and "
                "compile.trajectory still compile everything else)."
            )


def cpu_threads(setting: Any) -> int:
    """The thread count ``cpu_threads`` means on this machine (see ``OPTIONAL_KEYS``)."""
    import os

    if setting != "auto":
        return int(setting)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


def check_sequence_length(
    cfg: DictConfig, prompt_len: int, models: Optional[Mapping[str, torch.nn.Module]] = None
) -> None:
    """``prompt_len + max_generated_tokens`` must fit every model's ``max_seq_len``.

    Args:
        cfg (DictConfig): the recipe config.
        prompt_len (int): ``P``, from ``max_prompt_len`` or, when that is null, the longest prompt.
        models (Optional[Mapping[str, torch.nn.Module]]): meta-device builds by config key;
            built here when None.

    Raises:
        ValueError: naming the model, both lengths and its ``max_seq_len``.
    """
    if models is None:
        models = {key: _meta_model(cfg[key]) for key in ("policy_model", "reward_and_value_model")}
    total = prompt_len + cfg.max_generated_tokens
    for key, model in models.items():
        max_seq_len = getattr(model, "max_seq_len", None)
        if max_seq_len is not None and total > max_seq_len:
            given = "max_prompt_len" if cfg.max_prompt_len is not None else "the longest prompt"
            raise ValueError(
                f"{given} + max_generated_tokens ({prompt_len} + {cfg.max_generated_tokens} = "
                f"{total}) exceeds {key}'s max_seq_len ({max_seq_len}); lower one of them "
                "(max_prompt_len with long_prompts=truncate keeps each prompt's last tokens)."
            )


def _map_torchtune_keys(cfg: DictConfig) -> DictConfig:
    """A copy with torchtune 0.6.1 PPO config keys mapped onto ours, each mapping noted once."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, note in NOTED_KEYS.items():
        if key in cfg:
            _note(f"{key}: {note}")
            del cfg[key]
    if "num_steps" in cfg and cfg.get("num_ppo_steps") is not None:
        raise ValueError(
            f"num_steps ({_show(cfg.num_steps)}) and num_ppo_steps ({_show(cfg.num_ppo_steps)}) "
            "are both set; give one: num_ppo_steps counts PPO steps, num_steps counts prompts "
            "as in torchtune's recipe (num_steps // batch_size PPO steps)."
        )
    if "num_steps" in cfg:
        num_steps, batch_size = cfg.num_steps, cfg.batch_size
        if not (_is_int(num_steps) and _is_int(batch_size) and batch_size >= 1):
            raise ValueError(
                f"num_steps must be an integer count of prompts (as in torchtune's recipe), got "
                f"{_show(num_steps)} with batch_size {_show(batch_size)}."
            )
        if num_steps < batch_size:
            raise ValueError(
                f"num_steps counts prompts, as in torchtune's recipe: num_steps={num_steps} is "
                f"fewer than batch_size={batch_size}, so no PPO step would run. Raise num_steps, "
                "or give num_ppo_steps (PPO steps) instead."
            )
        dropped = f"; the last {num_steps % batch_size} prompts are not used" if num_steps % batch_size else ""
        _note(f"num_steps={num_steps} counts prompts, as in torchtune's recipe: "
              f"{num_steps // batch_size} PPO steps of batch_size={batch_size}{dropped}.")
        cfg.num_ppo_steps = num_steps // batch_size
        del cfg["num_steps"]
    elif cfg.get("num_ppo_steps") is None:
        raise ValueError(
            "config is missing num_ppo_steps (PPO steps to run), or num_steps (prompts, as in "
            "torchtune's recipe)."
        )
    return cfg


_NOTED: set = set()


def _note(message: str) -> None:
    """Logs a note about how a key is read, once per process."""
    if message not in _NOTED:
        _NOTED.add(message)
        from torchtune import utils

        utils.get_logger("INFO").info(f"Note: {message}")


def _validate_loss(loss: Any) -> DictConfig:
    """``loss``: plain keys, or a ``_component_`` block checked without instantiating it."""
    if not isinstance(loss, DictConfig):
        raise ValueError(
            f"loss must be a mapping with keys {list(LOSS_KEYS)} or a "
            f"`_component_: torchtune.rlhf.loss.PPOLoss` block, got {_show(loss)}."
        )
    keys = set(loss.keys())
    if "_component_" in loss:
        path = loss._component_
        params = _signature_defaults(path, "loss._component_")
        if params is not None:
            unknown = sorted(keys - {"_component_"} - set(params))
            if unknown:
                raise ValueError(
                    f"loss: unknown key(s) {unknown} for {path}; its arguments are {list(params)}."
                )
            # Written out so that the numbers checked here are the ones the run uses.
            for key in LOSS_KEYS:
                default = params.get(key, inspect.Parameter.empty)
                if key not in loss and default is not inspect.Parameter.empty:
                    loss[key] = default
    else:
        unknown = sorted(keys - set(LOSS_KEYS))
        if unknown:
            raise ValueError(
                f"loss: unknown key(s) {unknown}; valid keys are {list(LOSS_KEYS)}, or give a "
                "`_component_: torchtune.rlhf.loss.PPOLoss` block."
            )
    checks = {
        "epsilon": ("a number > 0 (the policy ratio is clipped to [1 - epsilon, 1 + epsilon])",
                    lambda x: x > 0),
        "value_clip_range": ("a number > 0", lambda x: x > 0),
        "value_coeff": ("a number >= 0", lambda x: x >= 0),
    }
    for key, (valid, ok) in checks.items():
        if key in loss:
            _check_number(f"loss.{key}", loss[key], valid, ok)
    return loss


def _signature_defaults(path: Any, key: str) -> Optional[Dict[str, Any]]:
    """Arguments of a ``_component_`` and their defaults; None if it takes ``**kwargs``."""
    component = _import_component(path, key)
    try:
        params = inspect.signature(component).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {
        name: p.default
        for name, p in params.items()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
    }


def _import_component(path: Any, key: str) -> Any:
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{key} must be a dotted import path, got {_show(path)}.")
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot import {path!r} ({type(e).__name__}: {e}).") from e


def _positive_int(cfg: DictConfig, key: str, *, allow_none: bool = False) -> Optional[int]:
    value = cfg.get(key)
    if allow_none and value is None:
        return None
    if not _is_int(value) or value < 1:
        valid = "null or a positive integer" if allow_none else "a positive integer"
        raise ValueError(f"{key} must be {valid}, got {_show(value)}.")
    return value


def _check_number(
    key: str,
    value: Any,
    valid: str,
    ok: Callable[[float], bool] = lambda x: True,
    *,
    allow_none: bool = False,
) -> None:
    if allow_none and value is None:
        return
    if not (_is_number(value) and math.isfinite(value) and ok(value)):
        raise ValueError(f"{key} must be {valid}, got {_show(value)}.")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `top_k: true` is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """The value as the user wrote it, with its type when the type is the problem."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool):
        return f"{value!r} (a bool)"
    if isinstance(value, str):
        return f"{value!r} (a string)"
    return repr(value)


def _flow(block: Mapping[str, Any]) -> str:
    """A mapping in the flow form the command line and YAML both accept."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in block.items()) + "}"


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


def _meta_model(cfg_model: DictConfig) -> torch.nn.Module:
    # Built on the meta device: no memory, no weights, just the module's settings.
    with torch.device("meta"):
        return tt_config.instantiate(cfg_model)


def _vocab_size(model: torch.nn.Module) -> Optional[int]:
    return getattr(getattr(model, "tok_embeddings", None), "num_embeddings", None)


def _divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), -d))


# --------------------------------------------------------------------------------------------
# Tokenizer and dataset: after the tokenizer is built, before any weights are read
# --------------------------------------------------------------------------------------------


def validate_with_tokenizer(cfg: DictConfig, tokenizer: Any) -> None:
    """Check the config against the instantiated tokenizer.

    Call it right after ``config.instantiate(cfg.tokenizer)``, before loading any model.

    Args:
        cfg (DictConfig): the config returned by ``validate_config``.
        tokenizer (Any): the tokenizer; its ``pad_id`` is read.

    Raises:
        ValueError: when the tokenizer has no pad id, or a stop token equals it.
    """
    pad_id = getattr(tokenizer, "pad_id", None)
    if not _is_int(pad_id):
        raise ValueError(
            f"tokenizer ({type(tokenizer).__name__}) has no integer pad_id (got {pad_id!r}); "
            "prompts are left-padded and responses filled after their stop token with it."
        )
    if pad_id in list(cfg.stop_token_ids):
        eos_id = getattr(tokenizer, "eos_id", None)
        hint = ""
        if eos_id is not None and eos_id != pad_id:
            hint = f" (the tokenizer's eos_id is {eos_id})"
        raise ValueError(
            f"stop_token_ids {list(cfg.stop_token_ids)} contains {pad_id}, the tokenizer's "
            "pad_id: responses are filled with pad_id after their first stop token, so a stop "
            f"token must differ from it. Use another stop token{hint}, or a tokenizer whose "
            "pad_id is not a stop token."
        )


def instantiate_dataset(cfg_dataset: DictConfig, tokenizer: Any) -> Any:
    """Build ``cfg.dataset`` with errors that point at the data, not into ``datasets``.

    A malformed data file fails inside the ``datasets`` library with a message that names
    neither the file nor, for JSON, the line; a wrong ``column`` only fails when the first
    sample is read, at step 1.

    Args:
        cfg_dataset (DictConfig): the ``dataset`` block of the config.
        tokenizer (Any): passed to the dataset builder.

    Returns:
        Any: the dataset, as ``torchtune.config.instantiate`` returns it.

    Raises:
        ValueError: naming the file and the position of a parse error (line and column for
            JSON, or what the underlying error says), or naming a missing column and the
            columns that exist.
    """
    try:
        dataset = tt_config.instantiate(cfg_dataset, tokenizer=tokenizer)
    except Exception as e:
        if not _is_data_error(e):
            raise
        files = _data_files(cfg_dataset)
        for path in files:
            where = _json_error(path)
            if where is not None:
                raise ValueError(
                    f"dataset.data_files: {str(path)!r} is not valid JSON: {where}. A JSON data "
                    "file holds a list of objects, or one object per line (JSON Lines)."
                ) from e
        root = _root_cause(e)
        named = [str(p) for p in files] or cfg_dataset.get("data_files")
        named = named or cfg_dataset.get("source")
        raise ValueError(
            f"dataset: loading {named!r} failed: {type(root).__name__}: {root}"
        ) from e
    _check_columns(cfg_dataset, dataset)
    return dataset


def validate_dataset(dataset: Any, cfg: DictConfig) -> int:
    """Read every prompt once and check its length against ``max_prompt_len``.

    Args:
        dataset (Any): the tokenized dataset; each sample is a dict with ``"tokens"``.
        cfg (DictConfig): the config returned by ``validate_config``.

    Returns:
        int: how many prompts are longer than ``max_prompt_len`` and will be truncated
        (``long_prompts: truncate``; under ``error`` it is always 0).

    Raises:
        ValueError: when the dataset holds fewer prompts than ``batch_size``, a prompt has no
            tokens, a sample cannot be read (e.g. a missing column), or, under
            ``long_prompts: error``, any prompt is too long.
    """
    limit = cfg.max_prompt_len if cfg.max_prompt_len is not None else math.inf
    size = len(dataset)
    if size < cfg.batch_size:
        raise ValueError(
            f"dataset has {size} prompts, fewer than batch_size ({cfg.batch_size}); lower "
            "batch_size or add prompts."
        )
    too_long: List[Tuple[int, int]] = []
    for i in range(size):
        try:
            sample = dataset[i]
        except KeyError as e:
            raise ValueError(
                f"dataset: sample {i} has no column {e.args[0]!r}{_columns_hint(dataset)}; "
                "check dataset.column (or dataset.column_map)."
            ) from e
        n = len(sample["tokens"])
        if n == 0:
            raise ValueError(
                f"dataset: prompt {i} has 0 tokens; every prompt needs at least one token to "
                "generate from. Remove it from the data (or use a dataset filter_fn)."
            )
        if n > limit:
            too_long.append((i, n))
    if too_long and cfg.long_prompts == "error":
        listed = ", ".join(f"#{i} ({n} tokens)" for i, n in too_long[:_LISTED_PROMPTS])
        more = ", ..." if len(too_long) > _LISTED_PROMPTS else ""
        longest = max(n for _, n in too_long)
        raise ValueError(
            f"long_prompts='error': {len(too_long)} of {size} prompts are longer than "
            f"max_prompt_len={limit} tokens: {listed}{more}; the longest has {longest}. Raise "
            f"max_prompt_len to {longest} (max_prompt_len + max_generated_tokens must stay "
            "within the models' max_seq_len), or set long_prompts=truncate to keep each "
            f"prompt's last {limit} tokens."
        )
    return len(too_long)


def _is_data_error(error: BaseException) -> bool:
    """Whether the ``datasets`` library failed to read the data (not a config typo)."""
    try:
        from datasets.exceptions import DatasetsError
    except ImportError:  # pragma: no cover - torchtune depends on datasets
        return False
    seen = error
    while seen is not None:
        if isinstance(seen, DatasetsError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error


def _data_files(cfg_dataset: DictConfig) -> List[Path]:
    """Local files named in ``data_files`` (a path, a list, or a split -> path(s) mapping)."""
    files = cfg_dataset.get("data_files")
    if isinstance(files, DictConfig):
        files = [f for v in files.values() for f in (v if isinstance(v, ListConfig) else [v])]
    elif isinstance(files, str):
        files = [files]
    elif not isinstance(files, ListConfig):
        return []
    return [Path(f) for f in files if isinstance(f, str) and Path(f).is_file()]


def _json_error(path: Path) -> Optional[str]:
    """Where a JSON or JSON Lines file stops parsing, or None if it parses (or is not JSON)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.lstrip().startswith(("[", "{")):
        return None  # not JSON (e.g. CSV or parquet): leave it to the underlying message
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        whole_error = whole
    lines = text.splitlines()
    filled = [i for i, line in enumerate(lines) if line.strip()]
    # JSON Lines when the first line is a whole value on its own and more lines follow.
    if len(filled) > 1 and _parses(lines[filled[0]]):
        for i in filled:
            try:
                json.loads(lines[i])
            except json.JSONDecodeError as e:
                return f"line {i + 1}, column {e.colno}: {e.msg} (read as JSON Lines)"
        return None
    e = whole_error
    return f"line {e.lineno}, column {e.colno} (character {e.pos}): {e.msg}"


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def _column_names(dataset: Any) -> Optional[List[str]]:
    # torchtune's dataset classes keep the Hugging Face dataset in `_data`.
    names = getattr(getattr(dataset, "_data", None), "column_names", None)
    return list(names) if isinstance(names, (list, tuple)) else None


def _columns_hint(dataset: Any) -> str:
    names = _column_names(dataset)
    return f" (its columns are {names})" if names is not None else ""


def _check_columns(cfg_dataset: DictConfig, dataset: Any) -> None:
    names = _column_names(dataset)
    if names is None:
        return
    wanted: Dict[str, Any] = {}
    if "column" in cfg_dataset:
        wanted["dataset.column"] = cfg_dataset.column
    elif "_component_" in cfg_dataset:
        # Left out, `column` takes the builder's default ("text" for text_completion_dataset).
        builder = _import_component(cfg_dataset._component_, "dataset._component_")
        try:
            param = inspect.signature(builder).parameters.get("column")
        except (TypeError, ValueError):  # a builtin without a signature: nothing to read
            param = None
        if param is not None and isinstance(param.default, str):
            wanted["dataset.column (default)"] = param.default
    column_map = cfg_dataset.get("column_map")
    if isinstance(column_map, DictConfig):
        wanted.update({f"dataset.column_map.{k}": v for k, v in column_map.items()})
    for key, column in wanted.items():
        if column not in names:
            raise ValueError(
                f"{key}: {column!r} is not a column of the data; its columns are {names}. "
                "Set it to one of them."
            )
