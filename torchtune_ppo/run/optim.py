"""Building the optimizer: the fused kernel by default, or steps fused into backward.

:func:`build_optimizer` instantiates the config's optimizer over the policy and value
parameters, asking torch's Adam, AdamW and SGD for their fused implementation when the config
leaves ``fused``/``foreach`` unset and the device has it.

:class:`InBackwardOptimizer` (``optimizer_in_bwd``): optimizer steps fused into backward.

:class:`MasterWeights` (``dtype: bf16`` with ``master_weights``): the optimizer steps fp32 copies
of the bf16 trained weights; with ``compile.optimizer`` an Adam or AdamW step of each parameter is
one compiled pass (:func:`adam_master_step`) instead of four.

One optimizer per parameter, stepped by a post-accumulate-grad hook the moment its gradient
is ready, then its gradient freed: a full set of gradients never exists at once (how
torchtune fits a 7B policy and value model on one GPU). torchtune's hooks and its checkpoint
wrapper do the work; this class gives the recipe one object with an optimizer's surface.
"""

from typing import Any, Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Union

import torch
from omegaconf import DictConfig
from torchtune import config, training


# Optimizers with a fused kernel (one multi-tensor kernel for all parameters) on CPU and CUDA.
_FUSED = {"torch.optim.Adam", "torch.optim.AdamW", "torch.optim.SGD"}


def fused_by_default(cfg_optimizer: DictConfig, params: Iterable[torch.Tensor]) -> bool:
    """Whether :func:`build_optimizer` adds ``fused=True``: one of torch's Adam, AdamW or SGD,
    neither ``fused`` nor ``foreach`` set in the config, and every parameter a plain (not
    sharded) floating-point tensor on a CPU or CUDA device.

    On CPU torch otherwise steps each parameter with a loop of small ops (it has no foreach
    kernels there); measured on the tiny task, an AdamW step over the policy and value model
    took ~5.7 ms that way (see ``benchmarks/RESULTS.md``).
    """
    if cfg_optimizer.get("_component_") not in _FUSED:
        return False
    if cfg_optimizer.get("fused") is not None or cfg_optimizer.get("foreach") is not None:
        return False
    return all(
        type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point()
        and p.device.type in ("cpu", "cuda")
        for p in params
    )


