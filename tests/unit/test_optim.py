"""The optimizer the recipe builds: torch's fused kernel unless the config chooses."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ppo.run.optim import build_optimizer, fused_by_default


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (5,), (3, 4, 2)]]


def _cfg(**kw):
    return OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.01, **kw})


def test_fused_when_the_config_does_not_choose():
    opt = build_optimizer(_cfg(), _params())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] is True


@pytest.mark.parametrize("kw", [{"fused": False}, {"foreach": True}, {"foreach": False}])
def test_the_configs_choice_wins(kw):
    opt = build_optimizer(_cfg(**kw), _params())
    assert not opt.defaults["fused"]
    for key, value in kw.items():
        assert opt.defaults[key] is value


def test_other_optimizers_are_built_as_configured():
    cfg = OmegaConf.create({"_component_": "torch.optim.RMSprop", "lr": 1e-3})
    assert not fused_by_default(cfg, _params())
    assert isinstance(build_optimizer(cfg, _params()), torch.optim.RMSprop)


def test_integer_or_meta_parameters_are_not_fused():
    assert not fused_by_default(_cfg(), [torch.nn.Parameter(torch.zeros(3, device="meta"))])
    assert not fused_by_default(_cfg(), [torch.zeros(3, dtype=torch.long)])


def test_fused_steps_equal_the_configured_loop():
    """Five AdamW steps with the fused kernel and with torch's per-parameter loop agree."""
    fused_params, loop_params = _params(), copy.deepcopy(_params())
    fused = build_optimizer(_cfg(), fused_params)
    loop = build_optimizer(_cfg(foreach=False), loop_params)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(fused_params, loop_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        loop.step()
    for a, b, start in zip(fused_params, loop_params, _params()):
        assert (a - start).abs().min() > 1e-4  # every entry moved
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
