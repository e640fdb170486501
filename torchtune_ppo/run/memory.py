"""A memory plan of a PPO run, from the models built on the meta device (no weights read).

The recipe prints it at start-up and refuses a plan that cannot fit the device; run it alone
to size a config on a machine without the accelerator:

    python -m torchtune_ppo.run.memory --config recipes/configs/llama3_2/1B_ppo.yaml [--nproc W] [key=value ...]

With ``--nproc W`` (the recipe passes its own process count) the plan is per device of a
``torchrun`` run on ``W`` processes.

The figures are estimates: parameters, gradients, optimizer state and the KV cache are exact
sizes; activations are a per-layer rule of thumb (stated in :func:`memory_plan`), and the
allocator's fragmentation and the compile workspace come on top.
"""

import argparse
import sys
from typing import Dict, NamedTuple, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config

from torchtune_ppo import distributed, lora
from torchtune_ppo.config import share_group_prompt, shares_reward_value_base
from torchtune_ppo.rlhf import uses_value_model
from torchtune_ppo.rlhf.packing import default_rows, prefix_row_len, prefix_rows, shared_row_len, shared_rows

_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# torch.optim.AdamW keeps two states per parameter in the parameter's dtype; SGD with momentum
# one; an 8-bit optimizer about half a byte each. Unknown optimizers are counted like AdamW.
_OPTIMIZER_STATES = {"AdamW": 2.0, "Adam": 2.0, "SGD": 1.0, "AdamW8bit": 0.5, "PagedAdamW8bit": 0.5,
                     "PagedAdamW": 2.0}
# Paged optimizers (bitsandbytes) keep their state in pageable host memory and move pages to
# the GPU on demand, so their state is not counted against the device.
_PAGED_PREFIX = "Paged"
_GIB = 2**30


class MemoryPlan(NamedTuple):
    """Bytes per item (``rows``) and their total; ``available`` is the device's, when known.

    ``exact`` is the part of ``total`` that is known exactly (everything but activations):
    a plan whose exact part does not fit cannot run; one whose estimate does not fit may.
    """

    rows: Dict[str, float]
    total: float
    exact: float
    available: Optional[float]
    device: str

    def table(self) -> str:
        width = max(44, *map(len, self.rows))
        lines = [f"Memory plan on {self.device} (estimate):"]
        lines += [f"  {name:<{width}} {value / _GIB:8.2f} GiB" for name, value in self.rows.items()]
        lines.append(f"  {'total':<{width}} {self.total / _GIB:8.2f} GiB")
        if self.available is not None:
            lines.append(f"  {'available':<{width}} {self.available / _GIB:8.2f} GiB")
        return "\n".join(lines)

    @property
    def fits(self) -> bool:
        """Whether the exactly known part fits (activations are an estimate)."""
        return self.available is None or self.exact <= self.available

    @property
    def fits_estimate(self) -> bool:
        return self.available is None or self.total <= self.available


