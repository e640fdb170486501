"""Optimizer steps fused into backward (``optimizer_in_bwd``), for the policy and value model.

One optimizer per parameter, stepped by a post-accumulate-grad hook the moment its gradient
is ready, then its gradient freed: a full set of gradients never exists at once (how
torchtune fits a 7B policy and value model on one GPU). torchtune's hooks and its checkpoint
wrapper do the work; this class gives the recipe one object with an optimizer's surface.
"""

from typing import Any, Dict, Mapping

import torch
from omegaconf import DictConfig
from torchtune import config, training


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
