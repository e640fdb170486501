"""Validation of the recipe config, done in one place before any model is loaded.

A PPO run spends minutes loading four models and compiling before its first step, and a bad
value can surface hundreds of steps later (or never, as a silently different run). Everything
that can be checked without weights is checked here, in this order by the recipe:

1. ``check_cli_overrides(sys.argv[1:])`` and ``validate_config(cfg)``: keys, then each value
   against its kind in ``schema.SCHEMA``, each component block's keys against its callable's
   arguments (``components.py``), then the rules between keys, the device, checkpoint files,
   and the models' settings read from a build on the meta device.
2. ``validate_with_tokenizer(cfg, tokenizer)``: right after the tokenizer is instantiated.
3. ``instantiate_dataset(cfg.dataset, tokenizer)`` then ``validate_dataset(dataset, cfg)``
   (``data_files``): before any weights are read.

Every error names the key (dotted, e.g. ``loss.epsilon``), quotes the value and says what
would be valid.
"""

import dataclasses
import inspect
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config

from torchtune_ppo.config.components import check_component_arguments, import_component
from torchtune_ppo.config.precision import native_bf16  # noqa: F401  (defined here before precision.py)
from torchtune_ppo.config.precision import resolve_auto_dtype
from torchtune_ppo.rlhf.packing import common_prefix_len
from torchtune_ppo.config.schema import (
    COMPILE_REGIONS,
    EVAL_KEYS,
    EVAL_METRICS,
    KEYS,
    LOSS_KEYS,
    NOTED_KEYS,
    SCHEMA,
    ROLLOUT_CORRECTION_KEYS,
    VALUE_PRETRAIN_KEYS,
    _is_int,
    _show,
    defaults,
    parse_compile,
    parse_device,
)

CHECKPOINTERS = (
    "checkpointer",
    "ref_policy_checkpointer",
    "value_checkpointer",
    "reward_checkpointer",
)
VALID_KEYS = tuple(KEYS) + tuple(k.torchtune_key for k in SCHEMA if k.torchtune_key)


# --------------------------------------------------------------------------------------------
# Checks shared with the modules that take these values as plain arguments (e.g. Generator).
# --------------------------------------------------------------------------------------------


def check_sampling(temperature: Any, top_k: Any, top_p: Any, prefix: str = "") -> None:
    """Check the sampling settings of generation against their keys in the schema.

    Args:
        temperature (Any): must be a finite number > 0.
        top_k (Any): ``None`` or an integer >= 1.
        top_p (Any): ``None`` or a number in (0, 1].
        prefix (str): text put before each key name in the message, e.g. ``"Generator: "``
            or a dotted parent such as ``"sampling."``.

    Raises:
        ValueError: naming the first invalid setting, its value and the valid range.
    """
    for key, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        KEYS[key].kind.check(f"{prefix}{key}", value)


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
    KEYS["device"].kind.check(key, device)
    if device is None:
        return
    parsed = parse_device(device)
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
    from torchtune_ppo._patches.torchtune_modules import is_npu_available

    return bool(is_npu_available), None, "torchtune.utils.is_npu_available"


def check_cli_overrides(args: Sequence[str]) -> None:
    """Refuse command-line overrides that OmegaConf would merge into something else.

    ``compile=True compile.generate=False`` becomes ``{compile: {generate: False}}``: the
    bool is dropped. Merged over a YAML that has a full compile block, the regions not named
    keep the YAML's values, so "everything but generation" silently runs what the YAML says.
    The same holds for any key given both a bare true/false/null and dotted sub-keys. A
    ``+key=value`` (Hydra's syntax for adding a key) is refused too: OmegaConf would read a key
    named ``+key``.

    Args:
        args (Sequence[str]): the command line after the program name (``sys.argv[1:]``);
            items that are not ``key=value`` are ignored.

    Raises:
        ValueError: naming both overrides and what to write instead; or the ``+key`` and the
            ``key=value`` to write.
    """
    for arg in args:
        if arg.startswith("+") and "=" in arg:  # Hydra's syntax for adding a key
            raise ValueError(plus_override(arg.split("=", 1)[0]))
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


def plus_override(key: str) -> str:
    """What to say of a ``+key`` override, whose ``+`` OmegaConf keeps in the key's name."""
    plain = key.lstrip("+")
    head = plain.split(".")[0]
    valid = (f"write {plain}=<value>: every key of the config is set that way, whether the YAML has it or not"
             if head in VALID_KEYS else f"and {head!r} is not a config key either (valid keys: {sorted(VALID_KEYS)})")
    return f"{key}: torchtune's command line takes key=value, with no '+' (Hydra's syntax for adding a key); {valid}."


# --------------------------------------------------------------------------------------------
# validate_config
# --------------------------------------------------------------------------------------------


def with_defaults(cfg: DictConfig) -> DictConfig:
    """Fill optional keys with their schema defaults (a copy; the user's config is left as given).

    Args:
        cfg (DictConfig): the recipe config.

    Returns:
        DictConfig: a merged copy.
    """
    values = defaults()
    loss = cfg.get("loss")
    if isinstance(loss, (DictConfig, dict)) and "_component_" in loss:
        # torchtune's PPOLoss defaults epsilon to 0.1; merging our plain defaults into its
        # block would change what a torchtune config that leaves a key out means.
        del values["loss"]
    return OmegaConf.merge(OmegaConf.create(values), cfg)


