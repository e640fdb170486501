"""Steps 2-6: truncation, masks, scores, penalties; eager against torchtune's math and compiled."""

import pytest
import torch
from torchtune import generation, rlhf as tt_rlhf

from conftest import EOS_ID, PAD_ID, left_padded_prompts, tiny_policy
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rlhf import ScoringSettings, masks_and_positions

P, T = 6, 5
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=0.7, penalise_no_eos=True,
                           min_response_length=None, reward_penalty=-3.0)


LENS = torch.tensor([6, 3, 1, 4])


def _batch():
    prompts = left_padded_prompts(LENS.tolist(), P, seed=3)
    responses = torch.tensor([
        [5, 6, EOS_ID, 7, 8],   # stop at 2: tokens after it become pad
        [9, 10, 11, 12, 13],    # no stop token: penalised
        [EOS_ID, 4, 4, 4, 4],   # stops at once
        [7, 8, 9, 10, EOS_ID],  # stops on the last token
    ])
    return prompts, torch.cat([prompts, responses], 1)


def test_masks_and_positions_match_torchtune():
    prompts = left_padded_prompts([6, 3, 0, 1], P)
    masks, pos = masks_and_positions(torch.tensor([6, 3, 0, 1]), P, T)
    valid = torch.nn.functional.pad(prompts != PAD_ID, (0, T), value=True)
    torch.testing.assert_close(masks, generation.get_causal_mask_from_padding_mask(valid))
    torch.testing.assert_close(pos, generation.get_position_ids_from_padding_mask(valid).long())


def _reference(prompts, query_responses, ref, value, reward):
    """The same quantities computed the way torchtune's PPO recipe does, row by row."""
    responses = query_responses[:, P:].clone()
    pad_masks, responses = tt_rlhf.truncate_sequence_at_first_stop_token(responses, STOP, PAD_ID)
    qr = torch.cat([prompts, responses], 1)
    valid = torch.nn.functional.pad(prompts != PAD_ID, (0, T), value=True)
    masks = generation.get_causal_mask_from_padding_mask(valid)
    pos = generation.get_position_ids_from_padding_mask(valid)
    logits = tt_rlhf.truncate_sequence_for_logprobs(ref(qr, input_pos=pos, mask=masks), P)
    ref_logprobs = tt_rlhf.logits_to_logprobs(logits, responses, 0.7)
    values = tt_rlhf.truncate_sequence_for_logprobs(value(qr, input_pos=pos, mask=masks), P)[..., 0]
    seq_lens = (~pad_masks).sum(-1)
    scores = reward(qr, input_pos=pos, mask=masks)[torch.arange(len(qr)), P + seq_lens - 1, 0]
    return qr, pad_masks, ref_logprobs, values, scores, seq_lens


@torch.no_grad()
def test_score_trajectory_matches_reference(models):
    policy, ref, value, reward = models
    prompts, qr = _batch()
    gen_logprobs = torch.randn(4, T)
    traj = score_trajectory(qr, LENS, gen_logprobs, None, ref, value, ModelReward(reward), STOP, SETTINGS)
    exp_qr, exp_pad, exp_ref, exp_values, exp_scores, exp_lens = _reference(prompts, qr, ref, value, reward)

    torch.testing.assert_close(traj.query_responses, exp_qr)
    assert traj.query_responses[0, P:].tolist() == [5, 6, EOS_ID, PAD_ID, PAD_ID]
    torch.testing.assert_close(traj.response_padding_masks, exp_pad)
    assert traj.seq_lens.tolist() == [3, 5, 1, 5]
    valid = ~exp_pad
    torch.testing.assert_close(traj.ref_logprobs, exp_ref * valid, atol=1e-5, rtol=0)
    torch.testing.assert_close(traj.values, exp_values * valid, atol=1e-5, rtol=0)
    torch.testing.assert_close(traj.logprobs, gen_logprobs * valid)
    # row 1 never stopped: its score is the penalty; the others are the reward model's
    expected_scores = exp_scores.clone()
    expected_scores[1] = -3.0
    torch.testing.assert_close(traj.scores, expected_scores, atol=1e-5, rtol=0)
    assert torch.all(traj.ref_logprobs[exp_pad] == 0) and torch.all(traj.values[exp_pad] == 0)


@torch.no_grad()
def test_policy_logprobs_computed_when_not_given(models):
    _, ref, value, reward = models
    policy = tiny_policy(seed=5)  # other weights than the reference
    prompts, qr = _batch()
    traj = score_trajectory(qr, LENS, None, policy, ref, value, ModelReward(reward), STOP, SETTINGS)
    _, pad_masks, *_ = _reference(prompts, qr, ref, value, reward)
    exp_qr, _, expected, *_ = _reference(prompts, qr, policy, value, reward)
    valid = ~pad_masks
    torch.testing.assert_close(traj.logprobs, expected * valid, atol=1e-5, rtol=0)
    assert (traj.logprobs - traj.ref_logprobs).abs().max() > 1e-2  # not the reference's


@torch.no_grad()
def test_scores_do_not_depend_on_left_padding(models):
    _, ref, value, reward = models
    prompt = torch.tensor([11, 12, 13])
    response = torch.tensor([20, 21, EOS_ID, 22, 23])
    padded = torch.cat([torch.full((P - 3,), PAD_ID), prompt, response]).unsqueeze(0)
    unpadded = torch.cat([prompt, response]).unsqueeze(0)
    a = score_trajectory(padded, torch.tensor([3]), None, ref, ref, value, ModelReward(reward), STOP, SETTINGS)
    b = score_trajectory(unpadded, torch.tensor([3]), None, ref, ref, value, ModelReward(reward), STOP,
                         SETTINGS._replace(prompt_len=3))
    torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.ref_logprobs, b.ref_logprobs, atol=1e-5, rtol=0)
    assert a.seq_lens.tolist() == [3]


@pytest.mark.slow  # compiles
@torch.no_grad()
def test_compiled_trajectory_equals_eager(models):
    from torchtune_ppo.compile import maybe_compile

    _, ref, value, reward = models
    prompts, qr = _batch()
    gen_logprobs = torch.randn(4, T)
    args = (qr, LENS, gen_logprobs, None, ref, value, ModelReward(reward), STOP)
    eager = score_trajectory(*args, SETTINGS)
    compiled = maybe_compile(score_trajectory, enabled=True)(*args, SETTINGS)
    for name, e, c in zip(eager._fields, eager, compiled):
        if e is None and c is None:  # a field of multi-turn episodes only
            continue
        if e.is_floating_point():
            torch.testing.assert_close(c, e, atol=1e-5, rtol=0, msg=name)
        else:
            assert torch.equal(c, e), name
