"""A critic-free run's scoring and loss step (``value_model=None``) against the same with a value
model: the policy's numbers are unchanged, nothing of a value model is computed. Eager here;
the compiled regions with ``value_model=None`` are compared with eager end to end
(tests/e2e/test_critic_free_runs.py)."""

import pytest
import torch

from conftest import EOS_ID, PAD_ID, tiny_classifier, tiny_policy
from torchtune_ppo.rlhf import packing
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rollout.scoring import packed_score_trajectory
from test_packed_scoring import RAGGED, SETTINGS, STOP, _batch, _plan
from test_packing import CHUNKS, P, RAGGED as RAGGED_TRAJ, _trajectory

HP = dict(temperature=0.7, epsilon=0.2, value_clip_range=0.2)


def test_scoring_without_a_value_model_leaves_values_zero():
    policy, value, reward = tiny_policy(0), tiny_classifier(1), tiny_classifier(2)
    qr, lens, _ = _batch(**RAGGED)
    plan = _plan(qr, lens)
    with torch.no_grad():
        full = packed_score_trajectory(qr, lens, None, policy, policy, value, reward, STOP, plan, SETTINGS)
        free = packed_score_trajectory(qr, lens, None, policy, policy, None, reward, STOP, plan, SETTINGS)
        padded = score_trajectory(qr, lens, None, policy, policy, None,
                                  lambda x, m, p, last: reward(x, mask=m, input_pos=p)[torch.arange(len(x)), last, 0],
                                  STOP, SETTINGS)
    assert full.values.abs().sum() > 0 and torch.equal(free.values, torch.zeros_like(full.values))
    for name, a, b in zip(full._fields, free, full):
        if a is None and b is None:  # a field of multi-turn episodes only
            continue
        if name != "values":
            assert torch.equal(a, b), name
    torch.testing.assert_close(padded.values, free.values, rtol=0, atol=0)
    torch.testing.assert_close(padded.scores, free.scores, rtol=0, atol=1e-5)


LOSS_OPTIONS = dict(entropy_coeff=0.05, kl_coeff=0.2, kl_estimator="k3")  # the entropy bonus, the KL loss term


@pytest.mark.parametrize("options", [{}, LOSS_OPTIONS], ids=["plain", "entropy_and_kl_loss"])
def test_loss_step_without_a_value_model_is_the_policy_part(options):
    policy, value = tiny_policy(0), tiny_classifier(1)
    traj, advantages, returns = _trajectory(policy, value, **RAGGED_TRAJ)
    micro_batches = [[0, 1, 2, 3], [4, 5, 6, 7]]
    lengths = packing.sequence_lengths(traj, P)
    steps = packing.pack_minibatch(traj, advantages, returns, micro_batches, lengths, prompt_len=P, rows=2,
                                   num_chunks=CHUNKS)

    def run(value_model, value_coeff, **options):
        policy.zero_grad(set_to_none=True)
        value.zero_grad(set_to_none=True)
        total, stats = 0.0, []
        for step in steps:
            loss, s, _ = packed_ppo_loss_step(policy, value_model, *step, value_coeff=value_coeff,
                                           num_micro_batches=len(micro_batches), **HP, **options)
            loss.backward()
            total, stats = total + loss.detach(), stats + [s]
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
        return total, packing.micro_batch_stats(stats), grads

    ref_loss, ref_stats, ref_grads = run(value, 0.0, **options)  # the value loss weighted 0: the policy part
    loss, stats, grads = run(None, 0.1, **options)  # value_coeff has nothing to weigh
    assert all(p.grad is None for p in value.parameters())
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for got, ref in zip(stats, ref_stats):
        assert ref.value_loss != 0 and got.value_loss == 0
        assert got.entropy.abs().sum() > 0 and got.kl_loss.abs().sum() > 0  # computed either way
        for name in ("loss", "policy_loss", "ratios", "clipfrac", "approx_policy_kls", "entropy", "kl_loss"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=0, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-6, msg=name)
    if options:  # the entropy and KL terms are in the loss without a value model too
        plain_loss, _, plain_grads = run(None, 0.1)
        stat = stats[0]
        torch.testing.assert_close(
            loss - plain_loss,
            sum(-options["entropy_coeff"] * s.entropy.sum() + options["kl_coeff"] * s.kl_loss.sum() for s in stats),
            rtol=0, atol=1e-5)
        assert stat.entropy.abs().sum() > 0
        assert any(not torch.equal(grads[n], plain_grads[n]) for n in grads)
