"""The PPO loss step: eager against torchtune's PPOLoss, compiled against eager (loss and grads)."""

import copy

import pytest
import torch
from torchtune import rlhf as tt_rlhf
from torchtune.rlhf.loss import PPOLoss

from conftest import EOS_ID, PAD_ID, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo.compile import maybe_compile
from torchtune_ppo.rlhf import masks_and_positions
from twins.loss_step import ppo_loss_step

P, T, B = 6, 5, 4
HP = dict(prompt_len=P, temperature=0.7, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = left_padded_prompts([6, 2, 4, 1], P, seed=seed)
    responses = torch.randint(3, 64, (B, T), generator=g)
    responses[0, 2] = EOS_ID
    responses[0, 3:] = PAD_ID
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3:] = True
    masks, pos = masks_and_positions(torch.tensor([6, 2, 4, 1]), P, T)
    valid = ~pad
    return dict(
        query_responses=torch.cat([prompts, responses], 1),
        masks=masks,
        position_ids=pos,
        response_padding_masks=pad,
        old_logprobs=(torch.randn(B, T, generator=g) * 0.1 - 3) * valid,
        old_values=torch.randn(B, T, generator=g) * valid,
        advantages=torch.randn(B, T, generator=g) * valid,
        returns=torch.randn(B, T, generator=g) * valid,
    )


def test_loss_step_matches_torchtune_ppoloss():
    policy, value = tiny_policy(), tiny_classifier()
    x = _inputs()
    loss, stats = ppo_loss_step(policy, value, *x.values(), loss_scale=1.0, **HP)

    valid = ~x["response_padding_masks"]
    qr, responses = x["query_responses"], x["query_responses"][:, P:]
    logits = tt_rlhf.truncate_sequence_for_logprobs(
        policy(qr, input_pos=x["position_ids"], mask=x["masks"]), P
    )
    pi_logprobs = tt_rlhf.logits_to_logprobs(logits, responses, 0.7) * valid
    values = tt_rlhf.truncate_sequence_for_logprobs(
        value(qr, input_pos=x["position_ids"], mask=x["masks"]), P
    )[..., 0] * valid
    ref = PPOLoss(epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)(
        x["old_logprobs"], pi_logprobs, x["advantages"], x["old_values"], values,
        x["returns"], padding_masks=valid, value_padding_masks=valid,
    )
    torch.testing.assert_close(loss, ref[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.policy_loss, ref[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.value_loss, ref[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.clipfrac, ref[4], atol=1e-6, rtol=1e-5)
    assert loss.requires_grad and not stats.policy_loss.requires_grad


def test_loss_scale_scales_loss_and_grads():
    policy, value = tiny_policy(), tiny_classifier()
    x = _inputs()
    loss1, _ = ppo_loss_step(policy, value, *x.values(), loss_scale=1.0, **HP)
    loss1.backward()
    g1 = policy.tok_embeddings.weight.grad.clone()
    policy.zero_grad()
    loss4, stats4 = ppo_loss_step(policy, value, *x.values(), loss_scale=0.25, **HP)
    loss4.backward()
    torch.testing.assert_close(loss4, loss1 * 0.25)
    torch.testing.assert_close(policy.tok_embeddings.weight.grad, g1 * 0.25)


@pytest.mark.slow  # compiles
def test_compiled_loss_step_matches_eager_loss_and_grads():
    eager_models = (tiny_policy(), tiny_classifier())
    compiled_models = tuple(copy.deepcopy(m) for m in eager_models)
    compiled_step = maybe_compile(ppo_loss_step, enabled=True)
    for seed in (0, 1):  # the second call reuses the graph with new values
        x = _inputs(seed)
        results = []
        for step, models in ((ppo_loss_step, eager_models), (compiled_step, compiled_models)):
            for m in models:
                m.zero_grad()
            loss, stats = step(*models, *x.values(), loss_scale=0.5, **HP)
            loss.backward()
            grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(models) for n, p in m.named_parameters()}
            results.append((loss, stats, grads))
        (le, se, ge), (lc, sc, gc) = results
        torch.testing.assert_close(lc, le, atol=1e-5, rtol=0)
        for a, b in zip(sc, se):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert ge.keys() == gc.keys()
        for name in ge:
            torch.testing.assert_close(gc[name], ge[name], atol=1e-5, rtol=0, msg=name)
