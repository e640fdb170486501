"""PPO math against hand-worked values and against torchtune's reference implementations."""

import math

import pytest
import torch
from torchtune import rlhf as tt_rlhf
from torchtune.rlhf.loss import PPOLoss

from twins import rlhf as twin_rlhf
from torchtune_ppo import rlhf

T = torch.tensor


def test_whiten_zero_mean_unit_std_over_valid_tokens():
    torch.manual_seed(0)
    x = torch.randn(4, 7) * 3 + 5
    mask = torch.rand(4, 7) > 0.3
    w = rlhf.whiten(x, mask)
    valid = w[mask]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-5)
    assert torch.all(w[~mask] == 0)


def test_whiten_by_hand():
    # valid values 1, 2, 3: mean 2, unbiased var 1 -> -1, 0, 1
    x = T([[1.0, 2.0, 3.0, 100.0]])
    mask = T([[True, True, True, False]])
    torch.testing.assert_close(rlhf.whiten(x, mask), T([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


def test_whiten_is_torchtunes_without_the_mean_added_back():
    # torchtune's default adds the mean (2) back: [-1, 0, 1] + 2; ours leaves it out
    x = T([[1.0, 2.0, 3.0]])
    mask = torch.ones_like(x, dtype=torch.bool)
    torch.testing.assert_close(rlhf.whiten(x, mask), T([[-1.0, 0.0, 1.0]]), atol=1e-6, rtol=0)
    torch.manual_seed(3)
    x = torch.randn(3, 5) * 2 + 4
    mask = torch.rand(3, 5) > 0.3
    ours = rlhf.whiten(x, mask)
    tt = tt_rlhf.whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(ours[mask], tt[mask], atol=1e-5, rtol=1e-5)
    assert torch.all(ours[~mask] == 0)


def test_truncate_after_stop_token_matches_torchtune_docstring_example():
    stop = T([2, 869])
    seqs = T(
        [
            [869, 30, 869],
            [2, 30, 869],
            [869, 30, 2],
            [50, 30, 869],
            [13, 30, 2],
            [13, 30, 5],
            [13, 2, 20],
            [13, 2, 2],
            [2, 2, 2],
        ]
    )
    pad, out = rlhf.truncate_after_stop_token(seqs, stop, pad_id=0)
    tt_pad, tt_out = tt_rlhf.truncate_sequence_at_first_stop_token(seqs.clone(), stop, 0)
    torch.testing.assert_close(pad, tt_pad)
    torch.testing.assert_close(out, tt_out)
    assert seqs[0, 2] == 869  # input untouched
    assert out[6].tolist() == [13, 2, 0]


def test_rewards_kl_penalty_and_score_at_last_valid_token():
    # Row 0's masked tokens have logprobs unlike the reference's: their KL must still be 0.
    logprobs = T([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = T([[-1.5, -1.0, -2.5, -4.0], [-2.0, -1.0, -1.0, -3.0]])
    masks = T([[True, True, False, False], [True, True, True, True]])
    seq_lens = T([2, 4])
    scores = T([10.0, -4.0])
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(scores, logprobs, ref, 0.1, seq_lens, masks)
    # kl = logprobs - ref on valid tokens, 0 elsewhere
    torch.testing.assert_close(kl, T([[0.5, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 2.0]]))
    torch.testing.assert_close(kl_rewards, T([[-0.05, 0.1, 0.0, 0.0], [-0.1, 0.0, 0.0, -0.2]]))
    # the score lands on the last valid token: index 1 for row 0, index 3 for row 1
    torch.testing.assert_close(rewards, T([[-0.05, 10.1, 0.0, 0.0], [-0.1, 0.0, 0.0, -4.2]]))


def test_gae_by_hand():
    # one row, two valid steps; gamma=0.5, lambda=0.5. The masked step's value and reward are
    # not 0: they must not reach the valid steps (the recursion ends at the last valid token).
    values = T([[1.0, 2.0, 5.0]])
    rewards = T([[0.0, 3.0, 7.0]])
    masks = T([[True, True, False]])
    gamma, lmbda = 0.5, 0.5
    # t=1: delta = 3 + 0.5*0 - 2 = 1; A1 = 1
    # t=0: delta = 0 + 0.5*2 - 1 = 0; A0 = 0 + 0.25*1 = 0.25
    raw_adv = T([[0.25, 1.0]])
    advantages, returns = rlhf.gae_advantages(values, rewards, gamma, lmbda, masks)
    torch.testing.assert_close(returns, T([[1.25, 3.0, 0.0]]))
    # whitened over the two valid values: mean 0.625, unbiased std 0.53033
    std = math.sqrt(((0.25 - 0.625) ** 2 + (1.0 - 0.625) ** 2) / 1)
    expected = (raw_adv - 0.625) / std
    torch.testing.assert_close(advantages[:, :2], expected, atol=1e-5, rtol=0)
    assert advantages[0, 2] == 0


def test_whiten_reduced_over_one_process_is_the_local_whiten():
    # The several-process path (sums through `reduce`) with the identity for one process.
    torch.manual_seed(4)
    x = torch.randn(3, 6) * 2 + 3
    mask = torch.rand(3, 6) > 0.4
    reduced = rlhf.whiten(x, mask, reduce=lambda t: t)
    torch.testing.assert_close(reduced, rlhf.whiten(x, mask), atol=1e-6, rtol=1e-6)
    assert torch.all(reduced[~mask] == 0)


def test_gae_matches_torchtune_when_nothing_is_masked():
    torch.manual_seed(1)
    values, rewards = torch.randn(3, 6), torch.randn(3, 6)
    masks = torch.ones(3, 6, dtype=torch.bool)
    _, returns = rlhf.gae_advantages(values, rewards, 0.9, 0.8, masks)
    _, tt_returns = tt_rlhf.estimate_advantages(values, rewards, 0.9, 0.8, masks)
    torch.testing.assert_close(returns, tt_returns)


def _loss_inputs(pi_logprobs, advantages):
    n = len(pi_logprobs)
    zeros = torch.zeros(1, n)
    return dict(
        pi_old_logprobs=zeros,
        pi_logprobs=T([pi_logprobs]),
        advantages=T([advantages]),
        phi_old_values=zeros,
        phi_values=zeros,
        returns=zeros,
        masks=torch.ones(1, n, dtype=torch.bool),
        epsilon=0.2,
        value_clip_range=0.2,
        value_coeff=0.1,
    )


def test_policy_clipping_positive_advantage_caps_ratio_above():
    # ratio e^0.5 = 1.6487 > 1.2 with A = 1: loss uses the clipped ratio 1.2
    loss, policy_loss, _, ratios, clipfrac = twin_rlhf.ppo_loss(**_loss_inputs([0.5], [1.0]))
    assert policy_loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert clipfrac.item() == 1.0
    assert ratios.item() == pytest.approx(math.exp(0.5), abs=1e-6)


def test_policy_clipping_negative_advantage_caps_ratio_below():
    # ratio e^-0.5 = 0.6065 < 0.8 with A = -1: max(0.6065, 0.8) = 0.8 (clipped)
    _, policy_loss, _, _, clipfrac = twin_rlhf.ppo_loss(**_loss_inputs([-0.5], [-1.0]))
    assert policy_loss.item() == pytest.approx(0.8, abs=1e-6)
    assert clipfrac.item() == 1.0


def test_policy_clipping_is_pessimistic_only():
    # A = 1 with ratio 0.6065 (below the range): the unclipped, lower objective is kept
    _, policy_loss, _, _, clipfrac = twin_rlhf.ppo_loss(**_loss_inputs([-0.5], [1.0]))
    assert policy_loss.item() == pytest.approx(-math.exp(-0.5), abs=1e-6)
    assert clipfrac.item() == 0.0


def test_logged_ratios_average_valid_tokens_only():
    # valid log-ratios 0.1 and -0.2; the masked token's ratio e^3 must not count
    inputs = _loss_inputs([0.1, -0.2, 3.0], [1.0, 1.0, 1.0])
    inputs["masks"] = T([[True, True, False]])
    _, _, _, ratios, clipfrac = twin_rlhf.ppo_loss(**inputs)
    assert ratios.item() == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2, abs=1e-6)
    assert clipfrac.item() == 0.0  # only the masked ratio is outside [0.8, 1.2]


def test_value_clipping_by_hand():
    inputs = _loss_inputs([0.0], [0.0])
    # new value 1.0, old value 0.0, return 1.0: clipped value 0.2 -> (0.2 - 1)^2 = 0.64
    inputs.update(phi_values=T([[1.0]]), returns=T([[1.0]]))
    _, _, value_loss, _, _ = twin_rlhf.ppo_loss(**inputs)
    assert value_loss.item() == pytest.approx(0.5 * 0.64, abs=1e-6)


def test_ppo_loss_matches_torchtune_ppoloss():
    torch.manual_seed(2)
    shape = (4, 5)
    args = [torch.randn(shape) * 0.3 for _ in range(6)]
    masks = torch.rand(shape) > 0.2
    ours = twin_rlhf.ppo_loss(*args, masks, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)
    ref = PPOLoss(epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)(
        *args, padding_masks=masks, value_padding_masks=masks
    )
    for a, b in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours[4], ref[4], atol=1e-6, rtol=1e-5)  # clipfrac


def test_penalty_mask_no_eos_and_min_length():
    stop = T([2])
    responses = T([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    pad = T([[False, False, True, True], [False] * 4, [False, True, True, True]])
    seq_lens = (~pad).sum(-1)
    mask = rlhf.get_reward_penalty_mask(pad, seq_lens, stop, responses, True, None)
    assert mask.tolist() == [False, True, False]
    mask = rlhf.get_reward_penalty_mask(pad, seq_lens, stop, responses, False, 2)
    assert mask.tolist() == [False, False, True]