def validate_config(cfg: DictConfig, *, check_machine: bool = True) -> DictConfig:
    """Check a recipe config and return it with defaults filled in.

    Every check runs before any weights are read: the models are built on the meta device to
    read their ``max_seq_len`` and vocabulary size.

    Args:
        cfg (DictConfig): the recipe config as parsed from YAML and the command line.
        check_machine (bool): also check that the checkpoint files exist and the device is
            available here, and decide ``dtype: auto`` from this machine (and, resuming, from the
            saved config); off to plan a run for another machine (``torchtune_ppo.run.memory``),
            where ``auto`` is bf16 on cuda and fp32 elsewhere (``config.precision``).

    Returns:
        DictConfig: a copy with every optional key of ``schema.SCHEMA`` set, and ``dtype``
        fp32 or bf16 (never ``auto``).

    Raises:
        ValueError: on a missing, unknown, mistyped, out-of-range or inconsistent key.
        FileNotFoundError: when a checkpoint file named in a checkpointer does not exist.
    """
    # A key with a torchtune stand-in (num_ppo_steps: num_steps) is checked by the mapping.
    missing = [k.name for k in SCHEMA if k.required and not k.torchtune_key and k.name not in cfg]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}.")
    cfg = _map_torchtune_keys(cfg)
    unknown = sorted(set(cfg.keys()) - set(VALID_KEYS))
    plus = [k for k in unknown if isinstance(k, str) and k.startswith("+")]
    if plus:  # `+eval.every_n_steps=2` arrives as {"+eval": {"every_n_steps": 2}}
        key, node = plus[0], cfg[plus[0]]
        while isinstance(node, DictConfig) and len(node) == 1:
            sub = next(iter(node))
            key, node = f"{key}.{sub}", node[sub]
        raise ValueError(plus_override(key))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys are {sorted(VALID_KEYS)}.")
    cfg = with_defaults(cfg)
    cfg.loss = _loss_with_defaults(cfg.loss)
    _check_block_keys(cfg, "value_pretrain", VALUE_PRETRAIN_KEYS)
    _check_block_keys(cfg, "rollout_correction", ROLLOUT_CORRECTION_KEYS)
    _check_block_keys(cfg, "eval", EVAL_KEYS)

    for key in SCHEMA:
        key.kind.check(key.name, cfg[key.name])
    _resolve_dtype(cfg, check_machine)  # before any check that reads cfg.dtype
    # a typo inside a block (optimizer.lrr), before anything is built; a package missing here, for a run here
    check_component_arguments(cfg, installed_only=check_machine)
    # Read once here: a bare compile: true|false becomes the mapping of every region, so the
    # rest of the run reads cfg.compile.<region>.
    cfg.compile = dataclasses.asdict(parse_compile(cfg.compile))
    _check_optimizer_in_bwd(cfg)
    _check_batch_sizes(cfg)
    _check_min_response_length(cfg)
    _check_no_eos_penalty(cfg)
    _check_optimizer_lr(cfg)
    _check_reward(cfg)
    _check_advantage_estimator(cfg)  # first: a critic-free run refuses the critic's keys by name
    _check_algorithms(cfg)
    _check_eval(cfg)
    if check_machine:
        check_device(cfg.device)
        _check_checkpoint_files(cfg)
    _check_models(cfg)
    return cfg


def _resolve_dtype(cfg: DictConfig, check_machine: bool) -> None:
    """``dtype: auto`` becomes fp32 or bf16 here, once, with a note that says why
    (:func:`~torchtune_ppo.config.precision.resolve_auto_dtype`); the rest of the run, and the
    config saved in each checkpoint, see only the concrete dtype."""
    if cfg.dtype != "auto":
        return
    cfg.dtype, note = resolve_auto_dtype(
        cfg.device, output_dir=cfg.output_dir, resume=cfg.resume_from_checkpoint, check_machine=check_machine)
    _note(note)


def _check_block_keys(cfg: DictConfig, key: str, valid: Sequence[str]) -> None:
    block = cfg[key]
    if isinstance(block, DictConfig):
        unknown = sorted(set(block.keys()) - set(valid))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; valid keys are {list(valid)}.")


