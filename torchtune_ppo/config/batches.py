"""The batch keys: how ``batch_size``, ``forward_batch_size``, ``ppo_batch_size`` and
``gradient_accumulation_steps`` divide each other and split over the processes, whole groups
of one prompt's responses in every generation call, and what a run computes once per group or
per shared prompt prefix (``share_group_prefill``, ``share_prompt_prefix``)."""

from typing import Tuple

from omegaconf import DictConfig

from torchtune_ppo.config.notes import note
from torchtune_ppo.rlhf.packing import common_prefix_len


def check_batch_sizes(cfg: DictConfig) -> None:
    """The batch keys divide each other on one process (``check_world_size`` splits them over
    several), and a group's shared prefill is not asked of the fused rollout region."""
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
            note(f"compile.layers on {world_size} processes: FSDP2 calls the sharded layers itself, so the "
                 "regions compile every layer in their own graphs, as with compile.layers=False.")
            cfg.compile.layers = False
        if cfg.dtype == "bf16" and cfg.master_weights:
            note(f"dtype=bf16 on {world_size} processes: the trained models' FSDP2 shards are their fp32 master "
                 "weights (each process holds its 1/W), gathered in bf16 for every forward and backward, "
                 "gradients reduced in fp32 (MixedPrecisionPolicy).")
            if cfg.get("master_rounding", "nearest") == "dither":
                note(f"master_rounding=dither on {world_size} processes: FSDP2 casts the fp32 shards to bf16 "
                     "itself, rounding to nearest; this run rounds to nearest.")
    if cfg.share_group_prefill:
        rows = cfg.forward_batch_size // world_size
        what = (f"forward_batch_size={cfg.forward_batch_size}" if world_size == 1 else
                f"forward_batch_size={cfg.forward_batch_size} over {world_size} processes gives {rows} rows per rank")
        fix = f"; e.g. forward_batch_size={n * _divisor(cfg.batch_size, max(1, rows // n)) * world_size}, or share_group_prefill=False"
        check_whole_groups(rows, n, what, fix)


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
        note(f"share_group_prefill is off: {why}; each response is scored and trained with its own prompt copy.")
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


def generation_prefix(on: bool, dataset, prompt_len: int) -> int:
    """The prefix a run's generator computes once per call (``Generator(prefix_len=...)``) when
    ``on`` (:func:`prompt_sharing`'s prefix): the tokens the first :data:`PREFIX_SAMPLE` prompts
    of ``dataset`` share (:func:`dataset_prefix`), below ``prompt_len``; else 0. A batch whose
    prompts do not all begin with them is prefilled whole."""
    return max(0, min(dataset_prefix(dataset)[0], prompt_len - 1)) if on else 0


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
    note(f"share_prompt_prefix is {'on' if on else 'off'}: the first {PREFIX_SAMPLE} prompts share {have} leading "
         f"tokens ({'at least' if on else 'fewer than'} {need}); "
         + ("each batch's common prefix is computed once per packed row in scoring and the loss step."
             if on else "set share_prompt_prefix=True to share them anyway."))
    return group, on


def _divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), -d))
