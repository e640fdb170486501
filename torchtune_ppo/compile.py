"""The one place that decides how hot regions are compiled.

:func:`regions` returns every region's callable for a run, compiled or eager, with its mode and
fullgraph decided here from the config's ``compile:`` block; :func:`generation_steps` does the
same for the generator's prefill and decode step. Every compiled region is a plain function
wrapped by :func:`maybe_compile`. No process-wide
dynamo or inductor setting is changed: ``dynamic=False`` already keeps shapes static (a new
shape is a new static graph, never a symbolic one) and specializes Python floats such as the
temperature, so a user's own ``torch.compile`` calls see the defaults they expect. The only
other dynamo feature used, skipping guard evaluation inside the decode loop, is scoped to the
loop by :func:`skip_guard_checks`.

For tests only, the environment variable ``TORCHTUNE_PPO_COMPILE_BACKEND`` (``eager`` or
``aot_eager``; unset: inductor) swaps the backend every region is compiled with
(:func:`compile_backend`). Dynamo traces and guards each region exactly as with inductor, and
guards are what decide recompiles, so a test can count a real model's recompiles without
inductor's code generation (about 400 s a region for SmolLM2's 30 unrolled layers on 2 cores).
"""

import contextlib
import inspect
import os
import warnings
from typing import Any, Callable, ContextManager, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch

from torchtune_ppo._patches import dynamo as dynamo_patches

F = TypeVar("F", bound=Callable)
T = TypeVar("T")

# CUDA graphs replay on the decode step only; the prefill, run once per batch, goes without.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_NO_CUDAGRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}

# torch >= 2.7 can run only the guards that tell cache entries apart.
_HAS_SKIP_GUARD_EVAL = "skip_guard_eval_unsafe" in inspect.signature(
    torch.compiler.set_stance
).parameters


BACKEND_ENV = "TORCHTUNE_PPO_COMPILE_BACKEND"
TEST_BACKENDS = ("eager", "aot_eager")


def compile_backend() -> Optional[str]:
    """The backend ``TORCHTUNE_PPO_COMPILE_BACKEND`` asks for (tests only), or None: inductor.

    Raises:
        ValueError: if the variable is set to anything but ``eager`` or ``aot_eager``.
    """
    value = os.environ.get(BACKEND_ENV)
    if value is None or value == "":
        return None
    if value not in TEST_BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={value!r} is not a test backend; valid: {list(TEST_BACKENDS)}, or "
            "unset it to compile with inductor."
        )
    return value


def maybe_compile(
    fn: F, *, enabled: bool, mode: str = "default", fullgraph: bool = True
) -> F:
    """``torch.compile(fn)`` with static shapes when ``enabled``, else ``fn`` itself (the eager twin)."""
    if not enabled:
        return fn
    kwargs = {"fullgraph": fullgraph, "dynamic": False}
    backend = compile_backend()
    if backend is not None:
        kwargs["backend"] = backend  # modes are inductor's: a test backend runs without one
    elif mode != "default":
        kwargs["mode"] = mode
    return torch.compile(fn, **kwargs)


class Regions(NamedTuple):
    """The compiled (or eager) callables of a run, from :func:`regions`.

    Attributes:
        generate (bool): the generator compiles its prefill and decode step
            (:func:`generation_steps`, in ``mode``).
        mode (str): the ``torch.compile`` mode of the generator's regions.
        score (Callable): steps 2-6 on packed rows,
            :func:`~torchtune_ppo.rollout.scoring.packed_score_trajectory`.
        fused_rollout (Optional[Callable]): steps 1-6 as one region
            (:func:`~torchtune_ppo.rollout.fused.fused_rollout`) with ``compile.rollout``, else None.
        loss_step (Callable): :func:`~torchtune_ppo.ppo.loss_step.packed_ppo_loss_step`.
        whole_scoring_models (bool): the scoring runs as one graph, which cannot cross FSDP's
            hooks: sharded scoring models are gathered whole around it.
    """

    generate: bool
    mode: str
    score: Callable
    fused_rollout: Optional[Callable]
    loss_step: Callable
    whole_scoring_models: bool