def _check_optimizer_in_bwd(cfg: DictConfig) -> None:
    if not cfg.optimizer_in_bwd:
        return
    if cfg.dtype == "bf16" and cfg.master_weights:  # torchtune's bf16 configs: they run as there
        _note("optimizer_in_bwd=True steps each bf16 weight inside backward, where no fp32 master copy is "
              "kept: this run trains the bf16 weights directly (master_weights=False).")
        cfg.master_weights = False
    if cfg.gradient_accumulation_steps != 1:
        raise ValueError(
            f"optimizer_in_bwd=True steps each parameter during backward, so gradients cannot "
            f"accumulate: set gradient_accumulation_steps=1 (got "
            f"{cfg.gradient_accumulation_steps}) or optimizer_in_bwd=False."
        )
    if cfg.lr_scheduler is not None:
        raise ValueError(
            "optimizer_in_bwd=True with an lr_scheduler is not supported (each parameter has its "
            "own optimizer); set lr_scheduler=null or optimizer_in_bwd=False."
        )
    if cfg.clip_grad_norm is not None:
        raise ValueError(
            f"optimizer_in_bwd=True steps each parameter before the global gradient norm is "
            f"known, so clip_grad_norm={cfg.clip_grad_norm} cannot apply: set clip_grad_norm=null "
            "or optimizer_in_bwd=False."
        )


def _check_algorithms(cfg: DictConfig) -> None:
    """Rules between the keys of the PPO-family options (decoupled GAE, critic warm-up, KL)."""
    if cfg.lmbda_actor is not None and cfg.lmbda_length_alpha is not None:
        raise ValueError(
            f"lmbda_actor ({cfg.lmbda_actor}) and lmbda_length_alpha ({cfg.lmbda_length_alpha}) both set "
            "the actor's GAE lambda: set one of them to null."
        )
    if cfg.critic_warmup_steps and cfg.critic_warmup_steps >= cfg.num_ppo_steps:
        # Not an error: a run may be trained in parts, resumed with a larger num_ppo_steps.
        _note(f"critic_warmup_steps={cfg.critic_warmup_steps} covers every step up to num_ppo_steps="
              f"{cfg.num_ppo_steps}: this run trains the value model only.")
    if cfg.critic_warmup_steps and cfg.optimizer_in_bwd:
        raise ValueError(
            f"critic_warmup_steps={cfg.critic_warmup_steps} with optimizer_in_bwd=True is not supported "
            "(the policy's parameters step inside backward): set critic_warmup_steps=0 or optimizer_in_bwd=False."
        )
    _check_value_pretrain(cfg)
    if cfg.rollout_correction.mode is not None and cfg.compile.rollout:
        raise ValueError(
            f"rollout_correction.mode={cfg.rollout_correction.mode} with compile.rollout=True: the fused region "
            "takes the generator's logprobs as the old ones. Set compile.rollout=False (compile.generate and "
            "compile.trajectory compile the same work) or rollout_correction.mode=null.")
    if cfg.get("env") is not None and cfg.compile.rollout:
        raise ValueError("env (multi-turn episodes) with compile.rollout=True: the fused region unrolls one "
                         "response per prompt. Set compile.rollout=False (compile.generate and compile.trajectory "
                         "compile the episodes' regions).")
    cache, T = cfg.turns.cache_tokens, cfg.max_generated_tokens
    if cache is not None and cache < T:  # the Generator's rule, here before any model loads
        raise ValueError(
            f"turns.cache_tokens must be null (2 * max_generated_tokens = {2 * T}) or an integer >= "
            f"max_generated_tokens ({T}), got {cache}: the KV cache holds every token of an episode after "
            "the prompt, and more columns leave room for the gaps of rows waiting for the others' turns.")
    loss_kl = cfg.loss.get("kl_coeff", 0) if isinstance(cfg.loss, Mapping) else 0
    if loss_kl and cfg.kl_coeff:
        _note(f"the KL to the reference policy is both in the reward (kl_coeff={cfg.kl_coeff}) and in the "
              f"loss (loss.kl_coeff={loss_kl}); GRPO-style runs set kl_coeff=0.")


def _check_value_pretrain(cfg: DictConfig) -> None:
    block = cfg.value_pretrain
    if not block.max_steps:
        if block.tolerance is not None:
            _note(f"value_pretrain.tolerance={block.tolerance} has no effect: value_pretrain.max_steps=0 turns "
                  "value pretraining off.")
        return
    if cfg.optimizer_in_bwd:
        raise ValueError(
            f"value_pretrain.max_steps={block.max_steps} with optimizer_in_bwd=True is not supported (the "
            "policy's parameters step inside backward, so they cannot be left out): set value_pretrain.max_steps=0 "
            "or optimizer_in_bwd=False.")
    if block.tolerance is not None and block.max_steps < 2 * block.window:
        _note(f"value_pretrain.tolerance={block.tolerance} needs 2 * value_pretrain.window = {2 * block.window} "
              f"steps of losses, more than value_pretrain.max_steps={block.max_steps}: pretraining runs "
              f"{block.max_steps} steps.")