def _meta(cfg_model: DictConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return tt_config.instantiate(cfg_model)


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _kv_bytes(model: torch.nn.Module, rows: int, seq_len: int, dtype_bytes: int) -> float:
    """K and V of every attention layer for ``rows`` sequences of ``seq_len`` tokens."""
    total = 0
    for module in model.modules():
        if hasattr(module, "num_kv_heads") and hasattr(module, "head_dim"):
            total += 2 * rows * seq_len * module.num_kv_heads * module.head_dim * dtype_bytes
    return float(total)


def available_bytes(device: str) -> Optional[float]:
    """Free memory of ``device``: CUDA's free memory, or the host's available RAM for the CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return float(free)
    if device == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            return float(info["MemAvailable"].strip().split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
    return None


def memory_plan(cfg: DictConfig, prompt_len: Optional[int] = None, world_size: int = 1,
                eval_prompt_len: Optional[int] = None) -> MemoryPlan:
    """Estimates the memory of a run of ``cfg`` (a validated recipe config), per device.

    Args:
        cfg (DictConfig): the recipe config, as returned by ``validate_config``.
        prompt_len (Optional[int]): ``P`` when ``max_prompt_len`` is null (the longest prompt).
        world_size (int): processes of the run (``torchrun``), one device each.
        eval_prompt_len (Optional[int]): the evaluation prompts' width, when it evaluates
            (``eval.every_n_steps``); None: ``max_prompt_len``, else ``prompt_len``.

    Returns:
        MemoryPlan: the rows below, their total and the device's free memory.

    Rows: the four models' parameters; gradients of the policy and value model (one
    parameter's at a time with ``optimizer_in_bwd``); optimizer state; the KV cache of
    ``forward_batch_size`` rows of ``P + T``; activations of one packed training micro-step,
    taken as ``16 * D`` bytes per token per layer (or ``2 * D`` with activation checkpointing)
    plus the float32 logits kept for backward at the positions read, ``[rows * T, V]`` (twice
    that with an entropy bonus, whose backward keeps the probabilities too). A run that
    evaluates during training has one more KV cache, its evaluation generator's own (it does not
    reuse the rollout's): ``eval.batch_size`` rows of the evaluation's ``P + T``.

    On ``W`` processes each device holds ``1/W`` of the trained models' parameters, gradients
    and optimizer state, the frozen models whole (``1/W`` with ``shard_frozen_models``), the KV
    cache and micro-step of its ``1/W`` of the rows, and one more row: the models gathered
    whole for the rollout (the policy while generating; with compiled scoring then the value
    model and the sharded frozen models while scoring; with ``compile.rollout`` all of them
    at once). That row and the gradients never coexist; the total counts both.

    A LoRA policy is one copy of its base and adapters (``1/W`` of it on ``W`` processes), which
    is also the reference; only its adapters (and the value model) have gradients and optimizer
    state. A LoRA value model trains its adapters and head only; the reward model keeps its own
    copy, or, when it starts from the same checkpoint (``share_reward_value_base``), is that
    model's base with the adapters off and a head of its own: one base for both.
    Its activations are counted as a full policy's: the backward still runs through every
    frozen layer to reach the adapters below it.

    A critic-free ``advantage_estimator`` has no value model: no value parameters, gradients,
    optimizer state or activations, and only the reward model (if any) beside the policies.

    With shared group prompts (``share_group_prefill``) the micro-step's rows are the shared
    ones, each group's prompt counted once per row (:func:`~torchtune_ppo.rlhf.packing.shared_rows`);
    with the prefix every prompt shares packed once a row (``share_prompt_prefix: true``), those of
    :func:`~torchtune_ppo.rlhf.packing.prefix_rows`, counted with an empty prefix (the most slots
    they can take; with ``null`` the plan counts unshared rows, the same slots up to rounding).
    """
    W = world_size
    dtype_bytes = _DTYPE_BYTES[cfg.dtype]
    # bf16 with master weights: the optimizer steps fp32 copies, and its state is fp32 too
    masters = cfg.dtype == "bf16" and cfg.master_weights
    # on several processes the masters are the trained models' fp32 shards, their gradients fp32 too
    sharded_masters = masters and W > 1
    state_bytes = 4 if masters else dtype_bytes
    policy = _meta(cfg.policy_model)
    # None: a critic-free run with a function reward builds no model of this kind
    value = None if cfg.reward_and_value_model is None else _meta(cfg.reward_and_value_model)
    n_policy, n_value = _numel(policy), 0 if value is None else _numel(value)
    # A critic-free estimator has no value model: no parameters, gradients, state or activations.
    critic = uses_value_model(cfg.advantage_estimator)
    adapted, value_adapted = lora.has_adapters(policy), critic and lora.has_adapters(value)
    n_adapters = sum(p.numel() for p in lora.get_adapter_params(policy).values())
    # a LoRA value model trains its adapters and its head
    n_value_trained = (sum(p.numel() for p in lora.get_adapter_params(value).values())
                       + sum(p.numel() for p in value.output.parameters())) if value_adapted else n_value
    trained = (n_adapters if adapted else n_policy) + (n_value_trained if critic else 0)
    seq_len = (prompt_len or cfg.max_prompt_len or 0) + cfg.max_generated_tokens
    # multi-turn episodes (env): the cache also holds the gaps of rows waiting for the others
    episodes = cfg.get("env") is not None
    extra = ((cfg.turns.get("cache_tokens") or 2 * cfg.max_generated_tokens) - cfg.max_generated_tokens
             if episodes else 0)
    cache_len, turns_note = seq_len + extra, ", with the turns' gaps" if episodes else ""
    optimizer_name = str(cfg.optimizer.get("_component_", "")).rsplit(".", 1)[-1]
    states = _OPTIMIZER_STATES.get(optimizer_name, 2.0)
    biggest = max(p.numel() for p in [*policy.parameters(), *(value.parameters() if critic else ())])
    micro = cfg.ppo_batch_size // W // cfg.gradient_accumulation_steps
    # The loss step packs a micro-batch's real tokens into rows of P + T - 1 (packing.py); with
    # shared prompts into fewer, longer rows, each group's prompt counted once per row.
    rows_per_step, row_len = default_rows(micro), seq_len - 1
    if share_group_prompt(cfg, W):
        P, T = seq_len - cfg.max_generated_tokens, cfg.max_generated_tokens
        row_len = shared_row_len(P, T - 1, cfg.num_samples_per_prompt, getattr(policy, "max_seq_len", None))
        rows_per_step = shared_rows(micro, row_len, P, T - 1)
    elif cfg.get("share_prompt_prefix"):
        # the prefix all prompts share once a row (share_prompt_prefix): rows 4x as long
        P, T = seq_len - cfg.max_generated_tokens, cfg.max_generated_tokens
        row_len = prefix_row_len(P, T - 1, getattr(policy, "max_seq_len", None))
        rows_per_step = prefix_rows(micro, row_len, P, T - 1)
    embed_dim = policy.tok_embeddings.embedding_dim
    vocab = policy.tok_embeddings.num_embeddings
    per_token_layer = (2 if cfg.enable_activation_checkpointing else 16) * embed_dim
    logit_copies = 2 if cfg.loss.get("entropy_coeff", 0) else 1
    layers = len(policy.layers) + (len(value.layers) if critic else 0)
    paged = optimizer_name.startswith(_PAGED_PREFIX)
    frozen = 1 / W if cfg.shard_frozen_models else 1.0  # share of a frozen model per device
    # 1 process: "(0.16B each)"; W: "(0.16B; policy 1/8, reference whole)"
    # bf16 masters on several processes: a trained model (a LoRA one's base too) is kept in fp32,
    # its shards the masters; the frozen models stay bf16
    trained_bytes, fp32 = (4, " in fp32") if sharded_masters else (dtype_bytes, "")
    shares = "" if W == 1 else f"; {{}} 1/{W}{fp32}, {{}} {'1/' + str(W) if frozen < 1 else 'whole'}"
    policy_row = {
        f"policy + reference parameters ({n_policy / 1e9:.2f}B"
        f"{shares.format('policy', 'reference') if W > 1 else ' each'})":
            n_policy * (trained_bytes / W + frozen * dtype_bytes),
    } if not adapted else {  # sharded like a trained model, base included
        f"policy parameters (base {(n_policy - n_adapters) / 1e9:.2f}B + adapters "
        f"{n_adapters / 1e6:.1f}M; reference: the base{'' if W == 1 else f'; 1/{W}{fp32}'})":
            n_policy * trained_bytes / W,
    }
    if critic and shares_reward_value_base(cfg, value_is_lora=value_adapted):
        n_head = sum(p.numel() for p in value.output.parameters())
        value_row = {f"value + reward parameters (one {n_value / 1e9:.2f}B base; reward: adapters off, "
                     f"own head{'' if W == 1 else f'; base 1/{W}{fp32}'})":
                     n_value * trained_bytes / W + n_head * dtype_bytes}
    elif critic and cfg.reward is not None:  # a function reward: no reward model
        value_row = {f"value parameters ({n_value / 1e9:.2f}B{'' if W == 1 else f', 1/{W}{fp32}'}; reward: a function)":
                     n_value * trained_bytes / W}
    elif critic:
        value_row = {f"value + reward parameters ({n_value / 1e9:.2f}B"
                     f"{shares.format('value', 'reward') if W > 1 else ' each'})":
                     n_value * (trained_bytes / W + frozen * dtype_bytes)}
    else:  # the frozen reward model only, if the reward is not a function
        share = "" if W == 1 else f", {'1/' + str(W) if frozen < 1 else 'whole'}"
        value_row = {f"reward parameters ({n_value / 1e9:.2f}B{share}; no value model)":
                     frozen * n_value * dtype_bytes if cfg.reward is None else 0.0}
    value_grads = f" + value{' adapters + head' if value_adapted else ''}" if critic else ""
    rows = {
        **policy_row,
        **value_row,
        f"gradients (policy{' adapters' if adapted else ''}{value_grads}{'' if W == 1 else f', 1/{W}'}"
        f"{', fp32' if sharded_masters else ''})":
            (biggest if cfg.optimizer_in_bwd else trained / W) * (4 if sharded_masters else dtype_bytes),
        f"optimizer state ({optimizer_name or 'AdamW'}, {states:g} per parameter{', fp32' if masters else ''}"
        f"{'' if W == 1 else f', 1/{W}'}{'; paged to host memory, not counted' if paged else ''})":
            0.0 if paged else trained * states * state_bytes / W,
        # on several processes the masters are the fp32 parameters counted above
        **({f"fp32 master weights (of the {trained / 1e9:.2f}B trained)": trained * 4 / W}
           if masters and not sharded_masters else {}),
        f"KV cache ({cfg.forward_batch_size // W} rows x {cache_len} tokens{turns_note})":
            _kv_bytes(policy, cfg.forward_batch_size // W, cache_len, dtype_bytes),
        f"activations (micro-step {rows_per_step} packed rows x {row_len} tokens)":
            rows_per_step * row_len * layers * per_token_layer * dtype_bytes
            + micro * cfg.max_generated_tokens * vocab * 4 * logit_copies,
    }
    block = cfg.get("eval")
    if block is not None and block.get("every_n_steps") is not None:
        eval_rows = block.get("batch_size") or cfg.forward_batch_size // W
        eval_T = block.get("max_generated_tokens") or cfg.max_generated_tokens
        eval_len = ((eval_prompt_len or cfg.max_prompt_len or prompt_len or 0)
                    + max(eval_T, (cfg.max_generated_tokens + extra) * eval_T // cfg.max_generated_tokens))
        rows[f"evaluation KV cache (its own, not the rollout's: {eval_rows} rows x {eval_len} tokens)"] = \
            _kv_bytes(policy, eval_rows, eval_len, dtype_bytes)
    if W > 1:
        compile_cfg = cfg.compile
        # Generation gathers the policy; compiled scoring, afterwards, the scoring models (the
        # value model, and the frozen ones when sharded); compile.rollout all of them at once.
        scoring, names = (n_value, ["value"]) if critic else (0, [])
        if adapted or frozen < 1:  # a LoRA policy's reference is the (sharded) policy itself
            scoring, names = scoring + n_policy, names + ["reference"]
        if frozen < 1:
            scoring, names = scoring + n_value, names + ["reward"]
        if compile_cfg.rollout and names:
            gathered, label = n_policy + scoring, f"policy + {' + '.join(names)}"
        elif compile_cfg.trajectory and names:
            gathered = max(n_policy, scoring)
            label = f"policy, then {' + '.join(names)}"
        else:
            gathered, label = n_policy, "policy"
        rows[f"gathered whole for the rollout ({label})"] = gathered * dtype_bytes
    device = str(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    activations = next(v for k, v in rows.items() if k.startswith("activations"))
    total = float(sum(rows.values()))
    return MemoryPlan(rows, total, total - activations, available_bytes(device), device)


def check_plan(cfg: DictConfig, prompt_len: int, log, eval_prompt_len: Optional[int] = None) -> MemoryPlan:
    """Logs the plan of ``cfg``; raises when its exact part cannot fit, warns on the estimate.
    ``eval_prompt_len``: the evaluation prompts' width (see :func:`memory_plan`).

    Raises:
        RuntimeError: parameters, gradients, optimizer state and KV cache alone exceed the
            device's free memory.
    """
    plan = memory_plan(cfg, prompt_len=prompt_len, world_size=distributed.world_size(),
                       eval_prompt_len=eval_prompt_len)
    log.info(plan.table())
    advice = ("lower forward_batch_size or ppo_batch_size (with gradient_accumulation_steps), "
              "or set enable_activation_checkpointing=True, optimizer_in_bwd=True or dtype=bf16")
    if not plan.fits:
        raise RuntimeError(
            f"the memory plan above needs {plan.exact / _GIB:.1f} GiB before activations but "
            f"{plan.device} has {plan.available / _GIB:.1f} GiB free: {advice}."
        )
    if not plan.fits_estimate:
        log.warning(f"the activation estimate brings the plan above the free memory; {advice} "
                    "if the run runs out of memory.")
    return plan


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="processes of a torchrun run (per-device plan)")
    parser.add_argument("overrides", nargs="*", help="key=value, as on the tune command line")
    args = parser.parse_args(argv)
    import torchtune_ppo  # noqa: F401  registers the config resolvers
    from torchtune_ppo.config import check_world_size, validate_config

    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(list(args.overrides)))
    # Checkpoint files need not exist to plan; only the model builders are read.
    cfg = validate_config(cfg, check_machine=False)
    check_world_size(cfg, args.nproc)
    plan = memory_plan(cfg, prompt_len=cfg.max_prompt_len or 256, world_size=args.nproc)
    print(plan.table() if args.nproc == 1 else plan.table().replace(":", f", per device of {args.nproc}:", 1))
    if not plan.fits_estimate:
        print("  (the estimate is above what is available; the exact part "
              f"{'fits' if plan.fits else 'does NOT fit'})")
    if cfg.max_prompt_len is None:
        print("  (max_prompt_len is null: P = 256 assumed, for the evaluation's prompts too; the run uses its "
              "longest prompt)")
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
