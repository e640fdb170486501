"""LoRA PPO: a frozen base, trained adapters, and the reference policy for free.

A policy built with one of torchtune's LoRA builders (``torchtune.models.llama3_2.lora_llama3_2_1b``,
``torchtune.models.qwen2_5.lora_qwen2_5_0_5b``, ``torchtune.models.llama2.lora_llama2``, ...,
with ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``,
``lora_alpha`` as torchtune's LoRA recipes name them) is a LoRA policy. Then:

- only its adapter parameters train (:func:`train_adapters_only`); its base weights load from
  the policy checkpoint and stay frozen (:func:`load_base`);
- the reference policy is the same module with its adapters switched off
  (:func:`adapters_off`, torchtune's ``disable_adapter``): no second copy of the weights. With
  the adapters off a ``LoRALinear`` returns ``F.linear(x, W, b)``, so the reference logprobs are
  the base model's, bit for bit;
- in bf16 (or fp16) each adapter's term is added inside its base product
  (:class:`OneRoundingLoRALinear`, :func:`round_adapters_once`): ``x W^T + s B A x`` is rounded
  once, where torchtune's ``LoRALinear`` rounds ``x W^T`` first and an adapter term under half
  a spacing of it is lost;
- checkpoints hold the adapters in the PEFT layout (:func:`peft_adapter_config`,
  :func:`adapter_state_dict`, written by torchtune's HF checkpointer) and, at the end, the merged
  weights (:func:`merged_state_dict`).

A ``reward_and_value_model`` built with a LoRA builder (``torchtune_ppo.models.lora_llama3_2_1b_classifier``,
...) gives a value model that trains its adapters and its head (:func:`head_names`; saved beside
the adapters, :func:`head_state_dict`). When the value model starts from the reward model's
checkpoint (``share_reward_value_base``), the reward model is :class:`SharedBaseReward`: the value
model's frozen base with its adapters off, and a head of its own holding the checkpoint's head.
Otherwise it is its own copy of the base, with its adapters off for good
(:func:`adapters_off_for_good`: never switched, so no region sees them change).

The adapters' switch is a Python attribute (``LoRALinear.disabled``) that a compiled region
guards on. Each region here always sees it the same way at its entry, so none recompiles:
generation and the loss step run with the adapters on, the scoring region (which holds the
reference forward) with the policy's adapters off; that switch flips only between regions, in
eager code (:class:`~torchtune_ppo.rollout.Rollout`). ``compile.rollout``, one region for
generation and scoring, would need both states in one graph and is refused for a LoRA policy.
A :class:`SharedBaseReward` flips its base's adapters off and back on inside the scoring region
(:func:`base_adapters_off`): dynamo traces the two writes, guards only on the value at entry
(on, always), and the region still compiles once.

Under torchrun a LoRA model is sharded like a full one (:func:`torchtune_ppo.distributed.shard`:
base and adapters of a layer in one FSDP2 group); the switch is the same attribute on the same
``LoRALinear`` modules, and the state dicts here gather FSDP2's shards into whole tensors.
"""

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules.peft import (
    LoRALinear,
    disable_adapter,
    get_adapter_params,
    get_merged_lora_ckpt,
    set_trainable_params,
)

from torchtune_ppo._patches.torchtune_modules import final_hidden_states

__all__ = [
    "LoraSettings",
    "OneRoundingLoRALinear",
    "SharedBaseReward",
    "adapter_state_dict",
    "adapters_off",
    "adapters_off_for_good",
    "base_adapters_off",
    "checkpoint_head",
    "get_adapter_params",
    "has_adapters",
    "head_names",
    "head_state_dict",
    "load_adapters",
    "load_base",
    "lora_settings",
    "merged_state_dict",
    "peft_adapter_config",
    "round_adapters_once",
    "setup_lora_model",
    "train_adapters_only",
]

R = TypeVar("R")


class LoraSettings(NamedTuple):
    """What a model's adapters are: ``rank``, ``alpha`` and the local names of the linears that
    carry them (``q_proj``, ``v_proj``, ``w1``, ..., ``output``; torchtune's names)."""

    rank: int
    alpha: float
    target_modules: List[str]