def _check_eval(cfg: DictConfig) -> None:
    """The ``eval`` block: a ``best_metric`` the evaluation logs, a reward function that imports."""
    block = cfg.eval
    k = block.num_samples
    if block.dataset is not None and block.datasets is not None:
        raise ValueError("eval.dataset and eval.datasets are both set; give one: eval.dataset is one held-out "
                         "set (metrics `val/...`), eval.datasets several by name (metrics `val/<name>/...`).")
    prefixes = ["val/"] if block.datasets is None else [f"val/{name}/" for name in block.datasets]
    names = [p + m[len("val/"):] for p in prefixes for m in (*EVAL_METRICS, *((f"val/pass@{k}",) if k > 1 else ()))]
    if block.best_metric not in names and not any(block.best_metric.startswith(f"{p}reward/") for p in prefixes):
        raise ValueError(
            f"eval.best_metric must be one of {names} or `{prefixes[0] if len(prefixes) == 1 else 'val/<name>/'}"
            f"reward/<part>` (a part of a WeightedSum reward), got {block.best_metric!r}; `val/pass@<k>` is "
            "logged with eval.num_samples=k > 1.")
    if block.reward is not None:
        import_component(block.reward._component_, "eval.reward._component_")
    if block.every_n_steps is None:
        if block.early_stop_patience is not None:
            _note(f"eval.early_stop_patience={block.early_stop_patience} has no effect: eval.every_n_steps=null "
                  "turns evaluation off.")
        return
    if k > 1 and block.top_k == 1:
        _note(f"eval.num_samples={k} with eval.top_k=1: greedy decoding gives the {k} responses to a prompt "
              f"alike, so val/pass@{k} equals val/pass@1; raise eval.top_k (or null) to sample.")


def _check_batch_sizes(cfg: DictConfig) -> None:
    n = cfg.num_samples_per_prompt
    rows = cfg.batch_size * n  # responses per step
    for key in ("forward_batch_size", "ppo_batch_size"):
        if rows % cfg[key] and n == 1:
            raise ValueError(
                f"batch_size ({cfg.batch_size}) must be divisible by {key} ({cfg[key]}); "
                f"e.g. {key}={_divisor(cfg.batch_size, cfg[key])}."
            )
        if rows % cfg[key]:
            raise ValueError(
                f"{key} ({cfg[key]}) counts responses and must divide batch_size * "
                f"num_samples_per_prompt ({cfg.batch_size} prompts * {n} = {rows} responses a step); "
                f"e.g. {key}={_divisor(rows, cfg[key])}."
            )
    if cfg.ppo_batch_size % cfg.gradient_accumulation_steps:
        raise ValueError(
            f"ppo_batch_size ({cfg.ppo_batch_size}) must be divisible by "
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps})."
        )
    check_world_size(cfg, 1)
    if cfg.share_group_prefill and n > 1 and cfg.compile.rollout:
        raise ValueError(
            "share_group_prefill=True with compile.rollout=True: the fused rollout region "
            "prefills every row; set share_group_prefill=False or compile.rollout=False."
        )


def check_whole_groups(rows: int, group_size: int, what: str, fix: str = "") -> None:
    """The rule of one prefill per group: every generation call holds whole groups of
    ``group_size`` rows (the responses to one prompt).

    Args:
        rows (int): rows of a generation call.
        group_size (int): ``num_samples_per_prompt``; 1: no groups, any count is whole.
        what (str): the rows as the message names them, e.g. ``"forward_batch_size=4"``.
        fix (str): what to change, said after the rule.

    Raises:
        ValueError: ``rows`` is not a multiple of ``group_size``.
    """
    if group_size > 1 and rows % group_size:
        raise ValueError(f"{what} is not a multiple of num_samples_per_prompt={group_size} (the group size): one "
                         f"prefill per group (share_group_prefill) needs whole groups in every generation call{fix}.")


def share_group_prompt(cfg: DictConfig, world_size: int = 1) -> bool:
    """Whether a run shares each group's prompt (``share_group_prefill``, already checked): in
    generation, scoring and the loss step. null: wherever the sizes allow, and a note once
    saying why not where they do not (no groups, ``compile.rollout``, ``forward_batch_size``
    per process not a multiple of the group size)."""
    setting, n = cfg.share_group_prefill, cfg.num_samples_per_prompt
    if setting is False:
        return False
    rows = cfg.forward_batch_size // world_size
    why = ("num_samples_per_prompt=1 (no group shares a prompt)" if n == 1 else
           "compile.rollout=True (the fused region prefills and scores every row)" if cfg.compile.rollout else
           f"forward_batch_size={cfg.forward_batch_size} gives {rows} rows per process, not whole groups of "
           f"num_samples_per_prompt={n}" if rows % n else None)
    if why is not None:
        _note(f"share_group_prefill is off: {why}; each response is scored and trained with its own prompt copy.")
    return why is None


# ``share_prompt_prefix: null`` shares a prefix of at least this many tokens (and a quarter of P).
MIN_SHARED_PREFIX = 8
# prompts of the dataset whose common prefix decides ``share_prompt_prefix: null``
PREFIX_SAMPLE = 256


def dataset_prefix(dataset) -> Tuple[int, int]:
    """The tokens the first :data:`PREFIX_SAMPLE` prompts of a map-style ``{"tokens": [...]}``
    dataset all begin with (each batch's own common prefix is what is packed once), and the
    longest of them."""
    prompts = [dataset[i]["tokens"] for i in range(min(len(dataset), PREFIX_SAMPLE))]
    return common_prefix_len(prompts), max(map(len, prompts), default=0)


