"""The loss and KL options on small tensors, against numbers worked by hand."""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.config import validate_config
from torchtune_ppo import rlhf
from torchtune_ppo.ppo.update import LossSettings

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"

# ratios r = exp(logp - old) and advantages A of five tokens
RATIOS = torch.tensor([0.5, 0.9, 1.1, 1.5, 4.0], dtype=torch.float64)
ADV = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)


def _cfg(**overrides):
    cfg = OmegaConf.load(CONFIG)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def _policy(**kw):
    zeros = torch.zeros_like(RATIOS)
    return rlhf.ppo_token_losses(zeros, RATIOS.log(), ADV, zeros, zeros, zeros,
                                 epsilon=0.2, value_clip_range=0.2, **kw)


def test_symmetric_clip_is_the_default():
    tl = _policy()
    # max(-A r, -A clip(r, 0.8, 1.2)): 0.5 -> 0.8 (low side), 1.5 -> 1.2 (high side)
    torch.testing.assert_close(tl.policy_losses, torch.tensor([0.8, 0.9, -1.1, -1.2, 4.0], dtype=torch.float64))
    assert tl.clipped.tolist() == [1, 0, 0, 1, 0]
    assert tl.clipped_low.tolist() == [1, 0, 0, 0, 0]
    assert tl.clipped_high.tolist() == [0, 0, 0, 1, 0]
    assert tl.dual_clipped.tolist() == [0, 0, 0, 0, 0]


def test_clip_higher_and_dual_clip():
    tl = _policy(epsilon_low=0.3, epsilon_high=0.28, dual_clip=3.0)
    # r=0.5, A<0: max(0.5, 0.7) = 0.7; r=1.5, A>0: max(-1.5, -1.28) = -1.28;
    # r=4, A<0: max(4, 1.28) = 4, bounded by -3 A = 3
    torch.testing.assert_close(tl.policy_losses, torch.tensor([0.7, 0.9, -1.1, -1.28, 3.0], dtype=torch.float64))
    assert tl.clipped.tolist() == [1, 0, 0, 1, 0]
    assert tl.clipped_low.tolist() == [1, 0, 0, 0, 0]
    assert tl.clipped_high.tolist() == [0, 0, 0, 1, 0]
    assert tl.dual_clipped.tolist() == [0, 0, 0, 0, 1]


def test_dual_clip_leaves_positive_advantages_alone():
    zeros = torch.zeros(2, dtype=torch.float64)
    tl = rlhf.ppo_token_losses(zeros, torch.tensor([5.0, 5.0]).double().log(), torch.tensor([2.0, -0.5]).double(),
                               zeros, zeros, zeros, epsilon=0.2, value_clip_range=0.2, dual_clip=2.0)
    # A=2: max(-10, -2.4) = -2.4 (clipped high); A=-0.5: max(2.5, 0.6) = 2.5, bounded by 1.0
    torch.testing.assert_close(tl.policy_losses, torch.tensor([-2.4, 1.0], dtype=torch.float64))
    assert tl.dual_clipped.tolist() == [0, 1]


def test_loss_settings_from_config_and_torchtune_block():
    cfg = validate_config(_cfg(**{"loss.epsilon_low": 0.2, "loss.epsilon_high": 0.28, "loss.dual_clip": 3}))
    s = LossSettings.from_config(cfg.loss)
    assert (s.epsilon_low, s.epsilon_high, s.dual_clip) == (0.2, 0.28, 3.0)
    assert LossSettings.from_config(validate_config(_cfg()).loss)[3:6] == (None, None, None)

    class PPOLoss:  # torchtune's: only the three scalars
        epsilon, value_clip_range, value_coeff = 0.1, 0.2, 0.1

    assert LossSettings.from_config(PPOLoss()) == LossSettings(0.1, 0.2, 0.1)


