"""Dynamo internals (written for torch 2.13): the current compile stance and the graph counter.

torch has no public getter for the stance set by ``torch.compiler.set_stance``
(``torch._dynamo.eval_frame._stance``), nor a public count of compiled graphs
(``torch._dynamo.utils.counters``); ``tests`` check that both still exist.
"""

import torch

TESTED_WITH = "torch 2.13"


def current_stance() -> str:
    """The stance of ``torch.compiler.set_stance`` in force: ``"default"`` unless set."""
    return getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far.

    torch 2.13 counts ``frames.total`` only for ``fullgraph=False`` compiles, so
    ``stats.unique_graphs`` is the count that sees every compiled region.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
