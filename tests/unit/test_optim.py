"""The optimizer the recipe builds: torch's fused kernel unless the config chooses."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ppo.run.optim import MasterWeights, build_optimizer, fused_by_default


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


# --- bf16 with fp32 master weights ---------------------------------------------------------------


def _sgd_steps(param, steps, master=None, lr=1e-5):
    """``steps`` SGD steps of a constant gradient 1 on ``param`` (bf16), with or without masters."""
    opt = torch.optim.SGD(master.masters if master else [param], lr=lr)
    for _ in range(steps):
        param.grad = torch.ones_like(param)
        if master is not None:
            master.take_grads()
            assert param.grad is None and master.masters[0].grad.dtype == torch.float32
        opt.step()
        if master is not None:
            master.write_back()
        opt.zero_grad(set_to_none=True)


def test_plain_bf16_updates_below_half_a_spacing_round_to_nothing():
    # 0.05 sits in [2^-5, 2^-4): bf16 spacing 2^-12 = 2.4e-4, so a step of 1e-5 is lost every time
    param = torch.nn.Parameter(torch.full((4,), 0.05, dtype=torch.bfloat16))
    start = param.detach().clone()
    _sgd_steps(param, 30)
    assert torch.equal(param.detach(), start)


def test_master_weights_accumulate_small_updates_and_round_them_into_the_bf16_weights():
    param = torch.nn.Parameter(torch.full((4,), 0.05, dtype=torch.bfloat16))
    master = MasterWeights([param])
    start = master.masters[0].clone()  # bf16(0.05) in fp32
    _sgd_steps(param, 30, master)
    expected = start.clone()
    for _ in range(30):  # the same fp32 arithmetic SGD does
        expected -= 1e-5
    assert torch.equal(master.masters[0], expected)
    assert master.masters[0].dtype == torch.float32
    # 30 steps of 1e-5 = 3e-4, more than half a spacing: the bf16 weight moved, to the rounded master
    assert torch.equal(param.detach(), expected.to(torch.bfloat16))
    assert not torch.equal(param.detach(), start.to(torch.bfloat16))


def test_master_weights_restore_exactly_and_refuse_other_shapes():
    param = torch.nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
    master = MasterWeights([param])
    _sgd_steps(param, 7, master, lr=1e-3)
    state = copy.deepcopy(master.state_dict())
    fresh_param = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16))
    fresh = MasterWeights([fresh_param])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.masters[0], master.masters[0]) and torch.equal(fresh_param, param)
    with pytest.raises(ValueError, match="fp32 master weights"):
        MasterWeights([torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16))]).load_state_dict(state)
