"""Data parallelism over prompts with torchrun and FSDP2: everything the recipe needs of ranks.

With one process (no ``WORLD_SIZE``/``RANK`` in the environment) every function here is a
no-op and the recipe runs as on one device. Under ``torchrun --nproc_per_node W`` each rank
takes ``1/W`` of a step's prompts; the trained models are sharded per transformer layer
(``fully_shard``), the frozen ones replicated (or sharded the same way, with
``shard_frozen_models``). Reductions are sums across ranks: the recipe
turns its per-rank quantities into shares of the global batch (token weights over the global
valid count), so the sum is the 1-process value.
"""

import atexit
import contextlib
import os
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtune import modules, training

from torchtune_ppo import lora
from torchtune_ppo._patches.fsdp import set_aside_forward_hooks


def init_distributed(device: torch.device) -> bool:
    """Joins the process group from torchrun's environment; returns False with one process."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    if not dist.is_initialized():
        dist.init_process_group(backend=training.get_distributed_backend(device.type))
        atexit.register(shutdown)
    return True


def shutdown() -> None:
    """Leaves the process group, if still in it; run at exit, on every path out of the recipe.

    A gloo group left to the interpreter's teardown can abort the process after a run that
    finished ("terminate called without an active exception", SIGABRT): its C++ worker threads
    still hold work whose tensors need the interpreter, which is gone by then. Destroying the
    group while the interpreter is alive joins them.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ranks (a new tensor); ``x`` itself with one process."""
    return _all_reduce(x, dist.ReduceOp.SUM)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over ranks (a new tensor); ``x`` itself with one process."""
    return _all_reduce(x, dist.ReduceOp.MAX)