def _is_adapter(module: nn.Module) -> bool:
    # torchtune's AdapterModule is a Protocol without runtime checks; this is the test its own
    # get_adapter_params and disable_adapter apply.
    return callable(getattr(module, "adapter_params", None))


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds adapter modules (built with a LoRA builder)."""
    return any(_is_adapter(m) for m in model.modules())


def lora_settings(model: nn.Module) -> LoraSettings:
    """The rank, alpha and adapted module names of ``model``'s ``LoRALinear`` layers.

    Raises:
        ValueError: the model has no LoRA layers, holds another kind of adapter (e.g. DoRA), or its
            layers differ in rank or alpha (one ``adapter_config.json`` cannot say that).
    """
    layers = {name: m for name, m in model.named_modules() if _is_adapter(m)}
    if not layers:
        raise ValueError("the model has no LoRA layers; build it with a LoRA builder (e.g. lora_llama3_2_1b).")
    other = sorted({type(m).__name__ for m in layers.values() if type(m) not in (LoRALinear, OneRoundingLoRALinear)})
    if other:
        raise ValueError(f"only plain LoRA (LoRALinear) is supported, the model holds {other} "
                         "(use_dora and quantize_base must be False).")
    ranks = {(m.rank, float(m.alpha)) for m in layers.values()}
    if len(ranks) != 1:
        raise ValueError(f"every LoRA layer must have the same (rank, alpha), got {sorted(ranks)}.")
    (rank, alpha), = ranks
    targets = sorted({name.rsplit(".", 1)[-1] for name in layers})
    return LoraSettings(rank=rank, alpha=alpha, target_modules=targets)


def head_names(model: nn.Module) -> List[str]:
    """The parameters of ``model.output`` (a classifier's head, e.g. ``output.weight``)."""
    return [f"output.{n}" for n, _ in model.output.named_parameters()]


def adapters_off_for_good(model: nn.Module) -> None:
    """Switches every adapter of a frozen ``model`` off once (a reward model built from a LoRA
    ``reward_and_value_model``): it runs as its base, and no region ever sees the switch move."""
    for module in model.modules():
        if _is_adapter(module) and hasattr(module, "disabled"):
            module.disabled = True


class OneRoundingLoRALinear(LoRALinear):
    """torchtune's ``LoRALinear`` with its adapter's term added inside the base product.

    ``LoRALinear`` returns ``F.linear(x, W) + s * B(A(x))``: in bf16 the base product is rounded
    to bf16 first, onto the grid, and adding a term smaller than half a bf16 spacing of it rounds
    back to the same value. An adapter starts at ``B = 0`` and grows by about ``lr`` a step, so in
    a bf16 run its early updates (and later its small ones) change the gradients but not the
    outputs: generation samples the base policy. Here ``torch.addmm(s * B(A(x)), x, W^T)`` sums
    both in the product's fp32 accumulator and rounds once (the CPU kernel adds the matrix before
    rounding, ``tests/parity/test_lora.py`` checks it against the fp32 sum; cuBLAS computes
    ``A B + C`` in its fp32 compute type too, not yet run on a GPU here).
    Same parameters, state dict and gradients; with the adapters off (or a quantized base) it is
    ``LoRALinear``'s own forward, so the reference policy stays the base model bit for bit.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled or self._quantize_base:
            return super().forward(x)
        term = (self.alpha / self.rank) * self.lora_b(self.lora_a(self.dropout(x)))
        if self.bias is not None:
            term = term + self.bias
        out = torch.addmm(term.reshape(-1, self.out_dim), x.reshape(-1, self.in_dim), self.weight.t())
        return out.view(*x.shape[:-1], self.out_dim)


def round_adapters_once(model: nn.Module) -> int:
    """Every torchtune ``LoRALinear`` of ``model`` becomes an :class:`OneRoundingLoRALinear` (its
    class swapped in place: parameters, hooks and ``isinstance`` checks unchanged); before FSDP2
    wraps the model. Returns how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module) is LoRALinear:
            module.__class__ = OneRoundingLoRALinear
            changed += 1
    return changed


