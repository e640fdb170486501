"""The optimizer the recipe builds: torch's fused kernel unless the config chooses."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ppo.run.optim import MasterWeights, build_optimizer, dithered_bf16, fused_by_default, rounding_salt


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


def test_dithered_rounding_keeps_bf16_values_and_moves_the_share_a_master_moved():
    """``dithered_bf16``: a master on the bf16 grid stays exact; masters moved a fraction ``d`` of
    a spacing (either sign, up or down) change in a share ``d`` of the weights, each to the
    neighbouring bf16 value, where round to nearest changes none below ``d = 1/2``; inf and nan
    stay."""
    w = torch.randn(20000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(dithered_bf16(w.float(), rounding_salt(3)), w)
    bits = w.view(torch.int16).to(torch.int32)
    for direction in (1, -1):  # one bf16 step away from zero, and towards it
        neighbour = (bits + direction).to(torch.int16).view(torch.bfloat16).float()
        for d in (0.1, 0.3, 0.45):
            moved = w.float() + d * (neighbour - w.float())
            out = dithered_bf16(moved, rounding_salt(3)).float()
            changed = out != w.float()
            assert torch.equal(out[changed], neighbour[changed])
            assert changed.float().mean().item() == pytest.approx(d, abs=0.02)
            assert torch.equal(moved.to(torch.bfloat16), w)  # nearest: nothing moved
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = dithered_bf16(special, 1)
    assert out[:2].isinf().all() and out[2].isnan() and (out[3:] == 0).all()
    # another salt, other thresholds: not the same weights change
    moved = w.float() * (1 + 2 ** -10)
    assert not torch.equal(dithered_bf16(moved, rounding_salt(0)), dithered_bf16(moved, rounding_salt(1)))


def test_dithered_masters_pass_updates_below_half_a_spacing_to_the_bf16_weights():
    """10 SGD steps of 1e-5 move each master 1e-4, under half the 2.4e-4 spacing at 0.05: to
    nearest, no bf16 weight changes; dithered, the bf16 weights' mean moves as the masters did."""
    moves = {}
    for rounding in ("nearest", "dither"):
        param = torch.nn.Parameter(torch.full((8192,), 0.05, dtype=torch.bfloat16))
        start = param.detach().float().clone()
        master = MasterWeights([param], rounding=rounding)
        _sgd_steps(param, 10, master)
        moves[rounding] = (start - param.detach().float()).mean().item()
        master_move = (start - master.masters[0]).mean().item()
    assert master_move == pytest.approx(1e-4, rel=1e-3)
    assert moves["nearest"] == 0.0
    assert moves["dither"] == pytest.approx(master_move, rel=0.1)
    with pytest.raises(ValueError, match="master_rounding must be one of"):
        MasterWeights([param], rounding="stochastic")


@pytest.mark.parametrize("rounding", ["nearest", "dither"])
def test_master_weights_restore_exactly_and_refuse_other_shapes(rounding):
    param = torch.nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
    master = MasterWeights([param], rounding=rounding)
    _sgd_steps(param, 7, master, lr=1e-3)
    state = copy.deepcopy(master.state_dict())
    fresh_param = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16))
    fresh = MasterWeights([fresh_param], rounding=rounding)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.masters[0], master.masters[0]) and torch.equal(fresh_param, param)
    with pytest.raises(ValueError, match="fp32 master weights"):
        MasterWeights([torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16))]).load_state_dict(state)


# ----- one pass a parameter: adam_master_step (compile.optimizer) -----

def _bf16_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (1, 5), (33,)]  # matrices, norms, a value head, an odd length
    return [torch.nn.Parameter((0.1 * torch.randn(s, generator=g)).to(torch.bfloat16)) for s in shapes]


