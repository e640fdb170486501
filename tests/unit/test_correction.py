"""The rollout/training mismatch metrics against numbers worked by hand."""

import math

import pytest
import torch

from torchtune_ppo.rlhf.correction import MismatchStats, correction_weights, mismatch_metrics, mismatch_stats


def test_mismatch_stats_by_hand():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, 9.0]])
    train = torch.tensor([[-1.1, -1.8, -0.5], [-0.7, -3.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])  # the 9.0 and -3.0 never count
    m = mismatch_stats(train, rollout, valid).metrics()
    d = [-0.1, 0.2, 0.0, 0.3]
    assert m["rollout_corr/abs_diff_mean"] == pytest.approx(sum(map(abs, d)) / 4)
    assert m["rollout_corr/abs_diff_max"] == pytest.approx(0.3)
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx(sum(d) / 4)
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 4)


def test_equal_logprobs_give_zero_and_no_step_gives_nan():
    x = torch.randn(2, 5)
    m = mismatch_stats(x, x.clone(), torch.ones(2, 5, dtype=torch.bool)).metrics()
    assert all(v == 0.0 for v in m.values())
    none = mismatch_metrics(None)
    assert set(none) == set(MismatchStats.keys()) == set(m) and all(math.isnan(v) for v in none.values())


def test_stats_of_two_halves_add_up_to_the_whole():
    """What the update does over micro-steps and ranks: sums add, maxima take the max."""
    torch.manual_seed(0)
    train, rollout = torch.randn(4, 6), torch.randn(4, 6)
    valid = torch.rand(4, 6) > 0.3
    whole = mismatch_stats(train, rollout, valid)
    a, b = mismatch_stats(train[:2], rollout[:2], valid[:2]), mismatch_stats(train[2:], rollout[2:], valid[2:])
    joined = MismatchStats(a.sums + b.sums, torch.maximum(a.max_abs, b.max_abs))
    for key, value in whole.metrics().items():
        assert joined.metrics()[key] == pytest.approx(value), key



def _nearly_equal(n=4000):
    """float32 logprobs of a rollout and a trainer that nearly agree: |d| log-uniform in
    [1e-7, 1e-4]; ``d`` as float32 holds it (the difference of two close float32 is exact)."""
    g = torch.Generator().manual_seed(0)
    rollout = -3 * torch.rand(n, generator=g)
    size = 10 ** (-7 + 3 * torch.rand(n, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    train = (rollout.double() + sign * size).float()
    return train, rollout, train.double() - rollout.double()


def test_k3_of_nearly_equal_logprobs_is_not_negative_in_float32():
    """exp(d) - d - 1 rounds exp(d) to within 6e-8 of 1 and cancels to a negative mean here;
    the value is ~d**2 / 2 >= 0."""
    train, rollout, d = _nearly_equal()
    k3 = mismatch_stats(train, rollout, torch.ones_like(train, dtype=torch.bool)).metrics()["rollout_corr/kl_k3"]
    expected = float((torch.expm1(d) - d).mean())  # float64
    assert k3 >= 0
    assert k3 == pytest.approx(expected, rel=1e-2)


@pytest.mark.parametrize("estimator", ["k3", "k3+"])
def test_k3_kl_to_the_reference_is_not_negative_near_it_in_float32(estimator):
    from torchtune_ppo.rlhf.kl import kl_estimate, kl_loss_estimate

    train, rollout, d = _nearly_equal()
    expected = torch.expm1(-d) + d  # k3 of ref - logp = -d, float64
    for kl in (kl_loss_estimate(train, rollout, estimator),
               *([kl_estimate(train, rollout, "k3")] if estimator == "k3" else [])):
        assert (kl >= 0).all()
        assert float(kl.double().mean()) == pytest.approx(float(expected.mean()), rel=1e-2)
        # each within float32's rounding of expm1(x) ~ x, a few 1e-8 of |d|
        assert ((kl.double() - expected).abs() <= 2e-7 * d.abs()).all()

# --- TIS / MIS ----------------------------------------------------------------------------------

LOG2 = math.log(2.0)
ROLLOUT = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
# ratios pi_old / mu: row 0 e^1, 1, e^-1; row 1 e^0.5, e^0.5, (invalid)
TRAIN = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 5.0]])
VALID = torch.tensor([[True, True, True], [True, True, False]])


