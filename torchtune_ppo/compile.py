"""The one place that decides how hot regions are compiled.

Every compiled region is a plain function wrapped by :func:`maybe_compile`. No process-wide
dynamo or inductor setting is changed: ``dynamic=False`` already keeps shapes static (a new
shape is a new static graph, never a symbolic one) and specializes Python floats such as the
temperature, so a user's own ``torch.compile`` calls see the defaults they expect. The only
other dynamo feature used, skipping guard evaluation inside the decode loop, is scoped to the
loop by :func:`skip_guard_checks`.
"""

import contextlib
import inspect
from typing import Callable, ContextManager, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# CUDA graphs replay on the decode step only; the prefill, run once per batch, goes without.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_NO_CUDAGRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}

# torch >= 2.7 can run only the guards that tell cache entries apart.
_HAS_SKIP_GUARD_EVAL = "skip_guard_eval_unsafe" in inspect.signature(
    torch.compiler.set_stance
).parameters


def maybe_compile(
    fn: F, *, enabled: bool, mode: str = "default", fullgraph: bool = True
) -> F:
    """``torch.compile(fn)`` with static shapes when ``enabled``, else ``fn`` itself (the eager twin)."""
    if not enabled:
        return fn
    kwargs = {"fullgraph": fullgraph, "dynamic": False}
    if mode != "default":
        kwargs["mode"] = mode
    return torch.compile(fn, **kwargs)


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
    if not (enabled and _HAS_SKIP_GUARD_EVAL and _current_stance() == "default"):
        return contextlib.nullcontext()
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)


def _current_stance() -> str:
    # torch has no public getter for the stance set by torch.compiler.set_stance.
    return getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles).

    torch 2.13 counts ``frames.total`` only for ``fullgraph=False`` compiles, so
    ``stats.unique_graphs`` is the count that sees every compiled region.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


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