def train_adapters_only(model: nn.Module, also: Sequence[str] = ()) -> List[str]:
    """Freezes every parameter of ``model`` but its adapters (and the parameters named in
    ``also``, e.g. a value head ``output.weight``); returns the trained names."""
    trained = set(get_adapter_params(model)) | set(also)
    set_trainable_params(model, trained)
    return sorted(trained)


def load_base(model: nn.Module, state_dict: Mapping[str, torch.Tensor], key: str) -> None:
    """Loads base weights (a full checkpoint without adapters) into a LoRA ``model``; the
    adapters keep their initialisation (``lora_b`` zero: the model starts as the base).

    Raises:
        ValueError: naming the checkpointer ``key``, when the checkpoint lacks a base weight or
            holds names the model does not have.
    """
    adapter_names = set(get_adapter_params(model))
    result = model.load_state_dict(state_dict, strict=False)
    missing = sorted(set(result.missing_keys) - adapter_names)
    if missing or result.unexpected_keys:
        raise ValueError(f"{key}: the checkpoint does not fit the LoRA model: missing "
                         f"{missing[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}.")


def setup_lora_model(model: nn.Module, base: Mapping[str, torch.Tensor], key: str, *, trainable: bool,
                     train_head: bool = False, saved: Optional[Tuple[Mapping[str, torch.Tensor], str]] = None) -> None:
    """Loads and freezes a model built with a LoRA builder, as the recipe uses it.

    Args:
        model (nn.Module): the LoRA model, built.
        base (Mapping[str, torch.Tensor]): its checkpointer's (adapter-free) state dict.
        key (str): that checkpointer's config key, named in errors.
        trainable (bool): the policy or value model: its adapters (and, with ``train_head``, its
            head) train, the base is frozen. Else a frozen model (the reward model built from a
            LoRA ``reward_and_value_model``): its adapters are switched off for good.
        train_head (bool): train ``model.output`` whole (a value model's head).
        saved (Optional[Tuple[Mapping, str]]): trained adapters to resume from and where they
            were read (:func:`torchtune_ppo.checkpointing.load_adapters`).
    """
    load_base(model, base, key)
    if not trainable:
        adapters_off_for_good(model)
        return
    train_adapters_only(model, also=head_names(model) if train_head else ())
    if saved is not None:
        load_adapters(model, *saved)


def load_adapters(model: nn.Module, adapters: Mapping[str, torch.Tensor], source: str) -> None:
    """Loads trained weights saved by :func:`adapter_state_dict` and :func:`head_state_dict`.

    Raises:
        ValueError: naming ``source``, when the saved names are not exactly the model's trained ones.
    """
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(adapters) != trained:
        raise ValueError(f"{source}: the saved adapters do not fit the model: missing "
                         f"{sorted(trained - set(adapters))[:5]}, unexpected "
                         f"{sorted(set(adapters) - trained)[:5]}; was it saved with other LoRA settings?")
    model.load_state_dict(dict(adapters), strict=False)