@pytest.mark.parametrize("key,value,message", [
    ("loss.epsilon_low", 0, r"loss.epsilon_low must be null or a number in \(0, 1\], got 0"),
    ("loss.epsilon_low", 1.5, r"loss.epsilon_low must be null or a number in \(0, 1\], got 1.5"),
    ("loss.epsilon_high", -0.1, r"loss.epsilon_high must be null or a number > 0, got -0.1"),
    ("loss.dual_clip", 1, r"loss.dual_clip must be null or a number > 1, got 1"),
])
def test_bad_loss_options_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**{key: value}))


# ---- loss.aggregation: the token weights packing computes ---------------------------------

from types import SimpleNamespace  # noqa: E402

from torchtune_ppo.rlhf import packing  # noqa: E402

AP, AT = 2, 3  # prompt and response length of the aggregation batch


def _batch(valid_counts):
    """A fake trajectory: 2-token prompts, ``valid_counts[i]`` valid response tokens in row i, and
    advantages ``10 i + t + 1`` that name each token."""
    b = len(valid_counts)
    valid = torch.arange(AT)[None, :] < torch.tensor(valid_counts)[:, None]
    traj = SimpleNamespace(
        query_responses=torch.arange(b * (AP + AT)).view(b, AP + AT) % 7 + 1,
        response_padding_masks=~valid, logprobs=torch.zeros(b, AT), values=torch.zeros(b, AT),
        ref_logprobs=torch.zeros(b, AT),
    )
    advantages = (10 * torch.arange(b)[:, None] + torch.arange(AT)[None, :] + 1.0) * valid
    lengths = packing.SequenceLengths([AP] * b, list(valid_counts), list(valid_counts))
    return traj, advantages, lengths


def _token_weights(valid_counts, micro_batches, **kw):
    """``{advantage (names the token): weight}`` of the packed minibatch, and its weighted sum."""
    traj, adv, lengths = _batch(valid_counts)
    steps = packing.pack_minibatch(traj, adv, adv, micro_batches, lengths, prompt_len=AP, rows=2, **kw)
    pairs = {}
    for s in steps:
        for a, w in zip(s.advantages.flatten().tolist(), s.weights.flatten().tolist()):
            if w:
                pairs[a] = w
    return pairs, sum(a * w for a, w in pairs.items())


@pytest.mark.parametrize("aggregation,weights,loss", [
    # micro-batches [rows 0, 1] (4 tokens), [row 2] (2 tokens): (4.25 + 21.5) / 2
    ("token-mean", [1 / 8] * 3 + [1 / 8] + [1 / 4] * 2, 12.875),
    # sequence means 2, 11, 21.5, averaged
    ("seq-mean-token-mean", [1 / 9] * 3 + [1 / 3] + [1 / 6] * 2, 11.5),
    # sequence sums 6, 11, 43, averaged
    ("seq-mean-token-sum", [1 / 3] * 6, 20.0),
    # sequence sums over T = 3, averaged
    ("seq-mean-token-sum-norm", [1 / 9] * 6, 60 / 9),
])
def test_aggregation_weights_by_hand(aggregation, weights, loss):
    pairs, total = _token_weights([3, 1, 2], [[0, 1], [2]], aggregation=aggregation)
    assert sorted(pairs) == [1, 2, 3, 11, 21, 22]
    assert [pairs[a] for a in sorted(pairs)] == pytest.approx(weights, rel=1e-6)
    assert total == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("aggregation", rlhf.AGGREGATIONS)