def build_optimizer(cfg_optimizer: DictConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The ``optimizer`` block instantiated over ``params``, fused where
    :func:`fused_by_default` says so (the config's own ``fused``/``foreach`` always win)."""
    params = list(params)
    if fused_by_default(cfg_optimizer, params):
        return config.instantiate(cfg_optimizer, params, fused=True)
    return config.instantiate(cfg_optimizer, params)


class InBackwardOptimizer:
    """``optimizer_in_bwd=True``: the optimizer of ``cfg_optimizer`` for every parameter.

    ``step`` and ``zero_grad`` do nothing (the hooks did both during ``backward``), so a
    minibatch must have exactly one ``backward`` call; ``state_dict`` holds every parameter's
    state, keyed by model and parameter name.

    Args:
        cfg_optimizer (DictConfig): the ``optimizer`` block (its ``_component_`` and settings).
        models (Mapping[str, torch.nn.Module]): the trained models by name ("policy", "value").
    """

    def __init__(self, cfg_optimizer: DictConfig, models: Mapping[str, torch.nn.Module]) -> None:
        self._wrappers = {}
        for name, model in models.items():
            optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in model.parameters()}
            training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
            self._wrappers[name] = training.create_optim_in_bwd_wrapper(model, optim_dict)
        first = next(iter(self._wrappers.values()))
        self.param_groups = next(iter(first.optim_map.values())).param_groups

    def step(self) -> None:
        """Nothing to do: each parameter stepped in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed after its step."""

    def state_dict(self) -> Dict[str, Any]:
        return {name: wrapper.state_dict() for name, wrapper in self._wrappers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, wrapper in self._wrappers.items():
            wrapper.load_state_dict(state[name])


MASTER_ROUNDINGS = ("nearest", "dither")

# Knuth's multiplicative hash constant (2^32 / golden ratio): consecutive positions map to
# well-spread 16-bit thresholds.
_HASH = 0x9E3779B1
_HASH_I32 = _HASH - 2**32  # the same 32 bits as a signed int32
_CHUNK = 1 << 18  # elements a chunk of the eager dithered write-back


def rounding_salt(index: int) -> int:
    """The hash offset of the ``index``-th trained parameter, so that tensors of one shape get
    different thresholds (kept below 2**30: ``index + salt`` stays an int32 for any tensor of
    fewer than 2**30 elements)."""
    return ((index + 1) * 1_000_003) % (1 << 30)


def dithered_bf16(master: torch.Tensor, salt: Union[int, torch.Tensor]) -> torch.Tensor:
    """``master`` (fp32) rounded to bf16 at a fixed threshold of each element's own.

    Round to nearest keeps a weight until its master has moved half a bf16 spacing: masters
    that start as bf16 weights (copied from them) sit on the bf16 grid, so every update smaller
    than that, in every weight, leaves the model unchanged. Here each element rounds up when its
    master lies past a threshold ``t`` of the spacing, ``t`` in ``[0, 1)`` a hash of the
    element's position and ``salt``: a value on the grid stays exact, and of the weights whose
    masters moved by ``d`` of a spacing, a share ``d`` changes. It is stochastic rounding with
    the randomness fixed per element (deterministic, nothing stored, the same after a resume).
    Works on the fp32 bit pattern: adding ``t * 2**16`` to it and clearing the lower 16 bits
    rounds the magnitude up exactly when the dropped bits exceed ``(1 - t) * 2**16``.
    """
    index = torch.arange(master.numel(), device=master.device, dtype=torch.int32).view(master.shape)
    # int32 throughout (vectorised kernels; int64 made inductor's one-pass step 1.8x slower on
    # CPU): the product wraps modulo 2**32 and its bits 16-31 are the threshold
    threshold = ((index + salt) * _HASH_I32 >> 16) & 0xFFFF  # [0, 65535]
    bits = master.contiguous().view(torch.int32)
    # the low 16 bits cleared: an fp32 value bf16 holds exactly, so the cast below is exact (and
    # the same vectorised fp32 -> bf16 conversion as round to nearest's)
    return ((bits + threshold) & -65536).view(torch.float32).to(torch.bfloat16)


def adam_master_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: torch.Tensor,
    *,
    decoupled: bool,
    salt: Optional[torch.Tensor] = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW step of an fp32 ``master`` from the bf16 ``grad``
    of its bf16 ``param``, rounded into ``param``; everything in place, as torch's single-tensor
    ``adam``/``adamw`` computes it (no amsgrad, no maximize).

    Compiled, it is one pass over the parameter (read: the bf16 gradient, the master, both
    moments; written: the master, both moments, the bf16 weight: 28 bytes a parameter), where
    the eager path makes four (the gradient to fp32, the clip, the fused AdamW step, the
    rounding back: 48). ``hyper`` is an fp32 tensor ``[decay, beta1, beta2, eps, step_size,
    bias_correction2_sqrt, clip_coef]``, the step's scalars worked out once
    (:func:`adam_scalars`: ``decay`` is AdamW's ``1 - lr * weight_decay``, or Adam's
    ``weight_decay``; ``clip_coef`` the norm clip's ``min(1, max_norm / (norm + 1e-6))``), so
    neither a new step, a scheduled learning rate, a clip nor another optimizer setting
    recompiles, and the kernel does no powers per element (scalars derived inside it made the
    compiled step 1.4x slower on CPU). With symbolic sizes one graph serves every parameter
    (:meth:`MasterWeights.fused_step` passes them flat). ``salt`` (a 0-dim int32 tensor): the
    master is rounded into ``param`` by :func:`dithered_bf16`; None: to nearest.
    """
    decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, clip_coef = hyper.unbind()
    g = grad.float() * clip_coef
    if decoupled:
        master.mul_(decay)
    else:
        g = g + decay * master
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g * (1 - beta2))
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.sub_(step_size * exp_avg / denom)
    param.copy_(master if salt is None else dithered_bf16(master, salt))


def adam_scalars(group: Mapping[str, Any], step: float, *, decoupled: bool) -> list:
    """The first six entries of :func:`adam_master_step`'s ``hyper`` for a parameter group at
    ``step`` (counted for this step), in Python floats as torch's single-tensor Adam works
    them out."""
    lr, weight_decay = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    decay = 1 - lr * weight_decay if decoupled else weight_decay
    return [decay, beta1, beta2, group["eps"], lr / (1 - beta1**step), (1 - beta2**step) ** 0.5]


def grad_sq_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a bf16 gradient, accumulated in fp32: a 0-dim fp32 tensor.
    Compiled, one read of the gradient; eager, ``float()`` first materialises an fp32 copy (on
    CPU the fresh copy's page faults made it 0.68 s of a 1.3 s SmolLM2 optimizer step)."""
    return grad.float().square().sum()


class MasterStep(NamedTuple):
    """The functions :meth:`MasterWeights.fused_step` calls once a parameter: the Adam step
    (:func:`adam_master_step`) and the gradient's sum of squares for the clip norm
    (:func:`grad_sq_sum`), both compiled with symbolic sizes for ``compile.optimizer``."""

    step: Callable = adam_master_step
    sq_sum: Callable = grad_sq_sum


def fusable(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why :meth:`MasterWeights.fused_step` cannot step ``optimizer``, or None when it can:
    torch's Adam or AdamW with float settings, without amsgrad, maximize, capturable or
    differentiable."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{kind.__module__}.{kind.__qualname__} is not torch.optim.Adam or AdamW"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                return f"{flag}=True"
        if group.get("decoupled_weight_decay") and kind is torch.optim.Adam:
            return "Adam with decoupled_weight_decay"
        if any(isinstance(group.get(k), torch.Tensor) for k in ("lr", "weight_decay", "eps")) or any(
            isinstance(b, torch.Tensor) for b in group["betas"]
        ):
            return "a tensor lr, beta, eps or weight_decay"
    return None


def master_weights(cfg: Any, params: Iterable[torch.nn.Parameter], step_fn: Any, world_size: int
                   ) -> Optional["MasterWeights"]:
    """The run's :class:`MasterWeights` (``dtype: bf16`` with ``master_weights``, one process), or
    None: fp32 runs, bf16 without masters, and several processes, where the trained models'
    fp32 FSDP2 shards are the masters (:func:`torchtune_ppo.distributed.shard`)."""
    if cfg.dtype == "bf16" and cfg.master_weights and world_size == 1:
        return MasterWeights(params, step_fn, rounding=cfg.master_rounding)
    return None


class MasterWeights:
    """fp32 master copies of bf16 trained parameters, for ``dtype: bf16`` (``master_weights``).

    bf16 keeps 8 significant bits: a weight of 0.05 moves in steps of 2.4e-4, so an AdamW step
    of about ``lr`` = 1e-5 rounds to nothing (``benchmarks/precision/bf16_updates.py`` measures
    the share). The optimizer is built over :attr:`masters` instead of the parameters: the
    forwards and backward run in bf16, :meth:`take_grads` moves each gradient to its master in
    fp32 (clipping reads the masters' gradients), the optimizer steps the masters and its state
    is fp32, and :meth:`write_back` rounds each master to its bf16 parameter: to nearest, or
    (``rounding="dither"``) at a fixed threshold of each weight's own (:func:`dithered_bf16`), so
    that updates smaller than half a bf16 spacing reach the model in proportion. The masters are
    part of the training state (:meth:`state_dict`), so a resume continues from the same fp32
    weights.

    With ``step_fn`` (:func:`adam_master_step`, compiled: ``compile.optimizer``) and an optimizer
    it can step (:func:`fusable`), :meth:`grad_norm` and :meth:`fused_step` replace the four
    passes above: the norm is read from the bf16 gradients, and each parameter's clip, Adam
    step and rounding are one pass. The optimizer keeps its settings (a scheduler still sets
    its ``lr``) and its state, in torch's own layout, so a checkpoint resumes either way.

    Args:
        params (Iterable[torch.nn.Parameter]): the trained parameters (bf16), in the optimizer's order.
        step_fn (Union[MasterStep, Callable, None]): the one-pass functions (a bare callable:
            the Adam step, the norm's sums eager); None: the four passes.
        rounding (str): ``nearest`` or ``dither`` (:data:`MASTER_ROUNDINGS`), the config's
            ``master_rounding``.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 step_fn: Union[MasterStep, Callable, None] = None, rounding: str = "nearest") -> None:
        if rounding not in MASTER_ROUNDINGS:
            raise ValueError(f"master_rounding must be one of {list(MASTER_ROUNDINGS)}, got {rounding!r}")
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.rounding = rounding
        device = self.masters[0].device if self.masters else None
        # each parameter's hash offset, a tensor so that one compiled step serves them all
        self._salts = ([torch.tensor(rounding_salt(i), dtype=torch.int32, device=device)
                        for i in range(len(self.params))] if rounding == "dither" else None)
        if step_fn is not None and not isinstance(step_fn, MasterStep):
            step_fn = MasterStep(step=step_fn)
        self._step_fn = None if step_fn is None else step_fn.step
        self._sq_sum = grad_sq_sum if step_fn is None else step_fn.sq_sum
        self._hyper = torch.zeros(7, dtype=torch.float32, device=device)  # adam_master_step's scalars
        # fp32 gradient buffers, allocated at the first step and reused: a fresh fp32 copy of
        # every gradient each step costs page faults on CPU (SmolLM2-135M: 0.5 s of a 1 s
        # optimizer phase; benchmarks/RESULTS.md, "bf16 on AMX").
        self._grads: list = [None] * len(self.params)

    def take_grads(self) -> None:
        """Each parameter's gradient, in fp32, to its master; the parameter's is freed."""
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if p.grad is None:
                m.grad = None
                continue
            if self._grads[i] is None:
                self._grads[i] = torch.empty_like(m)
            m.grad = self._grads[i].copy_(p.grad)
            p.grad = None

    def fuses(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`fused_step` steps ``optimizer`` (a ``step_fn`` and :func:`fusable`)."""
        return self._step_fn is not None and fusable(optimizer) is None

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The total 2-norm of the bf16 gradients, accumulated in fp32: what
        ``clip_grad_norm_`` over the masters' fp32 gradients returns. A 0-dim fp32 tensor."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self._hyper.device)
        flat = lambda t: t.view(-1) if t.is_contiguous() else t  # noqa: E731  (one graph for all sizes)
        return torch.stack([self._sq_sum(flat(g)) for g in grads]).sum().sqrt()

    @torch.no_grad()
    def fused_step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, max_norm: float) -> None:
        """Clips by ``grad_norm`` to ``max_norm`` (as ``clip_grad_norm_``; inf: no clip), steps
        every master whose parameter has a gradient, and rounds it into the parameter, one
        ``step_fn`` call each; ``optimizer`` holds the settings and the state."""
        clip_coef = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        index = {id(m): i for i, m in enumerate(self.masters)}
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        flat = lambda t: t.view(-1) if t.is_contiguous() else t  # noqa: E731  (one graph for all sizes)
        self._hyper[6] = clip_coef
        for group in optimizer.param_groups:
            at = None  # the step the scalars in self._hyper are for (a skipped parameter lags)
            for m in group["params"]:
                p = self.params[index[id(m)]]
                if p.grad is None:
                    continue
                state = optimizer.state[m]
                if not state:  # torch's own initial state, so either path resumes the other
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])  # a host scalar, as torch's own Adam keeps it
                if step != at:
                    self._hyper[:6] = torch.tensor(adam_scalars(group, step, decoupled=decoupled))
                    at = step
                i = index[id(m)]
                self._step_fn(flat(p), flat(p.grad), flat(m), flat(state["exp_avg"]), flat(state["exp_avg_sq"]),
                              self._hyper, decoupled=decoupled, salt=None if self._salts is None else self._salts[i])

    @torch.no_grad()
    def write_back(self) -> None:
        """Each master rounded into its bf16 parameter (``rounding``). Dithered eagerly in chunks
        of ``_CHUNK`` elements, so that the hash's temporaries stay in cache (whole tensors at
        once made an eager SmolLM2 optimizer step 5x slower)."""
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if self._salts is None:
                p.copy_(m)
                continue
            if not (p.is_contiguous() and m.is_contiguous()):  # positions in the logical order, whole
                p.copy_(dithered_bf16(m, rounding_salt(i)))
                continue
            flat_p, flat_m, salt = p.view(-1), m.view(-1), rounding_salt(i)
            for start in range(0, flat_m.numel(), _CHUNK):
                end = min(start + _CHUNK, flat_m.numel())
                flat_p[start:end].copy_(dithered_bf16(flat_m[start:end], salt + start))

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = m.grad = None

    def state_dict(self) -> Dict[str, Any]:
        return {"masters": list(self.masters)}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the masters (and rounds them into the parameters).

        Raises:
            ValueError: the saved masters do not match the parameters in number or shape.
        """
        saved = list(state["masters"])
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(m.shape) for m in self.masters]:
            raise ValueError(f"the checkpoint's fp32 master weights ({len(saved)} tensors) do not match the "
                             f"{len(self.masters)} trained parameters of this run.")
        for m, s in zip(self.masters, saved):
            m.copy_(s)
        self.write_back()