def _grads(params, step: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        # the second parameter gets no gradient at step 2: skipped, its state not counted
        p.grad = None if (i == 1 and step == 2) else (scale * torch.randn(p.shape, generator=g)).to(torch.bfloat16)


def _run(params, master, optimizer, fused: bool, *, max_norm: float, steps: int, lrs):
    norms = []
    for step in range(1, steps + 1):
        _grads(params, step, scale=3.0 if step == 1 else 0.01)  # step 1 clipped, later ones not
        for group in optimizer.param_groups:
            group["lr"] = lrs[step - 1]  # a schedule, set as a scheduler sets it
        if fused:
            norm = master.grad_norm()
            master.fused_step(optimizer, norm, max_norm)
        else:
            master.take_grads()
            norm = torch.nn.utils.clip_grad_norm_(master.masters, max_norm=max_norm)
            optimizer.step()
            master.write_back()
        optimizer.zero_grad(set_to_none=True)
        master.zero_grad()
        norms.append(float(norm))
    return norms


@pytest.mark.parametrize("kind,weight_decay,rounding", [("AdamW", 0.01, "nearest"), ("AdamW", 0.0, "nearest"),
                                                    ("Adam", 0.01, "nearest"), ("AdamW", 0.01, "dither")])
@pytest.mark.parametrize("compiled", [False, True])
def test_one_pass_master_step_equals_clip_then_torch_adam_then_rounding(kind, weight_decay, rounding, compiled):
    """The fused step (eager, and compiled by inductor with symbolic sizes as compile.optimizer
    compiles it) against the four passes: clip_grad_norm_ over fp32 gradients, torch's Adam/AdamW,
    rounding into bf16. The same fp32 arithmetic in another order: masters and moments within
    1e-6 relative (a wrong bias correction, clip or decay moves them by 1e-3 or more), every
    bf16 weight equal or one rounding step apart."""
    from torchtune_ppo.compile import maybe_compile
    from torchtune_ppo.run.optim import adam_master_step

    lrs = [1e-3, 5e-4, 2e-4, 1e-4]
    step_fn = maybe_compile(adam_master_step, enabled=compiled, dynamic=True)
    results = []
    for fused in (False, True):
        params = _bf16_params()
        master = MasterWeights(params, step_fn if fused else None, rounding=rounding)
        optimizer = getattr(torch.optim, kind)(master.masters, lr=lrs[0], betas=(0.9, 0.95), eps=1e-8,
                                               weight_decay=weight_decay)
        assert master.fuses(optimizer) == fused
        norms = _run(params, master, optimizer, fused, max_norm=1.0, steps=4, lrs=lrs)
        results.append((params, master, optimizer, norms))
    (p_ref, m_ref, o_ref, n_ref), (p_new, m_new, o_new, n_new) = results
    assert n_new == pytest.approx(n_ref, rel=1e-6) and n_ref[0] > 1.0 > n_ref[1]  # step 1 was clipped
    for a, b in zip(m_ref.masters, m_new.masters):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)
    for a, b in zip(o_ref.state.values(), o_new.state.values()):
        assert float(a["step"]) == float(b["step"]) and b["step"].dtype == torch.float32
        # atol: 1e-6 of the moments' scale (~1e-3, ~1e-5), where Adam's decay cancels a gradient
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], rtol=1e-6, atol=1e-11)
    assert [float(s["step"]) for s in o_new.state.values()] == [4.0, 3.0, 4.0, 4.0]
    for a, b in zip(p_ref, p_new):
        assert b.dtype == torch.bfloat16
        # a master within rounding of a bf16 midpoint may round either way: at most one spacing
        spacing = torch.finfo(torch.bfloat16).eps * a.float().abs().clamp(min=1e-30)
        assert ((a.float() - b.float()).abs() <= spacing).all()
    # each path's bf16 weights are its own masters rounded as asked, bit for bit
    for params, master in ((p_ref, m_ref), (p_new, m_new)):
        for i, (p, m) in enumerate(zip(params, master.masters)):
            want = m.to(torch.bfloat16) if rounding == "nearest" else dithered_bf16(m, rounding_salt(i))
            assert torch.equal(p.detach(), want), (rounding, i)
    # the state is torch's layout: the fused run's optimizer state loads into the four-pass path
    o_ref.load_state_dict(copy.deepcopy(o_new.state_dict()))


def test_a_wrong_bias_correction_would_be_caught():
    """The tolerance above can fail: a fused step without Adam's bias correction (a plausible
    slip) moves a master far more than 1e-6 relative after one step."""
    from torchtune_ppo.run.optim import adam_master_step

    params = _bf16_params()
    master = MasterWeights(params, adam_master_step)
    optimizer = torch.optim.AdamW(master.masters, lr=1e-3, weight_decay=0.0)
    start = [m.clone() for m in master.masters]
    _grads(params, 1, scale=0.01)
    master.fused_step(optimizer, master.grad_norm(), float("inf"))
    # Adam's first step moves each weight by lr * sign(g) (bias-corrected); without the
    # correction it would move by lr * (1 - beta1) / sqrt(1 - beta2) = 3.2 lr
    moved = (master.masters[0] - start[0]).abs() / 1e-3
    torch.testing.assert_close(moved, torch.ones_like(moved), rtol=1e-2, atol=1e-2)  # eps: |g| >> 1e-8


@pytest.mark.parametrize("settings,why", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(maximize=True), "maximize"),
])
def test_optimizers_the_one_pass_step_cannot_take_keep_the_four_passes(settings, why):
    from torchtune_ppo.run.optim import adam_master_step, fusable

    params = _bf16_params()
    master = MasterWeights(params, adam_master_step)
    optimizer = torch.optim.AdamW(master.masters, lr=1e-3, **settings)
    assert why in fusable(optimizer) and not master.fuses(optimizer)
    assert "not torch.optim.Adam or AdamW" in fusable(torch.optim.SGD(master.masters, lr=1e-3))