def test_two_ranks_weights_are_the_one_rank_weights(aggregation):
    """Ranks take the global totals (as PPOUpdate all-reduces them): the union of two ranks'
    token weights is one process's for the same global micro-batches."""
    counts = [3, 1, 2, 2, 3, 1, 1, 2]
    one, _ = _token_weights(counts, [[0, 1, 4, 5], [2, 3, 6, 7]], aggregation=aggregation)
    totals = [sum(counts[i] for i in g) for g in ([0, 1, 4, 5], [2, 3, 6, 7])]
    union = {}
    for rank_rows in ([[0, 1], [2, 3]], [[4, 5], [6, 7]]):
        pairs, _ = _token_weights(counts, rank_rows, aggregation=aggregation,
                                  valid_totals=totals, num_sequences=len(counts))
        assert not union.keys() & pairs.keys()
        union.update(pairs)
    assert union.keys() == one.keys()
    assert [union[a] for a in sorted(one)] == pytest.approx([one[a] for a in sorted(one)], rel=1e-7)


def test_stats_keep_token_mean_weights():
    traj, adv, lengths = _batch([3, 1, 2])
    (step,) = packing.pack_minibatch(traj, adv, adv, [[0, 1], [2]], lengths, prompt_len=AP, rows=3,
                                     aggregation="seq-mean-token-sum")
    w = dict(zip(step.advantages.flatten().tolist(), step.stat_weights.flatten().tolist()))
    assert [w[a] for a in (1, 2, 3, 11, 21, 22)] == pytest.approx([1 / 8] * 4 + [1 / 4] * 2)


def test_unknown_aggregation_names_the_key():
    with pytest.raises(ValueError, match=r"loss.aggregation must be one of \['token-mean'.*got 'sum'"):
        validate_config(_cfg(**{"loss.aggregation": "sum"}))


# ---- KL estimators and the adaptive KL controller ------------------------------------------

from torchtune_ppo.ppo.kl import KLController
from torchtune_ppo.rlhf.kl import kl_estimate  # noqa: E402

LOGP = torch.tensor([[-1.0, -2.0, -0.3]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0, -0.3]], dtype=torch.float64)  # d = logp - ref = 0.5, -1, 0


@pytest.mark.parametrize("estimator,expected", [
    ("k1", [0.5, -1.0, 0.0]),
    ("k2", [0.125, 0.5, 0.0]),
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]),  # exp(-d) + d - 1
])
def test_kl_estimators_by_hand(estimator, expected):
    torch.testing.assert_close(kl_estimate(LOGP, REF, estimator)[0], torch.tensor(expected, dtype=torch.float64))


def test_rewards_use_the_estimator():
    masks = torch.tensor([[True, True, False]])
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(torch.tensor([2.0], dtype=torch.float64), LOGP, REF, 0.1,
                                                   torch.tensor([2]), masks, kl_estimator="k3")
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]
    torch.testing.assert_close(kl[0], torch.tensor(k3, dtype=torch.float64))
    # -0.1 * kl everywhere valid, the score on the last valid token
    torch.testing.assert_close(rewards[0], torch.tensor([-0.1 * k3[0], 2.0 - 0.1 * k3[1], 0.0], dtype=torch.float64))
    assert rlhf.get_rewards_ppo(torch.tensor([2.0]).double(), LOGP, REF, 0.1, torch.tensor([2]), masks)[1][0].tolist() \
        == [0.5, -1.0, 0.0]  # k1 by default


def test_adaptive_kl_controller_by_hand():
    c = KLController(0.1, target=6.0, horizon=100)
    # error clip(kl / 6 - 1, -0.2, 0.2), times n / horizon = 10 / 100
    assert c.update(9.0, n=10) == pytest.approx(0.1 * 1.02)          # error 0.5 -> 0.2
    assert c.update(6.6, n=10) == pytest.approx(0.1 * 1.02 * 1.01)   # error 0.1
    assert c.update(3.0, n=10) == pytest.approx(0.1 * 1.02 * 1.01 * 0.98)  # -0.5 -> -0.2
    assert c.update(float("nan"), n=10) == pytest.approx(0.1 * 1.02 * 1.01 * 0.98)
    resumed = KLController(0.1, target=6.0, horizon=100)
    resumed.load_state_dict(c.state_dict())
    assert resumed.value == c.value
    assert resumed.update(12.0, n=10) == c.update(12.0, n=10) == pytest.approx(0.1 * 1.02 * 1.01 * 0.98 * 1.02)


