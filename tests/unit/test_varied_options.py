"""Options that matter, each at more than one value, against numbers worked by hand: rewards
whitened before GAE (one process and two ranks), infinite scores and KL through the skip rule
and the adaptive KL controller, the k3 KL loss far from the reference in float32, and the
logged loss statistics under every loss aggregation on a ragged batch."""

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from conftest import PAD_ID, VOCAB, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo import distributed, rlhf
from torchtune_ppo.ppo.advantages import AdvantageSettings, estimate_advantages
from torchtune_ppo.ppo.kl import KLController
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.ppo.update import LossSettings, PPOUpdate, nonfinite_score_rows
from torchtune_ppo.rlhf import Trajectory, masks_and_positions
from torchtune_ppo.rlhf.kl import kl_loss_estimate
from torchtune_ppo.run.metrics import PhaseTimer, step_metrics

from twins.ranks import on_two_ranks

F64 = torch.float64
INF = float("inf")


# ---- whiten_rewards: the per-token rewards whitened before GAE ------------------------------

# Two rows, 2 and 3 valid tokens; k1 KL d = logprob - ref = [0.5, -1], [1, 0, 2].
WHITEN_VALID = torch.tensor([[True, True, False], [True, True, True]])
WHITEN_LOGP = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]], dtype=F64)
WHITEN_REF = torch.tensor([[-1.5, -1.0, 0.0], [-2.0, -1.0, -3.0]], dtype=F64)
WHITEN_VALUES = torch.tensor([[0.5, -0.25, 0.0], [1.0, 2.0, -1.0]], dtype=F64)


def _whiten_trajectory():
    return SimpleNamespace(
        scores=torch.tensor([1.0, -2.0], dtype=F64), logprobs=WHITEN_LOGP, ref_logprobs=WHITEN_REF,
        values=WHITEN_VALUES, seq_lens=torch.tensor([2, 3]), response_padding_masks=~WHITEN_VALID,
    )