def _all_reduce(x: torch.Tensor, op) -> torch.Tensor:
    if world_size() == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """``[b, ...]`` per rank -> ``[W * b, ...]``, rank-major; ``x`` with one process."""
    if world_size() == 1:
        return x
    out = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def all_gather_objects(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order."""
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def pad_micro_steps(steps: List[Any]) -> List[Any]:
    """The packed micro-steps of one minibatch, padded to the most any rank has.

    Every rank must run the same number of forward/backward passes through the sharded models
    (each gathers parameters and reduces gradients collectively), but packing gives each rank
    as many as its own rows' lengths need. The extra ones repeat the first with every weight
    0: no loss, no gradient, no stats.
    """
    if world_size() == 1:
        return steps
    n = torch.tensor(len(steps))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    filler = steps[0]._replace(weights=torch.zeros_like(steps[0].weights),
                               stat_weights=torch.zeros_like(steps[0].stat_weights))
    return steps + [filler] * (int(n) - len(steps))


def agree_on_stop(stop: Any) -> None:
    """A stop signal any rank received (``stop.signum``) becomes every rank's, so that all of
    them leave the loop after the same step and save together."""
    if world_size() == 1:
        return
    signum = torch.tensor(stop.signum or 0)
    dist.all_reduce(signum, op=dist.ReduceOp.MAX)
    if int(signum) and not stop:
        stop.signum = int(signum)


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def shard(model: nn.Module, compute_dtype: Optional[torch.dtype] = None) -> None:
    """FSDP2 per transformer layer, then the root (embeddings, final norm, output): the trained
    models, and the frozen ones with ``shard_frozen_models``.

    Gradients are reduce-scattered as sums, not means: the loss step weights each token by
    ``1 / (global valid tokens)``, so each rank's gradient is already its share of the global one.

    A LoRA model is sharded the same way, as torchtune's ``lora_finetune_distributed`` does: the
    frozen base and the adapters of a layer in one FSDP2 group, only the adapters with gradients.
    Its fresh adapters (``lora_a``) were drawn from each rank's own seed (torchtune's
    ``set_seed`` adds the rank), so rank 0's are copied to every rank first: each rank then
    keeps its shard of the one model the 1-process run would have.

    ``compute_dtype`` (bf16 with ``master_weights``): the model's parameters stay in their own
    dtype (fp32: each rank's shard is the master copy of its part) and are gathered in
    ``compute_dtype`` for every forward and backward; gradients are reduced in fp32 into the
    fp32 shards (FSDP2's ``MixedPrecisionPolicy``), so the optimizer steps fp32 weights and keeps
    updates below a bf16 spacing, as :class:`~torchtune_ppo.run.optim.MasterWeights` does on one process.
    """
    if world_size() > 1:
        for p in lora.get_adapter_params(model).values():
            dist.broadcast(p.data, src=0)
    kwargs: Dict[str, Any] = {"reshard_after_forward": True}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for m in reversed([m for m in model.modules() if isinstance(m, modules.TransformerSelfAttentionLayer)]):
        fully_shard(m, **kwargs)  # each layer its own group, innermost first, as torchtune's shard_model
    fully_shard(model, **kwargs)  # the root: embeddings, final norm, output
    for m in _fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    # The root's parameters stay gathered from forward to backward: the loss step applies the
    # output layer after the root's forward (see _patches.torchtune_modules.final_hidden_states), and
    # backward would gather them again at once anyway. Scoring reads the reference policy's
    # output layer the same way; after the rollout the recipe frees what is left (reshard).
    model.set_reshard_after_forward(False, recurse=False)


def _fsdp_modules(model: nn.Module) -> List[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(*models: nn.Module) -> None:
    """Frees the gathered parameters a no-grad forward left behind (FSDP2 keeps the root's
    gathered after forward, expecting a backward); a no-op on a plain module."""
    for model in models:
        for m in _fsdp_modules(model):
            m.reshard()


@contextlib.contextmanager
def gathered(*models: nn.Module) -> Iterator[None]:
    """Every sharded model's parameters gathered once for the block, then freed; FSDP2's
    forward hooks set aside meanwhile. For no-grad forwards only (generation, scoring).

    Inside, each model is a plain module holding whole parameters: its forwards gather nothing
    (without this, generation would all-gather every layer at each of its ``T`` decode steps),
    and ``torch.compile(fullgraph=True)`` can trace it (FSDP2's hooks are ``dynamo.disable``d,
    a graph break). With the parameters already gathered and no gradient to arrange, those hooks
    would do nothing anyway. The gathered weights cost each model's full size for the duration.
    A no-op on plain modules.
    """
    fsdp = [m for model in models for m in _fsdp_modules(model)]
    for m in fsdp:
        m.unshard()
    restore = [set_aside_forward_hooks(m) for m in fsdp]
    try:
        yield
    finally:
        for put_back in restore:
            put_back()
        for m in fsdp:
            m.reshard()


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full CPU state dict on rank 0 (empty elsewhere); every rank must call it."""
    if isinstance(model, FSDPModule):
        return training.gather_cpu_state_dict(model, rank() == 0)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def full_optimizer_state_dict(models: Dict[str, nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer state keyed by parameter names (``policy.<fqn>``), full tensors on the CPU,
    so it loads on any number of ranks. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        nn.ModuleDict(models), optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )


def keyed_by_name(optimizer_state: Dict[str, Any]) -> bool:
    """Whether an optimizer state dict is :func:`full_optimizer_state_dict`'s (parameter names),
    not ``Optimizer.state_dict()``'s (parameter indices)."""
    params = [p for group in optimizer_state["param_groups"] for p in group["params"]]
    return bool(params) and isinstance(params[0], str)


def trained_names(models: Dict[str, nn.Module]) -> List[str]:
    """``<model>.<fqn>`` of every trained parameter, in the order the optimizer holds them: the
    policy's, then the value model's (a LoRA model's frozen base is not among them)."""
    return [f"{prefix}.{n}" for prefix, m in models.items() for n, p in m.named_parameters() if p.requires_grad]


def _by_name(models: Dict[str, nn.Module], optimizer_state: Dict[str, Any]) -> Dict[str, Any]:
    # Optimizer.state_dict() numbers the parameters in the order the optimizer was given them.
    names = trained_names(models)
    return {
        "state": {names[i]: v for i, v in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                         for g in optimizer_state["param_groups"]],
    }


def load_full_optimizer_state_dict(
    models: Dict[str, nn.Module], optimizer: torch.optim.Optimizer, state: Dict[str, Any]
) -> None:
    """Loads :func:`full_optimizer_state_dict`'s output, or a 1-process ``Optimizer.state_dict()``
    of the same models, into a (possibly sharded) optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not keyed_by_name(state):
        state = _by_name(models, state)
    set_optimizer_state_dict(
        nn.ModuleDict(models), optimizer, optim_state_dict=state,
        options=StateDictOptions(full_state_dict=True),
    )


def load_full_masters(models: Dict[str, nn.Module], masters: List[torch.Tensor]) -> None:
    """One process's fp32 masters (:class:`~torchtune_ppo.run.optim.MasterWeights`, in the
    optimizer's order) into the fp32 trained parameters of several processes, each rank its shard
    (bf16 with master weights saved on one process, resumed on several)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    masters = iter(masters)
    for model in models.values():
        full = {n: next(masters) for n, p in model.named_parameters() if p.requires_grad}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))