def test_fixed_kl_coefficient_without_target():
    c = KLController(0.05)
    assert [c.update(kl, n=32) for kl in (0.0, 100.0, -5.0)] == [0.05] * 3


@pytest.mark.parametrize("key,value,message", [
    ("kl_estimator", "k4", r"kl_estimator must be one of \['k1', 'k2', 'k3'\], got 'k4'"),
    ("kl_target", 0, r"kl_target must be null or a number > 0, got 0"),
    ("kl_horizon", -1, r"kl_horizon must be a number > 0, got -1"),
])
def test_bad_kl_options_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**{key: value}))


# ---- entropy bonus and the KL loss term ----------------------------------------------------

from torchtune_ppo.rlhf.kl import kl_loss_estimate  # noqa: E402


def test_entropy_by_hand():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
    # uniform over 4: ln 4; (1/2, 1/4, 1/4, 0): 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2 (0 log 0 = 0)
    logprobs = torch.log(probs.clamp(min=1e-300))
    torch.testing.assert_close(rlhf.entropy_from_logprobs(logprobs),
                               torch.tensor([math.log(4), 1.5 * math.log(2)], dtype=torch.float64))


def test_chunked_entropy_is_the_full_softmax_entropy_and_its_gradient():
    """Reads in 2 chunks of 3 from 5 hidden states: each read's entropy is the one of the full
    softmax at that state (over temperature), and with ``entropy_grad`` its gradient too."""
    g = torch.Generator().manual_seed(0)
    output = torch.nn.Linear(4, 7, bias=False)
    hidden = torch.randn(5, 4, generator=g, requires_grad=True)
    reads = torch.tensor([[4, 0, 2], [1, 1, 3]])
    targets = torch.tensor([[6, 0, 3], [2, 5, 1]])
    logprobs, entropy = rlhf.read_logprobs_and_entropy(output, hidden, reads, targets, 0.7, entropy_grad=True)
    full = torch.log_softmax(output(hidden) / 0.7, -1)  # [5, 7]
    want = -(full.exp() * full).sum(-1)[reads]
    torch.testing.assert_close(entropy, want)
    torch.testing.assert_close(logprobs, full[reads.flatten(), targets.flatten()].view(2, 3))
    (got_grad,) = torch.autograd.grad(entropy.sum(), hidden)
    (want_grad,) = torch.autograd.grad(want.sum(), hidden)
    torch.testing.assert_close(got_grad, want_grad)
    # detached by default: the logprobs alone carry the gradient
    _, entropy = rlhf.read_logprobs_and_entropy(output, hidden, reads, targets, 0.7)
    assert not entropy.requires_grad


D = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)  # d = logp - ref


@pytest.mark.parametrize("estimator,value,grad", [
    ("k1", [0.5, -1.0, 0.0], [1.0, 1.0, 1.0]),
    ("k2", [0.125, 0.5, 0.0], [0.5, -1.0, 0.0]),  # d
    # exp(-d) + d - 1, gradient 1 - exp(-d)
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0], [1 - math.exp(-0.5), 1 - math.e, 0.0]),
    # straight-through: k1's or k3's value, k2's gradient d
    ("k1+", [0.5, -1.0, 0.0], [0.5, -1.0, 0.0]),
    ("k3+", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0], [0.5, -1.0, 0.0]),
])
def test_kl_loss_estimators_values_and_gradients_by_hand(estimator, value, grad):
    ref = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64)
    logp = (ref + D).requires_grad_(True)
    kl = kl_loss_estimate(logp, ref, estimator)
    torch.testing.assert_close(kl.detach(), torch.tensor(value, dtype=torch.float64))
    (g,) = torch.autograd.grad(kl.sum(), logp)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64))