def prompt_sharing(cfg: DictConfig, world_size: int = 1, dataset=None) -> Tuple[int, bool]:
    """What a run computes once: ``(group, prefix)``, the group size whose prompt is packed once
    (``share_group_prefill``: :func:`share_group_prompt`; 1 when off) and whether the prefix every
    prompt of a batch begins with is packed once per row in scoring and the loss step
    (``share_prompt_prefix``). null: on without shared groups when the first prompts of
    ``dataset`` share at least ``max(MIN_SHARED_PREFIX, P // 4)`` tokens (``P``: ``max_prompt_len``,
    or the longest of those prompts where it is null), with a note
    either way once that rule applies; true: on (an error where it cannot be); false: off.

    Raises:
        ValueError: ``share_prompt_prefix=True`` with groups sharing their prompt, with
            ``compile.rollout`` or with ``env``.
    """
    group = cfg.num_samples_per_prompt if share_group_prompt(cfg, world_size) else 1
    setting = cfg.get("share_prompt_prefix")
    if setting is False:
        return group, False
    why = ("each group's prompt is already one copy a row (share_group_prefill)" if group > 1 else
           "compile.rollout=True (the fused region scores padded rows)" if cfg.compile.rollout else
           "env is set (multi-turn episodes are packed one a row)" if cfg.get("env") is not None else None)
    if why is not None:
        if setting:
            raise ValueError(f"share_prompt_prefix=True, but {why}: set share_prompt_prefix=False or null.")
        return group, False
    if setting:
        return group, True
    have, longest = dataset_prefix(dataset) if dataset is not None else (0, 0)
    need = max(MIN_SHARED_PREFIX, (cfg.max_prompt_len or longest) // 4)  # null: the longest prompt's
    on = have >= need
    _note(f"share_prompt_prefix is {'on' if on else 'off'}: the first {PREFIX_SAMPLE} prompts share {have} leading "
          f"tokens ({'at least' if on else 'fewer than'} {need}); "
          + ("each batch's common prefix is computed once per packed row in scoring and the loss step."
             if on else "set share_prompt_prefix=True to share them anyway."))
    return group, on


def check_world_size(cfg: DictConfig, world_size: int) -> None:
    """The global batch keys must split evenly over ``world_size`` processes, and each rank's
    generation calls hold whole groups when ``share_group_prefill`` is on.

    Raises:
        ValueError: naming the key, its value and the number of processes.
    """
    n = cfg.num_samples_per_prompt
    if world_size > 1:
        for key in ("batch_size", "forward_batch_size", "ppo_batch_size"):
            if cfg[key] % world_size:
                raise ValueError(f"{key}={cfg[key]} is the global number of prompts per step, "
                                 f"split over {world_size} processes: it must be a multiple of {world_size}.")
        if (cfg.ppo_batch_size // world_size) % cfg.gradient_accumulation_steps:
            raise ValueError(f"ppo_batch_size={cfg.ppo_batch_size} over {world_size} processes gives "
                             f"{cfg.ppo_batch_size // world_size} rows per rank, not a multiple of "
                             f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}.")
        if cfg.optimizer_in_bwd:
            raise ValueError("optimizer_in_bwd=True runs on one process only; set it to False "
                             f"to run on {world_size} processes.")
        if cfg.compile.get("layers", False):
            _note(f"compile.layers on {world_size} processes: FSDP2 calls the sharded layers itself, so the "
                  "regions compile every layer in their own graphs, as with compile.layers=False.")
            cfg.compile.layers = False
        if cfg.dtype == "bf16" and cfg.master_weights:
            _note(f"dtype=bf16 on {world_size} processes: the fp32 master weights are not sharded yet, so this "
                  "run trains the bf16 weights directly (master_weights=False).")
            cfg.master_weights = False
    if cfg.share_group_prefill:
        rows = cfg.forward_batch_size // world_size
        what = (f"forward_batch_size={cfg.forward_batch_size}" if world_size == 1 else
                f"forward_batch_size={cfg.forward_batch_size} over {world_size} processes gives {rows} rows per rank")
        fix = f"; e.g. forward_batch_size={n * _divisor(cfg.batch_size, max(1, rows // n)) * world_size}, or share_group_prefill=False"
        check_whole_groups(rows, n, what, fix)


def _check_min_response_length(cfg: DictConfig) -> None:
    if cfg.min_response_length is not None and cfg.min_response_length > cfg.max_generated_tokens:
        raise ValueError(
            f"min_response_length ({cfg.min_response_length}) must not exceed "
            f"max_generated_tokens ({cfg.max_generated_tokens}): no response could reach it, "
            "so every one would get reward_penalty. Lower min_response_length, raise "
            "max_generated_tokens, or set min_response_length=null."
        )


def _check_no_eos_penalty(cfg: DictConfig) -> None:
    # With one generated token, a row escapes the penalty only by stopping at once (an empty
    # response): in effect every response would score reward_penalty.
    if cfg.penalise_no_eos and cfg.max_generated_tokens < 2:
        raise ValueError(
            f"max_generated_tokens={cfg.max_generated_tokens} with penalise_no_eos=True: a "
            "response with text cannot reach a stop token, so every one would score "
            f"reward_penalty ({cfg.reward_penalty}). Raise max_generated_tokens, or set "
            "penalise_no_eos=False."
        )


def _check_optimizer_lr(cfg: DictConfig) -> None:
    lr = cfg.optimizer.get("lr") if isinstance(cfg.optimizer, Mapping) else None
    if lr is None:
        return
    try:
        value = float(lr)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0) or isinstance(lr, bool):
        raise ValueError(
            f"optimizer.lr must be a finite number > 0, got {lr!r}; e.g. optimizer.lr=1e-5."
        )


def _check_reward(cfg: DictConfig) -> None:
    """Exactly one reward source: ``reward_checkpointer`` (a model) or ``reward`` (a function)."""
    if cfg.reward is None and cfg.reward_checkpointer is None:
        raise ValueError(
            "config has no reward: give reward_checkpointer (a reward model, built with "
            "reward_and_value_model) or reward: {_component_: ...} (a function of the texts, "
            "e.g. torchtune_ppo.rewards.ExactMatch)."
        )
    if cfg.reward is not None and cfg.reward_checkpointer is not None:
        raise ValueError(
            "config gives both reward (a function) and reward_checkpointer (a reward model); "
            "keep one. With a function reward, reward_and_value_model builds the value model only."
        )
    if cfg.reward is not None:
        import_component(cfg.reward._component_, "reward._component_")
        if cfg.compile.rollout:
            raise ValueError(
                "compile.rollout traces the reward model into one region with generation; a "
                "function reward runs eagerly: set compile.rollout=False (compile.generate and "
                "compile.trajectory still compile everything else)."
            )


def _check_advantage_estimator(cfg: DictConfig) -> None:
    """The value model is built for ``gae`` only; group baselines need groups."""
    from torchtune_ppo.rlhf import GROUP_ESTIMATORS, uses_value_model

    estimator, n = cfg.advantage_estimator, cfg.num_samples_per_prompt
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(
            f"advantage_estimator={estimator} compares the responses to the same prompt, so "
            f"num_samples_per_prompt must be at least 2, got {n}; e.g. num_samples_per_prompt=4 "
            "(batch_size still counts prompts)."
        )
    needs = [why for why, needed in (("a value model (advantage_estimator=gae)", uses_value_model(estimator)),
                                     ("a reward model (reward_checkpointer)", cfg.reward_checkpointer is not None))
             if needed]
    if cfg.reward_and_value_model is None and needs:
        raise ValueError(
            f"reward_and_value_model is null, but the run needs {' and '.join(needs)} built by it: give "
            "its builder, e.g. reward_and_value_model={_component_: torchtune.models.llama2.llama2_reward_7b}."
        )
    if uses_value_model(estimator):
        if cfg.value_checkpointer is None:
            raise ValueError(
                "advantage_estimator=gae trains a value model: give value_checkpointer (its start "
                "weights, normally the reward model's), or pick a critic-free advantage_estimator "
                "(grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)."
            )
        return
    counts = ("critic_warmup_steps", "value_pretrain.max_steps")
    for key, value in (("critic_warmup_steps", cfg.critic_warmup_steps if cfg.critic_warmup_steps else None),
                       ("value_pretrain.max_steps", cfg.value_pretrain.max_steps or None),
                       ("lmbda_actor", cfg.lmbda_actor), ("lmbda_length_alpha", cfg.lmbda_length_alpha)):
        if value is not None:
            raise ValueError(
                f"{key}={value} is for the value model and GAE; advantage_estimator={estimator} has "
                f"neither (no critic). Set {key}={0 if key in counts else 'null'}, or use "
                "advantage_estimator=gae."
            )
    if cfg.whiten_rewards:
        raise ValueError(
            f"whiten_rewards=True whitens the rewards before GAE; advantage_estimator={estimator} "
            "uses no GAE. Set whiten_rewards=False (reinforce_plus_plus whitens its returns anyway)."
        )
    if cfg.value_checkpointer is not None:
        _note(f"advantage_estimator={estimator} trains no value model: value_checkpointer is "
              "ignored (nothing is loaded from it or saved for it).")
        cfg.value_checkpointer = None


def _check_checkpoint_files(cfg: DictConfig) -> None:
    for key in [k for k in CHECKPOINTERS if cfg[k] is not None]:
        for path in _checkpoint_files(cfg[key], key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{key}: checkpoint file {str(path)!r} does not exist; check "
                    f"{key}.checkpoint_dir and {key}.checkpoint_files."
                )


def _check_models(cfg: DictConfig) -> None:
    """Sequence length and vocabularies, read from the models built on the meta device."""
    models = {key: _meta_model(cfg[key]) for key in ("policy_model", "reward_and_value_model")
              if cfg[key] is not None}
    _check_lora(cfg, models)
    if cfg.max_prompt_len is not None:
        check_sequence_length(cfg, cfg.max_prompt_len, models)
    vocab = _vocab_size(models["policy_model"])
    if vocab is None:
        return
    bad = [t for t in cfg.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(
            f"stop_token_ids {bad} are outside policy_model's vocabulary [0, {vocab}) "
            f"(policy_model.tok_embeddings.num_embeddings = {vocab}); use ids of the "
            "policy's tokenizer, e.g. its eos_id."
        )
    value_vocab = _vocab_size(models["reward_and_value_model"]) if "reward_and_value_model" in models else None
    if value_vocab is not None and value_vocab < vocab:
        raise ValueError(
            f"reward_and_value_model's vocabulary ({value_vocab} tokens) is smaller than "
            f"policy_model's ({vocab}): the value and reward models read every token the "
            "policy writes, so they must share its tokenizer."
        )


def _check_lora(cfg: DictConfig, models: Dict[str, torch.nn.Module]) -> None:
    """What LoRA models (adapters in the meta-built ``policy_model`` or
    ``reward_and_value_model``) ask of the other keys."""
    from torchtune_ppo import lora

    # reward_and_value_model is absent (null) in a critic-free run with a function reward
    adapted = [key for key in ("policy_model", "reward_and_value_model")
               if key in models and lora.has_adapters(models[key])]
    for key in adapted:
        try:
            lora.lora_settings(models[key])
        except ValueError as e:
            raise ValueError(f"{key} ({cfg[key]._component_}): {e}") from None
    if "policy_model" not in adapted and cfg.ref_policy_checkpointer is None:
        raise ValueError(
            "config is missing ref_policy_checkpointer, the frozen reference policy's weights "
            "(normally the same files as checkpointer's). Only a LoRA policy_model may leave it "
            "out: its reference is its own base with the adapters off.")
    if not adapted:
        return
    if cfg.optimizer_in_bwd:
        raise ValueError(
            f"optimizer_in_bwd=True with a LoRA {' and '.join(adapted)}: its point, never holding "
            "every gradient, does not apply to adapters (a few MB). Set optimizer_in_bwd=False.")
    if "reward_and_value_model" in adapted and shares_reward_value_base(cfg, value_is_lora=True):
        _note("value_checkpointer reads reward_checkpointer's files and reward_and_value_model is LoRA: "
              "one frozen base serves both, the value model with its adapters on, the reward model with "
              "them off and the checkpoint's head (share_reward_value_base=False builds two copies).")
    if "policy_model" not in adapted:
        return
    if cfg.rollout_correction.mode is not None:
        raise ValueError(
            f"rollout_correction.mode={cfg.rollout_correction.mode} with a LoRA policy_model: the old logprobs "
            "would be recomputed inside the scoring, where the policy's adapters are off (it is the "
            "reference there). Set rollout_correction.mode=null, or use a plain policy_model builder.")
    ref = cfg.ref_policy_checkpointer
    if ref is not None and _checkpoint_files(ref, "ref_policy_checkpointer") != _checkpoint_files(
            cfg.checkpointer, "checkpointer"):
        raise ValueError(
            f"ref_policy_checkpointer loads {str(ref.get('checkpoint_dir'))!r}, not the policy's "
            f"start {str(cfg.checkpointer.checkpoint_dir)!r}: with a LoRA policy the reference is "
            "the policy's own base (adapters off), so no other reference weights are read. Leave "
            "ref_policy_checkpointer out, or use a plain policy_model builder.")
    if cfg.compile.rollout:
        raise ValueError(
            "compile.rollout=True with a LoRA policy_model: the one region would need the adapters "
            "on (generation) and off (reference) in one graph. Set compile.rollout=False; "
            "compile.generate and compile.trajectory compile the same work without recompiles.")


def shares_reward_value_base(cfg: DictConfig, *, value_is_lora: bool) -> bool:
    """Whether the reward model is built on the value model's base (``share_reward_value_base``).

    True when the key is on, ``reward_and_value_model`` is a LoRA builder (``value_is_lora``), the
    run trains a value model and scores with a reward model, and ``value_checkpointer`` reads the
    same files as ``reward_checkpointer`` with the same settings (all but ``output_dir``): the two
    bases are then the same weights, and stay so, frozen.
    """
    if not (cfg.share_reward_value_base and value_is_lora and cfg.reward is None
            and cfg.value_checkpointer is not None and cfg.reward_checkpointer is not None):
        return False
    value, reward = cfg.value_checkpointer, cfg.reward_checkpointer
    files = [[p.resolve() for p in _checkpoint_files(c, key)]
             for c, key in ((value, "value_checkpointer"), (reward, "reward_checkpointer"))]
    where = ("output_dir", "checkpoint_dir", "checkpoint_files")
    settings = [{k: OmegaConf.to_container(c[k], resolve=True) if OmegaConf.is_config(c[k]) else c[k]
                 for k in c if k not in where} for c in (value, reward)]
    return files[0] == files[1] and settings[0] == settings[1]


def cpu_threads(setting: Any) -> int:
    """The thread count ``cpu_threads`` means on this machine (see its key in ``SCHEMA``).

    A number above the cores this process may run on is capped to them with a warning: more
    OpenMP threads than cores spin-wait for each other and run several times slower.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set but is not a positive integer (or OpenMP's list of
            them, ``4,2``), naming its value and what is valid.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    omp = _omp_num_threads()
    if setting != "auto":
        if int(setting) > cores:
            from torchtune import utils

            utils.get_logger("INFO").warning(
                f"cpu_threads={int(setting)} is more than the {cores} cores this process may run "
                f"on; using {cores} (more threads than cores wait for each other).")
            return cores
        return int(setting)
    if omp is not None:
        return omp
    return max(1, cores - 1)


def _omp_num_threads() -> Optional[int]:
    """``OMP_NUM_THREADS`` as OpenMP reads it (a positive integer, or a comma-separated list of
    them for nested levels, the first of which counts here); None when it is not set.

    Raises:
        ValueError: set to anything else (``0``, ``-1``, ``abc``, empty), which OpenMP ignores
            with a warning and ``torch.set_num_threads`` refuses without naming the variable.
    """
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None:
        return None
    counts = [p.strip().removeprefix("+") for p in value.split(",")]
    if not all(c.isdigit() and c.isascii() and int(c) > 0 for c in counts):
        raise ValueError(
            f"OMP_NUM_THREADS={value!r} is not a positive integer: set it to the number of CPU "
            "threads to use (e.g. OMP_NUM_THREADS=1), or unset it and the config's cpu_threads "
            "decides (`auto`: every core but one).")
    return int(counts[0])


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
        models = {key: _meta_model(cfg[key]) for key in ("policy_model", "reward_and_value_model")
                  if cfg[key] is not None}
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


def _loss_with_defaults(loss: Any) -> Any:
    """``loss`` with a ``_component_``'s own defaults written out and unknown keys refused.

    Written out so that the numbers the schema checks are the ones the run uses; the block is
    checked without instantiating it. Anything but a mapping is left to the schema's check.
    """
    if not isinstance(loss, DictConfig):
        return loss
    keys = set(loss.keys())
    if "_component_" not in loss:
        unknown = sorted(keys - set(LOSS_KEYS))
        if unknown:
            raise ValueError(
                f"loss: unknown key(s) {unknown}; valid keys are {list(LOSS_KEYS)}, or give a "
                "`_component_: torchtune.rlhf.loss.PPOLoss` block."
            )
        return loss
    path = loss._component_
    params = _signature_defaults(path, "loss._component_")
    if params is None:
        return loss
    unknown = sorted(keys - {"_component_"} - set(params))
    if unknown:
        raise ValueError(f"loss: unknown key(s) {unknown} for {path}; its arguments are {list(params)}.")
    for key in LOSS_KEYS:
        default = params.get(key, inspect.Parameter.empty)
        if key not in loss and default is not inspect.Parameter.empty:
            loss[key] = default
    return loss


def _signature_defaults(path: Any, key: str) -> Optional[Dict[str, Any]]:
    """Arguments of a ``_component_`` and their defaults; None if it takes ``**kwargs``."""
    component = import_component(path, key)
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


def _checkpoint_files(cfg_ckpt: DictConfig, key: str) -> List[Path]:
    if "checkpoint_dir" not in cfg_ckpt or "checkpoint_files" not in cfg_ckpt:
        raise ValueError(f"{key} needs checkpoint_dir and checkpoint_files.")
    ckpt_dir = Path(cfg_ckpt.checkpoint_dir)
    files = cfg_ckpt.checkpoint_files
    if isinstance(files, (DictConfig, dict)):  # torchtune's {filename_format, max_filename}
        from torchtune_ppo._patches.checkpointer import FormattedCheckpointFiles

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
# Tokenizer: after it is built, before any weights are read
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


def _unknown_token_id(tokenizer: Any) -> Optional[int]:
    """The id a tokenizer gives characters it does not know, or None when it has none (byte
    fallback) or does not say."""
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None:
        spm = getattr(getattr(tokenizer, "_spm_model", None), "spm_model", None)  # torchtune SentencePiece
        unk = spm.unk_id() if spm is not None else None
    return unk if _is_int(unk) and unk >= 0 else None


def warn_unknown_tokens(dataset: Any, tokenizer: Any) -> int:
    """Warns once, with a count and an example, when prompts hold the tokenizer's unknown-token
    id (characters it cannot encode); returns how many such tokens there are.

    Call after :func:`validate_dataset`. ``<unk>`` is often id 0, the pad id too (Llama-2
    tokenizers): the prompt silently loses those characters.
    """
    unk = _unknown_token_id(tokenizer)
    if unk is None:
        return 0
    count, rows, example = 0, 0, None
    for i in range(len(dataset)):
        n = sum(1 for t in dataset[i]["tokens"] if t == unk)
        count, rows = count + n, rows + (n > 0)
        if n and example is None:
            example = i
    if count:
        from torchtune import utils

        pad = ", also the pad id" if getattr(tokenizer, "pad_id", None) == unk else ""
        text = tokenizer.decode(list(dataset[example]["tokens"]))
        utils.get_logger("INFO").warning(
            f"dataset: {count} token(s) in {rows} of {len(dataset)} prompts are the tokenizer's "
            f"unknown token (id {unk}{pad}): characters it cannot encode. E.g. prompt #{example}: "
            f"{text!r}. Clean the data or use a tokenizer that covers these characters.")
    return count
