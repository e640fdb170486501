"""The update and the evaluation: the optimizer (its learning rate, ``optimizer_in_bwd``), the
PPO-family options and the rules between them (decoupled GAE, critic warm-up, value
pretraining, KL in the reward or the loss, rollout correction, turns), and the ``eval`` block."""

import math
from typing import Mapping

from omegaconf import DictConfig

from torchtune_ppo.config.components import import_component
from torchtune_ppo.config.notes import note
from torchtune_ppo.config.schema import EVAL_METRICS


def check_optimizer_in_bwd(cfg: DictConfig) -> None:
    """What stepping each parameter inside backward rules out: accumulated gradients, a scheduler,
    a global norm clip, and fp32 master weights (dropped with a note)."""
    if not cfg.optimizer_in_bwd:
        return
    if cfg.dtype == "bf16" and cfg.master_weights:  # torchtune's bf16 configs: they run as there
        note("optimizer_in_bwd=True steps each bf16 weight inside backward, where no fp32 master copy is "
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


def check_checkpoint_format(cfg: DictConfig) -> None:
    """``async_save`` writes sharded checkpoints only; a sharded checkpoint names the optimizer's
    state by parameter, which ``optimizer_in_bwd``'s per-parameter optimizers do not hold."""
    if cfg.async_save and cfg.checkpoint_format != "sharded":
        raise ValueError(f"async_save=True writes sharded checkpoints only (checkpoint_format={cfg.checkpoint_format!r}): "
                         "set checkpoint_format=sharded, or async_save=False.")
    if cfg.checkpoint_format == "sharded" and cfg.optimizer_in_bwd:
        raise ValueError("checkpoint_format=sharded with optimizer_in_bwd=True is not supported (one optimizer per "
                         "parameter): set checkpoint_format=full, or optimizer_in_bwd=False.")


def check_optimizer_lr(cfg: DictConfig) -> None:
    """``optimizer.lr``, when given, is a finite number > 0."""
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


def check_algorithms(cfg: DictConfig) -> None:
    """Rules between the keys of the PPO-family options (decoupled GAE, critic warm-up, KL)."""
    if cfg.lmbda_actor is not None and cfg.lmbda_length_alpha is not None:
        raise ValueError(
            f"lmbda_actor ({cfg.lmbda_actor}) and lmbda_length_alpha ({cfg.lmbda_length_alpha}) both set "
            "the actor's GAE lambda: set one of them to null."
        )
    if cfg.critic_warmup_steps and cfg.critic_warmup_steps >= cfg.num_ppo_steps:
        # Not an error: a run may be trained in parts, resumed with a larger num_ppo_steps.
        note(f"critic_warmup_steps={cfg.critic_warmup_steps} covers every step up to num_ppo_steps="
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
    if cfg.speculative.enabled and (cfg.get("env") is not None or cfg.compile.rollout):
        raise ValueError(
            "speculative.enabled=True with " + ("env (multi-turn episodes)" if cfg.get("env") is not None
                                                else "compile.rollout=True") +
            ": verification runs in the single-turn generator. Set speculative.enabled=False"
            + (", or compile.rollout=False (compile.generate compiles the verification)." if cfg.compile.rollout
               else "."))
    spec = cfg.speculative
    if (spec.draft == "drafter") != (spec.drafter is not None):
        raise ValueError(
            f"speculative.draft={spec.draft} with speculative.drafter=" + ("null" if spec.drafter is None else "set")
            + ": a drafter component is used with draft: drafter and only then. Set speculative.drafter to a "
            "mapping with a `_component_` and speculative.draft=drafter, or remove speculative.drafter.")
    cache, T = cfg.turns.cache_tokens, cfg.max_generated_tokens
    if cache is not None and cache < T:  # the Generator's rule, here before any model loads
        raise ValueError(
            f"turns.cache_tokens must be null (2 * max_generated_tokens = {2 * T}) or an integer >= "
            f"max_generated_tokens ({T}), got {cache}: the KV cache holds every token of an episode after "
            "the prompt, and more columns leave room for the gaps of rows waiting for the others' turns.")
    loss_kl = cfg.loss.get("kl_coeff", 0) if isinstance(cfg.loss, Mapping) else 0
    if loss_kl and cfg.kl_coeff:
        note(f"the KL to the reference policy is both in the reward (kl_coeff={cfg.kl_coeff}) and in the "
             f"loss (loss.kl_coeff={loss_kl}); GRPO-style runs set kl_coeff=0.")


def _check_value_pretrain(cfg: DictConfig) -> None:
    block = cfg.value_pretrain
    if not block.max_steps:
        if block.tolerance is not None:
            note(f"value_pretrain.tolerance={block.tolerance} has no effect: value_pretrain.max_steps=0 turns "
                 "value pretraining off.")
        return
    if cfg.optimizer_in_bwd:
        raise ValueError(
            f"value_pretrain.max_steps={block.max_steps} with optimizer_in_bwd=True is not supported (the "
            "policy's parameters step inside backward, so they cannot be left out): set value_pretrain.max_steps=0 "
            "or optimizer_in_bwd=False.")
    if block.tolerance is not None and block.max_steps < 2 * block.window:
        note(f"value_pretrain.tolerance={block.tolerance} needs 2 * value_pretrain.window = {2 * block.window} "
             f"steps of losses, more than value_pretrain.max_steps={block.max_steps}: pretraining runs "
             f"{block.max_steps} steps.")


def check_eval(cfg: DictConfig) -> None:
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
            note(f"eval.early_stop_patience={block.early_stop_patience} has no effect: eval.every_n_steps=null "
                 "turns evaluation off.")
        return
    if k > 1 and block.top_k == 1:
        note(f"eval.num_samples={k} with eval.top_k=1: greedy decoding gives the {k} responses to a prompt "
             f"alike, so val/pass@{k} equals val/pass@1; raise eval.top_k (or null) to sample.")