def test_k3_in_the_loss_is_bounded_far_from_the_reference():
    """d = -30: exp(-d) would be 1e13; the log-ratio is clamped to 20 and the value to 10, with
    no gradient through the clamp (k3+ keeps k2's gradient d)."""
    ref = torch.tensor([0.0, 0.0], dtype=torch.float64)
    logp = torch.tensor([-30.0, -200.0], dtype=torch.float64, requires_grad=True)
    for estimator, grad in (("k3", [0.0, 0.0]), ("k3+", [-30.0, -200.0])):
        kl = kl_loss_estimate(logp, ref, estimator)
        assert kl.tolist() == [10.0, 10.0]
        (g,) = torch.autograd.grad(kl.sum(), logp)
        assert g.tolist() == grad


def test_loss_terms_from_config():
    cfg = validate_config(_cfg(**{"loss.entropy_coeff": 0.01, "loss.kl_coeff": 0.001, "loss.kl_estimator": "k3+"}))
    s = LossSettings.from_config(cfg.loss)
    assert (s.entropy_coeff, s.kl_coeff, s.kl_estimator) == (0.01, 0.001, "k3+")
    assert LossSettings.from_config(validate_config(_cfg()).loss)[-3:] == (0.0, 0.0, "k3")


# ---- decoupled and length-adaptive GAE, explained variance ---------------------------------

# one row of 3 valid tokens (and one invalid), gamma = 1
VALUES = torch.tensor([[1.0, 2.0, 0.5, 0.0]], dtype=torch.float64)
REWARDS = torch.tensor([[0.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
VALID = torch.tensor([[True, True, True, False]])


@pytest.mark.parametrize("lmbda,expected", [
    # deltas r_t + V_{t+1} - V_t: 0 + 2 - 1 = 1, 1 + 0.5 - 2 = -0.5, 2 + 0 - 0.5 = 1.5
    (0.0, [1.0, -0.5, 1.5, 0.0]),
    # lambda = 1: rewards to go minus V: 3 - 1, 3 - 2, 2 - 0.5
    (1.0, [2.0, 1.0, 1.5, 0.0]),
    # lambda = 0.5: A2 = 1.5, A1 = -0.5 + 0.75 = 0.25, A0 = 1 + 0.125
    (0.5, [1.125, 0.25, 1.5, 0.0]),
])
def test_gae_by_hand(lmbda, expected):
    torch.testing.assert_close(rlhf.gae(VALUES, REWARDS, 1.0, lmbda)[0], torch.tensor(expected, dtype=torch.float64))


def test_per_row_lambda_is_each_rows_own_gae():
    values, rewards = VALUES.repeat(2, 1), REWARDS.repeat(2, 1)
    per_row = rlhf.gae(values, rewards, 1.0, torch.tensor([0.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(per_row[0], rlhf.gae(VALUES, REWARDS, 1.0, 0.0)[0])
    torch.testing.assert_close(per_row[1], rlhf.gae(VALUES, REWARDS, 1.0, 0.5)[0])


def test_decoupled_gae_returns_follow_lmbda_and_advantages_lmbda_actor():
    advantages, returns = rlhf.gae_advantages(VALUES, REWARDS, 1.0, 1.0, VALID, lmbda_actor=0.0)
    # returns: lambda 1 advantages + values = rewards to go 3, 3, 2
    torch.testing.assert_close(returns[0], torch.tensor([3.0, 3.0, 2.0, 0.0], dtype=torch.float64))
    # advantages: the lambda 0 ones (1, -0.5, 1.5), whitened: mean 2/3, unbiased std sqrt(13/12)
    want = (torch.tensor([1.0, -0.5, 1.5], dtype=torch.float64) - 2 / 3) / math.sqrt(13 / 12)
    torch.testing.assert_close(advantages[0, :3], want, atol=1e-7, rtol=1e-7)
    coupled, coupled_returns = rlhf.gae_advantages(VALUES, REWARDS, 1.0, 1.0, VALID)
    assert torch.equal(coupled_returns, returns) and not torch.allclose(coupled, advantages)
    assert torch.equal(rlhf.gae_advantages(VALUES, REWARDS, 1.0, 1.0, VALID, lmbda_actor=1.0)[0], coupled)


def test_length_adaptive_lambda_by_hand():
    # 1 - 1 / (0.05 l): l = 10 -> -1 (so 0), 20 -> 0, 40 -> 0.5, 100 -> 0.8, 1000 -> 0.98
    got = rlhf.length_adaptive_lmbda(torch.tensor([10, 20, 40, 100, 1000]), 0.05)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.5, 0.8, 0.98]))


@pytest.mark.parametrize("values,expected", [
    ([1.0, 2.0, 3.0, 4.0], 1.0),  # perfect
    ([0.0, 0.0, 0.0, 0.0], 0.0),  # a constant: Var(r - v) = Var(r)
    # r - v = (.5, -.5, .5, -.5): variance 0.25 against Var(r) = 1.25
    ([0.5, 2.5, 2.5, 4.5], 0.8),
])
def test_explained_variance_by_hand(values, expected):
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]], dtype=torch.float64)
    values = torch.tensor([values + [-50.0]], dtype=torch.float64)  # the 5th token is invalid
    valid = torch.tensor([[True] * 4 + [False]])
    ev = rlhf.explained_variance(returns, values, valid)
    assert ev.item() == pytest.approx(expected, abs=1e-12)
    # two ranks holding the same rows: the sums double, the ratio stays
    assert rlhf.explained_variance(returns, values, valid, reduce=lambda x: 2 * x).item() == pytest.approx(expected)