def _hand_whiten(xs):
    """``(x - mean) / sqrt(unbiased variance + 1e-8)``, the documented whitening."""
    mean, var = statistics.fmean(xs), statistics.variance(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_whiten_rewards_whitens_the_kl_penalised_rewards_before_gae_by_hand():
    settings = AdvantageSettings(gamma=1.0, lmbda=1.0, whiten_rewards=True, kl_estimator="k1")
    out = estimate_advantages(_whiten_trajectory(), settings, kl_coeff=0.5)

    # rewards -0.5 * d, the score added at the last valid token:
    # row 0: [-0.25, 0.5 + 1], row 1: [-0.5, 0, -1 - 2]
    rewards = [-0.25, 1.5, -0.5, 0.0, -3.0]
    w = _hand_whiten(rewards)  # mean -0.45, over the 5 valid tokens of both rows
    # gamma = lambda = 1: the returns are the whitened rewards to go, whatever the values
    returns = [w[0] + w[1], w[1], w[2] + w[3] + w[4], w[3] + w[4], w[4]]
    expected_returns = torch.tensor([[returns[0], returns[1], 0.0], [returns[2], returns[3], returns[4]]], dtype=F64)
    torch.testing.assert_close(out.returns, expected_returns, rtol=1e-12, atol=1e-12)
    # the advantages are returns - values, whitened again over the valid tokens
    values = [0.5, -0.25, 1.0, 2.0, -1.0]
    adv = _hand_whiten([r - v for r, v in zip(returns, values)])
    torch.testing.assert_close(out.advantages[WHITEN_VALID], torch.tensor(adv, dtype=F64), rtol=1e-10, atol=1e-10)
    assert torch.all(out.advantages[~WHITEN_VALID] == 0)
    # not vacuous: without whitening the returns are the raw rewards to go
    raw = estimate_advantages(_whiten_trajectory(), settings._replace(whiten_rewards=False), kl_coeff=0.5)
    assert raw.returns[0, 0].item() == pytest.approx(1.25)


def test_whiten_rewards_over_two_ranks_is_the_one_process_whitening(monkeypatch):
    """Each rank whitens with the sums over both ranks' valid tokens: the two ranks' rows
    together get the one-process advantages and returns. Two threads stand in for the ranks."""
    g = torch.Generator().manual_seed(0)
    b, T = 6, 5
    counts = torch.tensor([5, 1, 3, 2, 4, 5])
    valid = torch.arange(T)[None, :] < counts[:, None]
    logprobs = -torch.rand(b, T, generator=g, dtype=F64) * valid
    traj = SimpleNamespace(
        scores=torch.tensor([3.0, 2.5, 4.0, -3.0, -2.0, -4.0], dtype=F64), logprobs=logprobs,
        ref_logprobs=(logprobs + 0.3 * torch.randn(b, T, generator=g, dtype=F64)) * valid,
        seq_lens=counts, response_padding_masks=~valid, values=torch.randn(b, T, generator=g, dtype=F64) * valid,
    )
    settings = AdvantageSettings(gamma=0.9, lmbda=0.8, whiten_rewards=True, kl_estimator="k1")
    one = estimate_advantages(traj, settings, kl_coeff=0.2)

    def rank(r):
        rows = slice(r * b // 2, (r + 1) * b // 2)
        return estimate_advantages(SimpleNamespace(**{k: v[rows] for k, v in vars(traj).items()}), settings,
                                   kl_coeff=0.2)

    results = on_two_ranks(monkeypatch, rank)
    for field in ("returns", "advantages"):
        two = torch.cat([getattr(results[0], field), getattr(results[1], field)])
        torch.testing.assert_close(two, getattr(one, field), rtol=1e-12, atol=1e-12, msg=field)
    # not vacuous: the ranks' rewards differ in mean (scores > 0 on rank 0, < 0 on rank 1), so
    # whitening each rank's own rows alone would give other returns
    monkeypatch.setattr(distributed, "world_size", lambda: 1)
    alone = estimate_advantages(SimpleNamespace(**{k: v[:3] for k, v in vars(traj).items()}), settings, 0.2)
    assert (alone.returns - one.returns[:3]).abs().max() > 0.1


# ---- infinite scores and KL: the skip rule and the adaptive KL controller --------------------


def test_infinite_and_nan_scores_count_as_non_finite_rows():
    scores = torch.tensor([1.0, INF, -3.0, -INF, float("nan"), 0.0])
    assert nonfinite_score_rows(SimpleNamespace(scores=scores)) == 3
    assert nonfinite_score_rows(SimpleNamespace(scores=torch.tensor([1.0, -1e30, 1e30]))) == 0


@pytest.mark.parametrize("loss,grad_norm", [
    (INF, 1.0), (-INF, 1.0), (float("nan"), 1.0), (0.5, INF), (0.5, -INF), (0.5, float("nan")),
])
def test_an_update_with_an_infinite_loss_or_gradient_norm_is_skipped(loss, grad_norm):
    assert not PPOUpdate._finite(torch.tensor(loss), torch.tensor(grad_norm), step=1)
    assert PPOUpdate._finite(torch.tensor(0.5), torch.tensor(1.0), step=1)


@pytest.mark.parametrize("loss", [INF, -INF])
def test_an_update_stepped_in_backward_with_an_infinite_loss_is_skipped(loss):
    # optimizer_in_bwd: backward runs only when the loss alone is finite
    assert not PPOUpdate._finite(torch.tensor(loss), None, step=1)
    assert PPOUpdate._finite(torch.tensor(-1e30), None, step=1)


@pytest.mark.parametrize("kl", [INF, -INF, float("nan")])
def test_adaptive_kl_controller_ignores_an_infinite_kl(kl):
    c = KLController(0.1, target=6.0, horizon=100)
    assert c.update(kl, n=10) == 0.1 and c.value == 0.1
    # and then adapts as usual: error clip(9 / 6 - 1) = 0.2, times n / horizon = 0.1
    assert c.update(9.0, n=10) == pytest.approx(0.1 * 1.02, rel=1e-12)
    assert math.isfinite(c.update(kl, n=10)) and c.value == pytest.approx(0.1 * 1.02, rel=1e-12)


# ---- the k3 KL loss far from the reference, in float32 --------------------------------------


@pytest.mark.parametrize("d", [30.0, -30.0, 100.0, -100.0, 25.0, -21.0])
def test_k3_loss_far_from_the_reference_is_clamped_and_finite_in_float32(d):
    """d = logprob - ref: the log-ratio ``-d`` is clamped to [-20, 20] and the value to at most
    10, so the value is 10 and k3's gradient 0 (through the clamp); k3+ keeps k2's gradient d.
    In float32 exp(100) overflows: without the log-ratio clamp the gradient is NaN."""
    ref = torch.tensor([-120.0], dtype=torch.float32)
    logp = (ref + d).requires_grad_(True)
    for estimator, grad in (("k3", 0.0), ("k3+", d)):
        kl = kl_loss_estimate(logp, ref, estimator)
        assert kl.dtype == torch.float32 and kl.item() == 10.0, (estimator, kl)
        (g,) = torch.autograd.grad(kl.sum(), logp)
        assert torch.isfinite(g).all() and g.item() == pytest.approx(grad, rel=1e-6), (estimator, g)


@pytest.mark.parametrize("d", [2.0, -2.0, 19.0])
def test_k3_loss_inside_the_clamps_is_exp_minus_d_plus_d_minus_1_in_float32(d):
    ref = torch.tensor([-30.0], dtype=torch.float32)
    logp = (ref + d).requires_grad_(True)
    kl = kl_loss_estimate(logp, ref, "k3")
    value = min(math.exp(-d) + d - 1.0, 10.0)  # d = 19: 18.0000... above 10: clamped
    assert kl.item() == pytest.approx(value, rel=1e-5)
    (g,) = torch.autograd.grad(kl.sum(), logp)
    grad = 0.0 if value == 10.0 else 1.0 - math.exp(-d)
    assert g.item() == pytest.approx(grad, rel=1e-5, abs=1e-7)


# ---- logged loss statistics under every aggregation, on a ragged batch ----------------------

P, T = 4, 4
COUNTS = [4, 1, 3, 2]  # valid response tokens per row
PROMPT_LENS = [4, 2, 3, 1]
EPSILON, VALUE_CLIP, VALUE_COEFF, DUAL_CLIP = 0.2, 0.2, 0.1, 3.0
ENTROPY_COEFF, KL_COEFF = 0.01, 0.05
# Per token, as offsets from the models' own outputs: old logprobs pi + D (ratio exp(-D)),
# advantages A, old values phi + E, returns phi + Q, reference logprobs pi + K.
D = torch.tensor([[-0.5, 0.4, 0.1, -1.5], [0.3, 0, 0, 0], [-0.1, 0.6, -0.3, 0], [0.05, -0.4, 0, 0]], dtype=F64)
A = torch.tensor([[1.0, -2.0, 0.5, -1.0], [-0.5, 0, 0, 0], [2.0, -1.0, -1.5, 0], [-1.0, 0.7, 0, 0]], dtype=F64)
E = torch.tensor([[0.5, -0.1, 0.0, -0.4], [0.3, 0, 0, 0], [-0.6, 0.15, 0.25, 0], [0.1, 0.8, 0, 0]], dtype=F64)
Q = torch.tensor([[1.0, 0.3, -0.5, 0.2], [-0.7, 0, 0, 0], [0.4, -0.2, 0.9, 0], [-1.2, 0.05, 0, 0]], dtype=F64)
K = torch.tensor([[0.2, -0.3, 0.5, 0.0], [-0.8, 0, 0, 0], [0.1, 0.4, -0.2, 0], [1.0, -0.5, 0, 0]], dtype=F64)


def _ragged_models_and_batch():
    """A tiny policy and value model and a 4-row trajectory whose old logprobs, values, returns
    and reference logprobs sit at the offsets above from the models' outputs (a full padded
    forward, independent of the packed loss step); plus each valid token's entropy."""
    policy, value = tiny_policy(0), tiny_classifier(1)
    b = len(COUNTS)
    prompts = left_padded_prompts(PROMPT_LENS, P, seed=0)
    g = torch.Generator().manual_seed(1)
    valid = torch.arange(T)[None, :] < torch.tensor(COUNTS)[:, None]
    responses = torch.where(valid, torch.randint(3, VOCAB, (b, T), generator=g), PAD_ID)
    qr = torch.cat([prompts, responses], 1)
    masks, pos = masks_and_positions(torch.tensor(PROMPT_LENS), P, T)
    with torch.no_grad():
        logprobs = torch.log_softmax(policy(qr, mask=masks, input_pos=pos)[:, P - 1 : -1].double(), -1)
        pi = logprobs.gather(2, responses[..., None]).squeeze(-1)
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        phi = value(qr, mask=masks, input_pos=pos)[:, P - 1 : -1, 0].double()
    f32 = lambda x: (x * valid).float()  # noqa: E731
    traj = Trajectory(
        query_responses=qr, logprobs=f32(pi + D), ref_logprobs=f32(pi + K), values=f32(phi + E), masks=masks,
        position_ids=pos, response_padding_masks=~valid, scores=torch.zeros(b), seq_lens=valid.sum(-1),
    )
    return policy, value, traj, f32(A), f32(phi + Q), entropy, valid


def _hand_token_terms(entropy):
    """Per token, from the offsets alone (float64): the PPOStats' quantities."""
    r = torch.exp(-D)
    clipped_r = r.clamp(1 - EPSILON, 1 + EPSILON)
    unclipped, clipped = -A * r, -A * clipped_r
    is_clipped = clipped > unclipped
    policy = torch.maximum(unclipped, clipped)
    dual = (A < 0) & (policy > -DUAL_CLIP * A)
    policy = torch.where(dual, -DUAL_CLIP * A, policy)
    # value clip around the old value phi + E, returns phi + Q: in offsets from phi
    value = torch.maximum(Q ** 2, (torch.clamp(torch.zeros_like(E), E - VALUE_CLIP, E + VALUE_CLIP) - Q) ** 2)
    kl = torch.exp(K) - K - 1  # k3 with ref - logprob = K
    token_loss = policy + VALUE_COEFF * 0.5 * value - ENTROPY_COEFF * entropy + KL_COEFF * kl
    return {
        "loss": token_loss, "policy_loss": policy, "value_loss": 0.5 * value,
        "ratios": r, "clipfrac": is_clipped.double(), "approx_policy_kl": 0.5 * D ** 2,
        "clipfrac_low": (is_clipped & (r < 1)).double(), "clipfrac_high": (is_clipped & (r > 1)).double(),
        "dualclip_frac": dual.double(), "entropy": entropy, "kl_loss": kl,
    }


def _aggregate(x, valid, micro_batches, aggregation):
    """The documented aggregation of token values ``x`` over one minibatch, by hand."""
    rows = [i for mb in micro_batches for i in mb]
    tokens = lambda i: [x[i, t].item() for t in range(T) if valid[i, t]]  # noqa: E731
    if aggregation == "token-mean":  # each micro-batch's token mean, averaged over micro-batches
        return statistics.fmean(sum(sum(tokens(i)) for i in mb) / sum(len(tokens(i)) for i in mb)
                                for mb in micro_batches)
    per_sequence = {
        "seq-mean-token-mean": lambda i: sum(tokens(i)) / len(tokens(i)),
        "seq-mean-token-sum": lambda i: sum(tokens(i)),
        "seq-mean-token-sum-norm": lambda i: sum(tokens(i)) / T,
    }[aggregation]
    return statistics.fmean(per_sequence(i) for i in rows)


LOSS_TERMS = ("loss", "policy_loss", "value_loss")  # aggregated as loss.aggregation says


@pytest.mark.parametrize("aggregation", rlhf.AGGREGATIONS)
def test_logged_stats_under_each_aggregation_by_hand(aggregation):
    """Two PPO epochs over one minibatch of 4 ragged rows in 2 micro-batches (lr 0, so both
    epochs see the same weights): the logged loss terms are aggregated as ``aggregation`` says,
    the ratios, clip fractions, approximate KL, entropy and KL to the reference are token means
    (each micro-batch's, averaged), each averaged over the minibatch updates."""
    policy, value, traj, advantages, returns, entropy, valid = _ragged_models_and_batch()
    optimizer = torch.optim.SGD([*policy.parameters(), *value.parameters()], lr=0.0)
    settings = LossSettings(epsilon=EPSILON, value_clip_range=VALUE_CLIP, value_coeff=VALUE_COEFF,
                            dual_clip=DUAL_CLIP, aggregation=aggregation, entropy_coeff=ENTROPY_COEFF,
                            kl_coeff=KL_COEFF, kl_estimator="k3")
    update = PPOUpdate(policy, value, optimizer, None, packed_ppo_loss_step, batch_size=4, ppo_batch_size=4,
                       ppo_epochs=2, gradient_accumulation_steps=2, prompt_len=P, response_len=T,
                       temperature=1.0, loss=settings, clip_grad_norm=None, optimizer_in_bwd=False)
    torch.manual_seed(0)  # the update shuffles the rows with the global generator: the same orders
    orders = [torch.randperm(4).tolist() for _ in range(2)]
    torch.manual_seed(0)
    result = update(traj, advantages, returns, PhaseTimer(torch.device("cpu")), step=1)
    assert result.skipped_updates == 0 and len(result.stats) == 4  # 2 updates x 2 micro-batches
    zeros = torch.zeros(4, T)
    times = {"generate": 2.0, "score": 3.0, "loss_step": 5.0, "optimizer": 1.0}
    logged = step_metrics(traj, result.stats, zeros, zeros, times, grad_accum=2, ppo_epochs=2)
    # the ragged rows' mean length and the longest (what a generation call decodes up to)
    lens = traj.seq_lens.float()
    assert logged["response_lengths"] == pytest.approx(float(lens.mean()))
    assert logged["response_lengths_max"] == float(lens.max()) > float(lens.mean())
    # throughput: generated tokens over the generation's seconds; positions over each half's
    b, s = traj.query_responses.shape
    assert logged["generated_tokens_per_second"] == pytest.approx(float(lens.sum()) / 2.0)
    assert logged["tokens_per_second_per_gpu_trajectory"] == pytest.approx(b * s / 5.0)
    assert logged["tokens_per_second_per_gpu_ppo"] == pytest.approx(2 * b * s / 6.0)
    assert logged["time/score"] == 3.0

    terms = _hand_token_terms(entropy)
    for name, x in terms.items():
        how = aggregation if name in LOSS_TERMS else "token-mean"
        expected = statistics.fmean(_aggregate(x, valid, [order[:2], order[2:]], how) for order in orders)
        assert logged[name] == pytest.approx(expected, rel=2e-5, abs=2e-6), (name, aggregation)
    # not vacuous: every kind of clipping happens, and the aggregations tell the loss apart
    for name in ("clipfrac_low", "clipfrac_high", "dualclip_frac"):
        assert logged[name] > 0.01, name
    others = {a: _aggregate(terms["policy_loss"], valid, [orders[0][:2], orders[0][2:]], a) for a in rlhf.AGGREGATIONS}
    assert len({round(v, 6) for v in others.values()}) == 4


def test_the_mismatch_kept_is_the_first_minibatchs_before_any_update():
    """``rollout_corr/*`` are measured at a step's first minibatch, before the optimizer has
    stepped (the rollout's weights): with 2 minibatches of 2 rows and 2 PPO epochs under a large
    learning rate, what is kept is ``-D`` (old logprobs ``pi + D``) over the first minibatch's
    rows, not a later minibatch's gap after the weights moved."""
    from torchtune_ppo.rlhf.correction import mismatch_stats

    policy, value, traj, advantages, returns, _, valid = _ragged_models_and_batch()
    optimizer = torch.optim.SGD([*policy.parameters(), *value.parameters()], lr=5.0)
    settings = LossSettings(epsilon=EPSILON, value_clip_range=VALUE_CLIP, value_coeff=VALUE_COEFF)
    update = PPOUpdate(policy, value, optimizer, None, packed_ppo_loss_step, batch_size=4, ppo_batch_size=2,
                       ppo_epochs=2, gradient_accumulation_steps=1, prompt_len=P, response_len=T,
                       temperature=1.0, loss=settings, clip_grad_norm=None, optimizer_in_bwd=False)
    torch.manual_seed(0)
    first = torch.randperm(4).tolist()[:2]  # the first epoch's first minibatch
    torch.manual_seed(0)
    before = [p.detach().clone() for p in policy.parameters()]
    result = update(traj, advantages, returns, PhaseTimer(torch.device("cpu")), step=1)
    assert result.skipped_updates == 0
    rows = torch.tensor(first)
    want = mismatch_stats(-D[rows].float(), torch.zeros(2, T), valid[rows]).metrics()
    got = result.mismatch.metrics()
    for key, value_ in want.items():
        assert got[key] == pytest.approx(value_, abs=1e-5), key
    # not vacuous: the policy moved, so a gap measured after an update is another
    with torch.no_grad():
        logits = policy(traj.query_responses, mask=traj.masks, input_pos=traj.position_ids)
    now = torch.log_softmax(logits[:, P - 1 : -1].double(), -1).gather(2, traj.query_responses[:, P:, None])[..., 0]
    later = mismatch_stats(now.float()[rows], traj.logprobs[rows], valid[rows]).metrics()
    assert abs(later["rollout_corr/log_ratio_mean"] - want["rollout_corr/log_ratio_mean"]) > 1e-2
    assert max((a - b).abs().max().item() for a, b in zip(before, policy.parameters())) > 0


# ---- each aggregation's token weight, with gradient accumulation ----------------------------


@pytest.mark.parametrize("aggregation,want", [
    ("token-mean", 1 / (2 * 5)),  # each micro-batch's token mean, averaged over its 2 micro-batches
    ("seq-mean-token-mean", 1 / (3 * 4)),
    ("seq-mean-token-sum", 1 / 3),
    ("seq-mean-token-sum-norm", 1 / (3 * 8)),
])
def test_loss_weight_by_hand_with_two_micro_batches(aggregation, want):
    from torchtune_ppo.rlhf.loss import loss_weight

    got = loss_weight(aggregation, grad_accum=2, micro_batch_tokens=5, num_sequences=3, sequence_tokens=4,
                      response_len=8)
    assert got == pytest.approx(want, rel=1e-15)


def test_a_good_step_resets_the_consecutive_skip_count():
    """``max_consecutive_skipped_steps`` counts skipped steps in a row: a good step between
    them starts the count again; the total keeps every one."""
    from torchtune_ppo.run.guards import SkippedSteps

    skips = SkippedSteps(max_consecutive=3)
    for skipped in (True, True, False, True, True, False):
        skips.count(skipped)
    assert (skips.consecutive, skips.total) == (0, 4)
    skips.count(True)
    skips.count(True)
    with pytest.raises(RuntimeError, match="3 consecutive steps"):
        skips.count(True)