def regions(compile_cfg: Any, *, world_size: int = 1) -> Regions:
    """Every region's callable for a run, from the parsed ``compile:`` block.

    Args:
        compile_cfg (CompileConfig): ``generate``, ``trajectory``, ``loss_step``, ``rollout``,
            ``mode`` (:func:`torchtune_ppo.config.parse_compile`).
        world_size (int): processes of the run. Under FSDP (> 1) the loss step compiles with
            ``fullgraph=False``: its forward and backward need FSDP2's hooks, which dynamo
            cannot trace, so the graph breaks at each sharded module.

    Returns:
        Regions: compiled regions where the block says so, eager twins elsewhere.
    """
    from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
    from torchtune_ppo.rollout.fused import fused_rollout
    from torchtune_ppo.rollout.scoring import packed_score_trajectory

    compile_backend()  # a bad test backend is refused before any weights load
    fused = compile_cfg.rollout
    if fused and (compile_cfg.generate or compile_cfg.trajectory):
        warnings.warn("compile.rollout compiles steps 1-6 as one region; compile.generate and "
                      "compile.trajectory are unused.")
    return Regions(
        generate=compile_cfg.generate and not fused,
        mode=compile_cfg.mode,
        score=maybe_compile(packed_score_trajectory, enabled=compile_cfg.trajectory and not fused),
        fused_rollout=maybe_compile(fused_rollout, enabled=True) if fused else None,
        loss_step=maybe_compile(packed_ppo_loss_step, enabled=compile_cfg.loss_step,
                                fullgraph=world_size == 1),
        whole_scoring_models=compile_cfg.trajectory or fused,
    )


def generation_steps(
    prefill: F, decode: F, *, compiled: bool, mode: str, device: torch.device
) -> Tuple[F, F, bool]:
    """The generator's prefill and decode step, compiled in ``mode`` or eager; and whether the
    decode step replays CUDA graphs.

    CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``) apply to the decode step only, and
    only on CUDA; the prefill, run once per batch, is compiled without them.
    """
    cudagraphs = compiled and mode in CUDAGRAPH_MODES and device.type == "cuda"
    if compiled and mode in CUDAGRAPH_MODES and not cudagraphs:
        warnings.warn(f"compile_mode={mode!r} uses CUDA graphs, which need a CUDA device; on "
                      f"{device.type} the steps run without them.")
    return (
        maybe_compile(prefill, enabled=compiled, mode=without_cudagraphs(mode)),
        maybe_compile(decode, enabled=compiled, mode=mode),
        cudagraphs,
    )


def mark_dynamic(packed: T, *, rows: Sequence[torch.Tensor], reads: Sequence[torch.Tensor]) -> T:
    """Marks the sizes of a packed region's inputs dynamic: dim 0 (the rows ``R``) of each of
    ``rows`` and dim 1 (the chunk length ``K``) of each ``[C, K]`` tensor of ``reads``.

    A region compiled with ``dynamic=False`` then traces one graph symbolic in exactly these
    sizes, and every later length mix reuses it. Both must be at least 2 (dynamo specialises
    sizes 0 and 1). Eager code ignores the marks. Returns ``packed``.
    """
    for t in rows:
        torch._dynamo.mark_dynamic(t, 0)
    for t in reads:
        torch._dynamo.mark_dynamic(t, 1)
    return packed


def without_cudagraphs(mode: str) -> str:
    """The compile mode to use for a region that should not capture CUDA graphs."""
    return _NO_CUDAGRAPHS.get(mode, mode)


def skip_guard_checks(enabled: bool) -> ContextManager:
    """Skips guard evaluation of already-compiled regions inside the ``with`` block.

    Safe only where nothing the guards cover changes: the decode loop after its first step
    (evaluating them costs ~0.2 ms a step on CPU). A no-op when ``enabled`` is False, on torch
    without the feature, and when the user set a stance of their own (e.g. ``force_eager``),
    which entering a new stance would override.
    """
    if not (enabled and _HAS_SKIP_GUARD_EVAL and dynamo_patches.current_stance() == "default"):
        return contextlib.nullcontext()
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles)."""
    return dynamo_patches.unique_graphs()


class RecompileCounter:
    """Counts compilations after a warm-up mark: ``counter.mark()`` then ``counter.since_mark``."""

    def __init__(self) -> None:
        self._mark = None

    def mark(self) -> None:
        self._mark = compile_count()

    @property
    def marked(self) -> bool:
        return self._mark is not None

    @property
    def since_mark(self) -> int:
        return 0 if self._mark is None else compile_count() - self._mark
