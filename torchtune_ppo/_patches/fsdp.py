"""FSDP2 internals (written for torch 2.13): setting a module's forward hooks aside.

``torch.distributed.fsdp.FSDPModule`` has no public way to run a gathered module without its
forward hooks, which are ``dynamo.disable``d (a graph break in every ``fullgraph=True`` region).
This reads ``module._get_fsdp_state()`` and the ``nn.Module`` hook dicts ``_forward_pre_hooks``
and ``_forward_hooks``; ``tests`` check that all three still exist.
"""

from typing import Callable

import torch
from torch.distributed.fsdp import FSDPModule

TESTED_WITH = "torch 2.13"


def set_aside_forward_hooks(module: FSDPModule) -> Callable[[], None]:
    """Removes FSDP2's forward pre- and post-hook of ``module``; returns what puts them back
    where they were (FSDP2 puts its pre-hook first)."""
    state = module._get_fsdp_state()
    put_back = []
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        order = list(hooks)
        ours = {k: h for k, h in hooks.items() if getattr(h, "__self__", None) is state}
        if not ours:
            raise RuntimeError(f"FSDP2's forward hooks were not found on {type(module).__name__} "
                               f"(torch {torch.__version__}); generation and scoring need them "
                               "set aside while the parameters are gathered.")
        for k in ours:
            del hooks[k]
        put_back.append((hooks, order, ours))

    def restore() -> None:
        for hooks, order, ours in put_back:
            hooks.update(ours)
            for k in order:
                if k in hooks:
                    hooks.move_to_end(k)

    return restore