def test_token_tis_truncates_each_ratio_at_c():
    w = correction_weights(TRAIN, ROLLOUT, VALID, mode="tis", level="token", threshold=2.0)
    e = math.exp
    expected = torch.tensor([[2.0, 1.0, e(-1)], [e(0.5), e(0.5), 0.0]])
    torch.testing.assert_close(w.weights, expected)
    assert (w.hits, w.units, w.tokens) == (1, 5, 5)  # only e^1 > 2 was truncated
    assert float(w.weight_sum) == pytest.approx(float(expected.sum()))


def test_token_mis_masks_ratios_outside_one_over_c_to_c():
    w = correction_weights(TRAIN, ROLLOUT, VALID, mode="mis", level="token", threshold=2.0)
    # e^1 > 2 and e^-1 < 1/2 are masked; e^0.5 = 1.65 and 1 are kept
    torch.testing.assert_close(w.weights, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    assert (w.hits, w.units) == (2, 5)


def test_sequence_level_uses_the_product_of_a_rows_ratios():
    # row 0: e^(1 + 0 - 1) = 1; row 1: e^(0.5 + 0.5) = e > 2
    tis = correction_weights(TRAIN, ROLLOUT, VALID, mode="tis", level="sequence", threshold=2.0)
    torch.testing.assert_close(tis.weights, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert (tis.hits, tis.units) == (1, 2)
    mis = correction_weights(TRAIN, ROLLOUT, VALID, mode="mis", level="sequence", threshold=2.0)
    torch.testing.assert_close(mis.weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_bad_settings_are_refused():
    for kw in (dict(mode="is"), dict(mode="tis", level="row"), dict(mode="mis", threshold=1.0)):
        with pytest.raises(ValueError, match="rollout_correction"):
            correction_weights(TRAIN, ROLLOUT, VALID, **kw)


def test_the_weights_scale_each_tokens_policy_loss_as_the_formula_says():
    """Advantages times w: the clipped PPO token loss becomes w times itself (w >= 0), the value
    loss stays; estimate_advantages applies exactly that product."""
    from torchtune_ppo.ppo.advantages import AdvantageSettings, estimate_advantages, uncorrected_advantages
    from torchtune_ppo.rlhf import Trajectory, masks_and_positions, ppo_token_losses

    b, t = VALID.shape
    masks, positions = masks_and_positions(torch.full((b,), 2), 2, t)
    traj = Trajectory(torch.zeros(b, 2 + t, dtype=torch.long), TRAIN * VALID, TRAIN * VALID, torch.zeros(b, t),
                      masks, positions, ~VALID, torch.tensor([1.0, -1.0]), VALID.sum(-1),
                      rollout_logprobs=ROLLOUT * VALID)
    corr = {"mode": "tis", "level": "token", "threshold": 2.0}
    plain = uncorrected_advantages(traj, AdvantageSettings(), 0.1)
    adv = estimate_advantages(traj, AdvantageSettings(rollout_correction=corr), 0.1)
    w = correction_weights(traj.logprobs, traj.rollout_logprobs, VALID, **corr).weights
    torch.testing.assert_close(adv.advantages, plain.advantages * w)
    assert not torch.allclose(adv.advantages, plain.advantages)  # not vacuous
    new = traj.logprobs + 0.3
    kw = dict(epsilon=0.2, value_clip_range=0.2)
    base = ppo_token_losses(traj.logprobs, new, plain.advantages, traj.values, traj.values, plain.returns, **kw)
    weighted = ppo_token_losses(traj.logprobs, new, adv.advantages, traj.values, traj.values, adv.returns, **kw)
    torch.testing.assert_close(weighted.policy_losses, base.policy_losses * w)
    torch.testing.assert_close(weighted.value_losses, base.value_losses)
    # the trainer's against the rollout's logprobs over every valid token
    assert adv.mismatch.metrics()["rollout_corr/abs_diff_max"] == pytest.approx(1.0)
    # off: the same advantages as with no correction at all
    off = estimate_advantages(traj, AdvantageSettings(rollout_correction={**corr, "mode": None}), 0.1)
    assert torch.equal(off.advantages, plain.advantages) and off.correction is None
