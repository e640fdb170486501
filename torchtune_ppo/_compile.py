"""The one place that decides how hot regions are compiled.

Every compiled region of the recipe is a plain function wrapped by :func:`maybe_compile`,
and every dynamo/inductor setting the project relies on is made in
:func:`configure_dynamo`, each with its reason. Nothing here runs at import time.
"""

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_CONFIGURED = False


def configure_dynamo() -> None:
    """Dynamo settings for static-shape regions; called once before the first compile."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    # Shapes are static by construction (fixed prompt/response lengths, preallocated caches):
    # never let dynamo turn a size into a symbol after seeing a second batch size.
    torch._dynamo.config.automatic_dynamic_shapes = False
    # Scalars such as the temperature arrive as Python floats; keep them constants in the graph
    # rather than symbolic inputs (they never change during a run).
    torch._dynamo.config.specialize_float = True
    _CONFIGURED = True


def maybe_compile(
    fn: F, *, enabled: bool, mode: str = "default", fullgraph: bool = True
) -> F:
    """``torch.compile(fn)`` with static shapes when ``enabled``, else ``fn`` itself (the eager twin)."""
    if not enabled:
        return fn
    configure_dynamo()
    kwargs = {"fullgraph": fullgraph, "dynamic": False}
    if mode != "default":
        kwargs["mode"] = mode
    return torch.compile(fn, **kwargs)


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far (first compiles and recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class RecompileCounter:
    """Counts compilations after a warm-up mark: ``counter.mark()`` then ``counter.since_mark``."""

    def __init__(self) -> None:
        self._mark = None

    def mark(self) -> None:
        self._mark = compile_count()

    @property
    def since_mark(self) -> int:
        return 0 if self._mark is None else compile_count() - self._mark
