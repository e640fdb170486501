"""The rollout/training mismatch metrics against numbers worked by hand."""

import math

import pytest
import torch

from torchtune_ppo.rlhf.correction import MismatchStats, mismatch_metrics, mismatch_stats


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
