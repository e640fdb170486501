"""Dynamo internals (written for torch 2.13): the compile stance, the graph counter, dynamic
dimensions, nested graph breaks, and skipping guard evaluation.

torch has no public getter for the stance set by ``torch.compiler.set_stance``
(``torch._dynamo.eval_frame._stance``), nor a public count of compiled graphs
(``torch._dynamo.utils.counters``); ``torch._dynamo.mark_dynamic`` lives in a private module;
``tests`` check that each still exists.
"""

import contextlib
import functools
import inspect
from typing import Any, Callable, ContextManager, Sequence, TypeVar

import torch

TESTED_WITH = "torch 2.13"

T = TypeVar("T")

# torch >= 2.7 can run only the guards that tell cache entries apart.
_HAS_SKIP_GUARD_EVAL = "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def current_stance() -> str:
    """The stance of ``torch.compiler.set_stance`` in force: ``"default"`` unless set."""
    return getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")


def fx_graph_cache_counts() -> "tuple[int, int]":
    """Inductor graphs of this process read from its FX graph cache, and compiled: (hits, misses)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far.

    torch 2.13 counts ``frames.total`` only for ``fullgraph=False`` compiles, so
    ``stats.unique_graphs`` is the count that sees every compiled region.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def mark_dynamic(packed: T, *, rows: Sequence[torch.Tensor], reads: Sequence[torch.Tensor],
                 length: bool = False) -> T:
    """Marks the sizes of a packed region's inputs dynamic: dim 0 (the rows ``R``) of each of
    ``rows`` and dim 1 (the chunk length ``K``) of each ``[C, K]`` tensor of ``reads``; with
    ``length`` also dim 1 of ``rows`` (the row length ``L``, for rows cut to what they hold).

    A region compiled with ``dynamic=False`` then traces one graph symbolic in exactly these
    sizes, and every later length mix reuses it. Both must be at least 2 (dynamo specialises
    sizes 0 and 1). Eager code ignores the marks. Returns ``packed``.
    """
    for t in rows:
        torch._dynamo.mark_dynamic(t, [0, 1] if length else 0)
    for t in reads:
        torch._dynamo.mark_dynamic(t, 1)
    return packed


def dynamic_dims(t: torch.Tensor) -> "frozenset[int]":
    """The dims of ``t`` marked dynamic (:func:`mark_dynamic`), empty for an unmarked tensor."""
    return frozenset(getattr(t, "_dynamo_dynamic_indices", ()))


def mark_dynamic_dims(t: torch.Tensor, dims: "frozenset[int]") -> torch.Tensor:
    """Marks ``dims`` of ``t`` dynamic (``torch._dynamo.mark_dynamic``). Returns ``t``."""
    torch._dynamo.mark_dynamic(t, sorted(dims))
    return t


def mark_layout_dynamic(layout: T) -> T:
    """Marks a :class:`~torchtune_ppo._patches.torchtune_modules.SegmentLayout`'s sizes dynamic:
    its sequences ``S`` (dim 0 of each), queries ``Lq`` and keys ``Lk``. Returns ``layout``."""
    q_index, kv_index, mask, _ = layout
    torch._dynamo.mark_dynamic(q_index, [0, 1])
    torch._dynamo.mark_dynamic(kv_index, [0, 1])
    torch._dynamo.mark_dynamic(mask, [0, 1, 2])
    return layout


def with_nested_graph_breaks(compiled: Callable) -> Callable:
    """``compiled`` (a ``torch.compile``'d function) called with dynamo's ``nested_graph_breaks``
    on, only for the call: a graph break inside a function the region calls (a trunk run by
    ``compile.layers``) resumes in that function, instead of bubbling up to the region and
    compiling every function between them as a frame of its own, whose guards would add a cache
    entry per use and per shape towards ``recompile_limit``."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(nested_graph_breaks=True):
            return compiled(*args, **kwargs)

    return call


def skip_guard_checks(enabled: bool) -> ContextManager:
    """Skips guard evaluation of already-compiled regions inside the ``with`` block.

    Safe only where nothing the guards cover changes: the decode loop after its first step
    (evaluating them costs ~0.2 ms a step on CPU). A no-op when ``enabled`` is False, on torch
    without the feature, and when the user set a stance of their own (e.g. ``force_eager``),
    which entering a new stance would override.
    """
    if not (enabled and _HAS_SKIP_GUARD_EVAL and current_stance() == "default"):
        return contextlib.nullcontext()
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