def _full_cpu(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``t``, whole: an FSDP2 shard (a ``DTensor``) is all-gathered
    first, a collective every rank must enter in the same order."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.to("cpu", copy=True)


def adapter_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter parameters of a LoRA ``model``, whole, detached on the CPU, in torchtune's
    names. Under FSDP2 every rank must call it (each adapter is all-gathered; all ranks get
    them: a few MB)."""
    return {n: _full_cpu(p) for n, p in get_adapter_params(model).items()}


def head_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The parameters trained whole beside the adapters (a value model's head), whole on the
    CPU; under FSDP2 every rank must call it, as :func:`adapter_state_dict`."""
    adapters = set(get_adapter_params(model))
    return {n: _full_cpu(p) for n, p in model.named_parameters()
            if p.requires_grad and n not in adapters}


def merged_state_dict(model: nn.Module, state_dict: Optional[Mapping[str, torch.Tensor]] = None
                      ) -> Dict[str, torch.Tensor]:
    """``model``'s weights with each adapter merged in (``W + alpha / rank * B A``): the state
    dict of the plain (non-LoRA) model, on the CPU.

    Args:
        model (nn.Module): the LoRA model (its settings are read from it).
        state_dict (Optional[Mapping[str, torch.Tensor]]): its full state dict on the CPU,
            adapters included, gathered from FSDP2's shards onto rank 0
            (:func:`torchtune_ppo.distributed.full_state_dict`; empty on the other ranks, which
            then get an empty dict). Its tensors are merged in place: copies, never the model's
            own. Default: a CPU copy of ``model.state_dict()`` (an unsharded model).
    """
    settings = lora_settings(model)
    state = (dict(state_dict) if state_dict is not None
             else {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()})
    return get_merged_lora_ckpt(state, rank=settings.rank, alpha=settings.alpha)


def peft_adapter_config(model: nn.Module) -> Dict[str, Any]:
    """The adapter config torchtune's LoRA recipes pass their checkpointer, which writes it as
    PEFT's ``adapter_config.json`` (module names mapped to Hugging Face's)."""
    settings = lora_settings(model)
    return {"r": settings.rank, "lora_alpha": settings.alpha,
            "target_modules": list(settings.target_modules), "peft_type": "LORA"}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Runs ``model`` as its base inside the block (torchtune's ``disable_adapter``). Call it
    around a whole region, never inside one: the switch is what compiled regions guard on."""
    with disable_adapter(model):
        yield


def checkpoint_head(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """A frozen copy of ``model.output`` holding the head of ``state_dict`` (``output.*``): the
    reward model's head, read from the checkpoint the value model starts from."""
    head = copy.deepcopy(model.output)
    head.load_state_dict({n[len("output."):]: t for n, t in state_dict.items() if n.startswith("output.")})
    return head.eval().requires_grad_(False)


class SharedBaseReward(nn.Module):
    """The reward model on the value model's frozen base: ``base``'s embeddings, layers and norm
    with its adapters off, then ``head`` (the reward checkpoint's, frozen).

    For a LoRA value model that starts from the reward model's checkpoint: the value model is
    that base with its adapters on and its own trained head, so one copy of the base serves
    both. The base is held by reference, not as a submodule: this module's only parameters are
    the head's, so nothing is counted, saved or moved twice. With the adapters off a
    ``LoRALinear`` computes ``F.linear(x, W, b)``, so the scores are those of a separate copy of
    the base, bit for bit, at every step (the base never trains).

    Args:
        base (nn.Module): the LoRA value model (a ``TransformerDecoder``).
        head (nn.Module): the reward model's head (:func:`checkpoint_head`).
    """

    def __init__(self, base: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.output = head
        object.__setattr__(self, "base", base)  # not registered: its parameters are the value model's
        # what base_adapters_off switches, in a plain list (not registered either)
        self.base_adapters = [m for m in base.modules() if _is_adapter(m) and hasattr(m, "disabled")]

    # The decoder's parts, so that code reading a TransformerDecoder's (final_hidden_states) runs on it.
    @property
    def tok_embeddings(self) -> nn.Module:
        return self.base.tok_embeddings

    @property
    def layers(self) -> nn.ModuleList:
        return self.base.layers

    @property
    def norm(self) -> nn.Module:
        return self.base.norm

    @property
    def max_seq_len(self) -> int:
        return self.base.max_seq_len

    def forward(self, tokens: torch.Tensor, *, mask: Optional[torch.Tensor] = None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scores ``[b, s, num_classes]`` of ``tokens [b, s]`` (a ``TransformerDecoder``'s call)."""
        return self.output(base_adapters_off(
            self, lambda m: final_hidden_states(m, tokens, mask=mask, input_pos=input_pos)))


def base_adapters_off(model: nn.Module, fn: Callable[[nn.Module], R]) -> R:
    """``fn(model)`` with the base adapters of a :class:`SharedBaseReward` switched off, and on
    again after; for any other model just ``fn(model)``.

    Meant to run inside a compiled region: dynamo traces the switch's writes, replays the last
    one (on) after the graph, and guards only on the value at entry, always on, so the region
    compiles once (``tests/parity/test_shared_base.py`` counts it).
    """
    adapters = model.base_adapters if isinstance(model, SharedBaseReward) else ()
    for m in adapters:
        m.disabled = True
    try:
        return fn(model)
    finally:
        for m in adapters:
            m.disabled = False
