"""The models a run builds and the weights they load: one reward source (a model or a function),
a value model where the advantage estimator needs one, checkpoint files that exist, LoRA
adapters and what they ask of the other keys, a reward model sharing the value model's base, and
the sequence length and vocabularies read from each model built on the meta device."""

from pathlib import Path
from typing import Dict, List, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config

from torchtune_ppo.config.components import import_component
from torchtune_ppo.config.notes import note


CHECKPOINTERS = (
    "checkpointer",
    "ref_policy_checkpointer",
    "value_checkpointer",
    "reward_checkpointer",
)


def check_reward(cfg: DictConfig) -> None:
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


def check_advantage_estimator(cfg: DictConfig) -> None:
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
        note(f"advantage_estimator={estimator} trains no value model: value_checkpointer is "
             "ignored (nothing is loaded from it or saved for it).")
        cfg.value_checkpointer = None


def check_checkpoint_files(cfg: DictConfig) -> None:
    """Every file each checkpointer names exists on this machine."""
    for key in [k for k in CHECKPOINTERS if cfg[k] is not None]:
        for path in _checkpoint_files(cfg[key], key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{key}: checkpoint file {str(path)!r} does not exist; check "
                    f"{key}.checkpoint_dir and {key}.checkpoint_files."
                )


def check_models(cfg: DictConfig) -> None:
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
        note("value_checkpointer reads reward_checkpointer's files and reward_and_value_model is LoRA: "
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