def test_explained_variance_of_constant_returns_is_nan():
    ones = torch.ones(1, 3)
    assert math.isnan(rlhf.explained_variance(ones, torch.zeros(1, 3), ones.bool()).item())


@pytest.mark.parametrize("key,value,message", [
    ("loss.entropy_coeff", -0.1, r"loss.entropy_coeff must be a number >= 0, got -0.1"),
    ("loss.kl_coeff", -1, r"loss.kl_coeff must be a number >= 0, got -1"),
    ("loss.kl_estimator", "k2+", r"loss.kl_estimator must be one of \['k1', 'k2', 'k3', 'k1\+', 'k3\+'\], got 'k2\+'"),
    ("lmbda_actor", 1.5, r"lmbda_actor must be null or a number in \[0, 1\], got 1.5"),
    ("lmbda_length_alpha", 0, r"lmbda_length_alpha must be null or a number > 0, got 0"),
    ("critic_warmup_steps", -1, r"critic_warmup_steps must be an integer >= 0, got -1"),
])
def test_bad_algorithm_options_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**{key: value}))


@pytest.mark.parametrize("overrides,message", [
    ({"lmbda_actor": 0.9, "lmbda_length_alpha": 0.05},
     r"lmbda_actor \(0.9\) and lmbda_length_alpha \(0.05\) both set the actor's GAE lambda"),
    ({"critic_warmup_steps": 2, "optimizer_in_bwd": True, "gradient_accumulation_steps": 1, "clip_grad_norm": "null",
      "lr_scheduler": "null"},
     r"critic_warmup_steps=2 with optimizer_in_bwd=True is not supported"),
])
def test_conflicting_algorithm_options_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**overrides))


def test_advantage_metrics_by_hand():
    from torchtune_ppo.ppo.advantages import Advantages, advantage_metrics

    zeros = torch.zeros(2, 3)
    adv = Advantages(zeros, zeros, zeros, zeros, torch.tensor([0.5, 0.75]), torch.tensor(0.25))
    assert advantage_metrics(adv) == {"explained_variance": 0.25, "lmbda_actor": 0.625}
    bare = advantage_metrics(Advantages(zeros, zeros, zeros, zeros))  # an estimator without GAE
    assert all(math.isnan(v) for v in bare.values())
