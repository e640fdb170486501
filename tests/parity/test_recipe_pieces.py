"""The recipe's own steps, in-process on the tiny task: PPO update, advantages, loss stats."""

import copy
import math

import pytest
import torch

from conftest import EOS_ID, PAD_ID, left_padded_prompts, recipe_config, tiny_classifier, tiny_policy
from ppo_full_finetune import PhaseTimer, PPOFullFinetuneRecipe
from twins import rlhf as twin_rlhf
from torchtune_ppo import rlhf
from torchtune_ppo.ppo.advantages import AdvantageSettings, estimate_advantages
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rlhf import ScoringSettings, Trajectory, masks_and_positions
from twins.loss_step import ppo_loss_step

# Plain SGD, no clipping: each optimizer step moves the parameters by exactly -LR * grad.
LR = 0.1
SGD = {"optimizer._component_": "torch.optim.SGD", "optimizer.lr": LR, "clip_grad_norm": "null"}
CPU = torch.device("cpu")


def _trajectory(recipe, cfg, scores):
    """A trajectory of the recipe's models on real prompts; every response stops at index 5.

    Equal valid lengths make the masked mean over a minibatch equal to the mean of its
    micro-batches' masked means, whatever rows a micro-batch draws.
    """
    b, t, p = cfg.batch_size, cfg.max_generated_tokens, cfg.max_prompt_len
    batch = next(iter(recipe._dataloader))
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(3, 500, (b, t), generator=g)
    responses[:, 5] = EOS_ID  # tokens after it become padding: 6 valid tokens per row
    with torch.no_grad():
        return score_trajectory(
            torch.cat([batch["tokens"], responses], 1),
            batch["prompt_lens"],
            None,
            recipe._models.policy,
            recipe._models.ref_policy,
            recipe._models.value,
            lambda tokens, masks, position_ids, last_idx: scores,
            torch.tensor([EOS_ID]),
            ScoringSettings(prompt_len=p, pad_id=PAD_ID, temperature=float(cfg.temperature),
                            penalise_no_eos=True, min_response_length=None, reward_penalty=-3.0),
        )


def _advantages(cfg, trajectory):
    """The advantages the recipe computes for ``trajectory`` with ``cfg``'s keys."""
    return estimate_advantages(trajectory, AdvantageSettings.from_config(cfg), cfg.kl_coeff)


def _update(recipe, trajectory, advantages, returns):
    """The recipe's PPO update of one step; returns the applied micro-batches' stats."""
    return recipe._update(trajectory, advantages, returns, PhaseTimer(CPU), step=1).stats


def _loss_kwargs(cfg):
    return dict(
        prompt_len=cfg.max_prompt_len,
        temperature=float(cfg.temperature),
        epsilon=cfg.loss.epsilon,
        value_clip_range=cfg.loss.value_clip_range,
        value_coeff=cfg.loss.value_coeff,
    )


def _full_batch_grads(policy, value, trajectory, advantages, returns, cfg):
    """Gradients of the PPO loss over all rows at once (no accumulation), and its stats."""
    for m in (policy, value):
        m.zero_grad(set_to_none=True)
    loss, stats = ppo_loss_step(
        policy, value,
        trajectory.query_responses, trajectory.masks, trajectory.position_ids,
        trajectory.response_padding_masks, trajectory.logprobs, trajectory.values,
        advantages, returns, loss_scale=1.0, ref_logprobs=trajectory.ref_logprobs, **_loss_kwargs(cfg),
    )
    loss.backward()
    grads = [p.grad.clone() for m in (policy, value) for p in m.parameters()]
    return grads, stats


def _trained(recipe):
    return [p for m in (recipe._models.policy, recipe._models.value) for p in m.parameters()]


def _params(recipe):
    return [p.detach().clone() for p in _trained(recipe)]


def _assert_params_close(actual, expected):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=1e-7, rtol=1e-4, msg=lambda m: f"parameter {i}: {m}")


def test_accumulated_update_equals_sgd_step_on_the_minibatch_mean_gradient(make_recipe):
    # one minibatch of 4 rows in 2 micro-batches of 2, one epoch
    recipe, cfg = make_recipe(batch_size=4, ppo_epochs=1, **SGD)
    trajectory = _trajectory(recipe, cfg, scores=torch.tensor([1.0, -2.0, 0.5, 3.0]))
    advantages, returns = _advantages(cfg, trajectory)[:2]
    before = _params(recipe)
    policy, value = copy.deepcopy(recipe._models.policy), copy.deepcopy(recipe._models.value)
    grads, full_stats = _full_batch_grads(policy, value, trajectory, advantages, returns, cfg)

    stats = _update(recipe, trajectory, advantages, returns)

    assert len(stats) == 2  # two micro-batches
    assert max(g.abs().max().item() for g in grads) > 1e-3  # the step is not trivially zero
    _assert_params_close(_params(recipe), [p - LR * g for p, g in zip(before, grads)])
    # each micro-batch's stats carry 1/grad_accum, so their sum is the minibatch's
    for name, micro_a, micro_b, full in zip(rlhf.PPOStats._fields, *stats, full_stats):
        torch.testing.assert_close(micro_a + micro_b, full, atol=1e-6, rtol=1e-5, msg=name)


def test_consecutive_minibatches_do_not_accumulate_into_each_other(make_recipe):
    # two epochs over one 4-row minibatch: two optimizer steps on the same rows
    recipe, cfg = make_recipe(batch_size=4, ppo_epochs=2, **SGD)
    trajectory = _trajectory(recipe, cfg, scores=torch.tensor([1.0, -2.0, 0.5, 3.0]))
    advantages, returns = _advantages(cfg, trajectory)[:2]
    policy, value = copy.deepcopy(recipe._models.policy), copy.deepcopy(recipe._models.value)
    params = [p for m in (policy, value) for p in m.parameters()]
    for _ in range(2):  # theta_{k+1} = theta_k - LR * grad(theta_k), fresh gradients each step
        grads, _ = _full_batch_grads(policy, value, trajectory, advantages, returns, cfg)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= LR * g

    _update(recipe, trajectory, advantages, returns)

    _assert_params_close(_params(recipe), [p.detach() for p in params])
    assert all(p.grad is None for p in _trained(recipe))


def _hand_trajectory(scores, logprobs, ref_logprobs, valid):
    b, t = logprobs.shape
    masks, position_ids = masks_and_positions(torch.full((b,), 2), 2, t)
    return Trajectory(
        query_responses=torch.zeros(b, 2 + t, dtype=torch.long),
        logprobs=logprobs * valid,
        ref_logprobs=ref_logprobs * valid,
        values=torch.zeros(b, t),
        masks=masks,
        position_ids=position_ids,
        response_padding_masks=~valid,
        scores=scores,
        seq_lens=valid.sum(-1),
    )


def test_estimate_advantages_returns_are_score_plus_kl_rewards_to_go(tmp_path):
    cfg = recipe_config(tmp_path, kl_coeff=0.5, gamma=1.0, lmbda=1.0)
    valid = torch.tensor([[True, True, False, False], [True, True, True, True]])
    logprobs = torch.tensor([[-1.0, -2.0, -9.0, -9.0], [-1.0, -1.0, -1.0, -1.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, 0.0, 0.0], [-2.0, -1.0, -1.0, -3.0]])
    trajectory = _hand_trajectory(torch.tensor([3.0, -1.0]), logprobs, ref_logprobs, valid)

    advantages, returns, kl, kl_rewards = _advantages(cfg, trajectory)[:4]

    # kl = logprobs - ref on valid tokens: [0.5, -1], [1, 0, 0, 2]; kl_rewards = -0.5 * kl
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 2.0]]))
    torch.testing.assert_close(
        kl_rewards, torch.tensor([[-0.25, 0.5, 0.0, 0.0], [-0.5, 0.0, 0.0, -1.0]])
    )
    # gamma = lambda = 1, values 0: returns are rewards-to-go, the score counted at each valid token
    # row 0: [3 - 0.25 + 0.5, 3 + 0.5]; row 1: [-1 - 0.5 - 1, -1 - 1, -1 - 1, -1 - 1]
    torch.testing.assert_close(
        returns, torch.tensor([[3.25, 3.5, 0.0, 0.0], [-2.5, -2.0, -2.0, -2.0]]), atol=1e-6, rtol=0
    )
    # advantages: the returns whitened over the 6 valid tokens (mean 1/6), 0 elsewhere
    valid_returns = torch.tensor([3.25, 3.5, -2.5, -2.0, -2.0, -2.0])
    expected = (valid_returns - valid_returns.mean()) / valid_returns.std()
    torch.testing.assert_close(advantages[valid], expected, atol=1e-5, rtol=0)
    assert torch.all(advantages[~valid] == 0)


def test_changing_one_score_moves_only_that_rows_returns_by_the_change(tmp_path):
    cfg = recipe_config(tmp_path, kl_coeff=0.0, gamma=1.0, lmbda=1.0)
    g = torch.Generator().manual_seed(0)
    valid = torch.arange(6) < torch.tensor([[6], [3], [1]])
    logprobs, ref_logprobs = -torch.rand(3, 6, generator=g), -torch.rand(3, 6, generator=g)
    scores = torch.tensor([0.5, -1.0, 2.0])
    before = _hand_trajectory(scores, logprobs, ref_logprobs, valid)
    after = before._replace(scores=torch.tensor([0.5, 6.0, 2.0]))  # row 1: +7

    returns_before = _advantages(cfg, before).returns
    adv_after, returns_after = _advantages(cfg, after)[:2]

    # no KL penalty, no values, no discount: every valid token's return is its row's score
    torch.testing.assert_close(returns_before, scores[:, None] * valid, atol=1e-6, rtol=0)
    delta = returns_after - returns_before
    torch.testing.assert_close(delta[1], torch.tensor([7.0] * 3 + [0.0] * 3), atol=1e-6, rtol=0)
    assert torch.all(delta[[0, 2]] == 0)
    # values 0: the advantages are the returns whitened over the 10 valid tokens
    valid_returns = torch.tensor([0.5] * 6 + [6.0] * 3 + [2.0])
    expected = (valid_returns - valid_returns.mean()) / valid_returns.std()
    torch.testing.assert_close(adv_after[valid], expected, atol=1e-5, rtol=0)


def test_loss_step_stats_ratios_and_approx_kl_are_masked_means():
    policy, value = tiny_policy(), tiny_classifier()
    p, t = 4, 4
    prompts = left_padded_prompts([4, 2], p)
    responses = torch.tensor([[5, 6, EOS_ID, PAD_ID], [7, 8, 9, 10]])
    pad = torch.tensor([[False, False, False, True], [False] * 4])
    masks, pos = masks_and_positions(torch.tensor([4, 2]), p, t)
    qr = torch.cat([prompts, responses], 1)
    with torch.no_grad():
        pi = twin_rlhf.response_logprobs(policy(qr, mask=masks, input_pos=pos), responses, p, 1.0) * ~pad
    # old logprobs = current + d; the padded token gets d = 5, which must not count
    d = torch.tensor([[0.2, -0.4, 0.1, 5.0], [0.0, 0.3, -0.2, 0.1]])
    zeros = torch.zeros(2, t)
    _, stats = ppo_loss_step(
        policy, value, qr, masks, pos, pad, pi + d, zeros, zeros, zeros,
        prompt_len=p, temperature=1.0, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1,
        loss_scale=1.0,
    )
    # 7 valid tokens: sum of d^2 = .04 + .16 + .01 + 0 + .09 + .04 + .01 = 0.35
    assert stats.approx_policy_kls.item() == pytest.approx(0.5 * 0.35 / 7, abs=1e-6)
    # ratios = exp(pi - old) = exp(-d), averaged over the valid tokens only
    ratio_sum = sum(math.exp(-x) for x in (0.2, -0.4, 0.1, 0.0, 0.3, -0.2, 0.1))
    assert stats.ratios.item() == pytest.approx(ratio_sum / 7, abs=1e-6)


def test_train_step_metrics_of_a_first_step(make_recipe):
    # one minibatch of all 8 rows in 2 micro-batches, one epoch: the loss is taken at the
    # weights that generated the batch, and the policy still equals the reference
    recipe, cfg = make_recipe(ppo_batch_size=8, ppo_epochs=1)
    batch = next(iter(recipe._dataloader))
    metrics = recipe.train_step(batch["tokens"], batch["prompt_lens"], num_truncated=3)

    assert metrics["prompts_truncated"] == 3.0
    # micro-batch stats carry 1/grad_accum and are summed per minibatch: ratios of 1 log as 1
    assert metrics["ratios"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["approx_policy_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["clipfrac"] == 0.0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["rlhf_reward"] == pytest.approx(metrics["scores"], abs=1e-4)
    loss = metrics["policy_loss"] + cfg.loss.value_coeff * metrics["value_loss"]
    assert metrics["loss"] == pytest.approx(loss, abs=1e-5)
    assert 1.0 <= metrics["response_lengths"] <= cfg.max_generated_tokens
    assert 0.0 <= metrics["num_stop_tokens"] <= cfg.batch_size
    # the policy's entropy over the vocabulary, the loss's KL (k3, 0 at the reference) and the
    # critic's fit of the returns
    assert 0.0 < metrics["entropy"] < math.log(recipe._models.policy.output.out_features if hasattr(
        recipe._models.policy.output, "out_features") else 1e9)
    assert metrics["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["lmbda_actor"] == pytest.approx(cfg.lmbda)
    assert metrics["explained_variance"] <= 1.0


def test_optimizer_in_backward_takes_the_same_step(make_recipe):
    """optimizer_in_bwd: one SGD per parameter, stepped in backward, equals the ordinary step;
    two epochs over one minibatch are two steps, not one per packed micro-step."""
    bwd = dict(SGD, gradient_accumulation_steps=1, optimizer_in_bwd=True)
    plain_recipe, cfg = make_recipe(batch_size=4, ppo_epochs=2, **dict(SGD, gradient_accumulation_steps=1))
    bwd_recipe, _ = make_recipe(batch_size=4, ppo_epochs=2, **bwd)
    trajectory = _trajectory(plain_recipe, cfg, scores=torch.tensor([1.0, -2.0, 0.5, 3.0]))
    advantages, returns = _advantages(cfg, trajectory)[:2]
    before = _params(bwd_recipe)
    torch.manual_seed(0)
    _update(plain_recipe, trajectory, advantages, returns)
    torch.manual_seed(0)
    stats = _update(bwd_recipe, trajectory, advantages, returns)
    assert len(stats) == 2
    assert max((a - b).abs().max().item() for a, b in zip(_params(bwd_recipe), before)) > 1e-4
    _assert_params_close(_params(bwd_recipe), _params(plain_recipe))
    assert all(p.grad is None for p in _trained(bwd_recipe))
    state = bwd_recipe._update.optimizer.state_dict()
    assert set(state) == {"policy", "value"} and "output.weight" in state["value"]


def test_lr_scheduler_follows_optimizer_steps_and_is_saved(make_recipe):
    """torchtune's cosine schedule with warm-up, over the run's optimizer steps
    (num_ppo_steps * ppo_epochs * batch_size / ppo_batch_size = 2 * 2 * 2 = 8)."""
    recipe, cfg = make_recipe(
        num_ppo_steps=2, ppo_epochs=2, **{
            "lr_scheduler._component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps": 2,
        })
    logged = []
    recipe.train(on_step=lambda step, metrics: logged.append(metrics["lr"]))
    base = cfg.optimizer.lr
    # after 4 optimizer steps: progress (4 - 2) / 6, lr = base * (1 + cos(pi / 3)) / 2
    assert logged[0] == pytest.approx(base * 0.75, rel=1e-6)
    assert logged[1] == pytest.approx(0.0, abs=1e-12)  # 8 of 8 steps: the end of the cosine
    from torchtune_ppo.checkpointing import store as checkpointing

    state = checkpointing.load_training_state(checkpointing.latest_checkpoint(cfg.output_dir))
    assert state["lr_scheduler"]["last_epoch"] == 8
    # A resume puts the schedule back where it stopped, not at its start.
    resumed, _ = make_recipe(
        output_dir=cfg.output_dir, num_ppo_steps=2, ppo_epochs=2, resume_from_checkpoint=True, **{
            "lr_scheduler._component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps": 2,
        })
    assert resumed._update.lr_scheduler.last_epoch == 8


def test_adaptive_kl_coefficient_follows_the_logged_kl(make_recipe):
    """kl_target: each step uses the coefficient the previous step's KL moved; logged as kl_coeff."""
    recipe, cfg = make_recipe(num_ppo_steps=3, kl_coeff=0.1, kl_target=1e-4, kl_horizon=40, kl_estimator="k3")
    logged = []
    recipe.train(on_step=lambda step, metrics: logged.append(metrics))
    assert logged[0]["kl_coeff"] == pytest.approx(0.1)
    for before, after in zip(logged, logged[1:]):
        error = min(max(before["kl"] / 1e-4 - 1.0, -0.2), 0.2)
        assert after["kl_coeff"] == pytest.approx(before["kl_coeff"] * (1 + error * cfg.batch_size / 40), rel=1e-9)
    assert logged[2]["kl_coeff"] != logged[0]["kl_coeff"]


def test_critic_warmup_steps_the_value_model_only(make_recipe):
    """critic_warmup_steps=1: step 1 moves the value model only, and leaves the policy's
    optimizer state empty (AdamW with weight decay would move a parameter it stepped even with a
    zero gradient); step 2 trains both."""
    recipe, cfg = make_recipe(batch_size=4, ppo_epochs=1, critic_warmup_steps=1,
                              **{"optimizer.weight_decay": 0.1})
    trajectory = _trajectory(recipe, cfg, scores=torch.tensor([1.0, -2.0, 0.5, 3.0]))
    advantages, returns = _advantages(cfg, trajectory)[:2]
    policy, value = recipe._models.policy, recipe._models.value
    optimizer = recipe._update.optimizer

    def snapshot(model):
        return [p.detach().clone() for p in model.parameters()]

    def moved(before, model):
        return max((a - b).abs().max().item() for a, b in zip(before, model.parameters()))

    policy0, value0 = snapshot(policy), snapshot(value)
    recipe._update(trajectory, advantages, returns, PhaseTimer(CPU), step=1)
    assert moved(policy0, policy) == 0.0
    assert moved(value0, value) > 1e-5
    assert not any(p in optimizer.state for p in policy.parameters())
    assert all(optimizer.state[p]["step"] == 1 for p in value.parameters())  # one minibatch

    value1 = snapshot(value)
    recipe._update(trajectory, advantages, returns, PhaseTimer(CPU), step=2)
    assert moved(policy0, policy) > 1e-5 and moved(value1, value) > 1e-5
    assert all(optimizer.state[p]["step"] == 1 for p in policy.parameters())
    assert all(optimizer.state[p]["step"] == 2 for p in value.parameters())


def test_critic_warmup_resumes_exactly(tmp_path):
    """A run saved inside the warm-up (step 1 of 2) and resumed logs the metrics of the
    uninterrupted run and ends with its weights; the policy first moves at step 3."""
    def run(out, steps, **extra):
        cfg = recipe_config(out, num_ppo_steps=steps, critic_warmup_steps=2, save_every_n_steps=1,
                      keep_last_n_checkpoints="null", **extra)
        recipe = PPOFullFinetuneRecipe(cfg)
        recipe.setup(cfg)
        logged = {}
        try:
            recipe.train(on_step=lambda step, metrics: logged.update({step: metrics}))
        finally:
            recipe.cleanup()
        return logged

    straight = run(tmp_path / "straight", 3)
    split = {**run(tmp_path / "split", 1), **run(tmp_path / "split", 3, resume_from_checkpoint=True)}
    assert sorted(split) == [1, 2, 3]
    for step in (1, 2, 3):
        for key, value in straight[step].items():
            if not key.startswith("time/") and "per_second" not in key:
                assert split[step][key] == value or (math.isnan(value) and math.isnan(split[step][key])), (step, key)

    from safetensors.torch import load_file

    def weights(out, step, model):
        files = sorted((out / "checkpoints" / f"step_{step}" / model).glob("*.safetensors"))
        assert files, (out, step, model)
        return {k: v for f in files for k, v in load_file(f).items()}

    for model in ("policy", "value"):
        a, b = weights(tmp_path / "straight", 3, model), weights(tmp_path / "split", 3, model)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model
    p1, p2, p3 = (weights(tmp_path / "straight", s, "policy") for s in (1, 2, 3))
    assert all(torch.equal(p1[k], p2[k]) for k in p1)  # warm-up: the policy stays
    assert any(not torch.equal(p2[k], p3[k]) for k in p2)
    v1, v2 = (weights(tmp_path / "straight", s, "value") for s in (1, 2))
    assert any(not torch.equal(v1[k], v2[k]) for k in v1)


def test_value_pretraining_update_leaves_the_policy_and_the_lr_schedule(make_recipe):
    """A value pretraining update under a warm-up schedule (lr 0 at its start): the value model
    trains at optimizer.lr, the policy and its optimizer state stay, the scheduler does not move
    and the param groups get their scheduled lr back."""
    recipe, cfg = make_recipe(batch_size=4, ppo_epochs=1, **{
        "lr_scheduler._component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "lr_scheduler.num_warmup_steps": 4, "value_pretrain.max_steps": 2})
    trajectory = _trajectory(recipe, cfg, scores=torch.tensor([1.0, -2.0, 0.5, 3.0]))
    advantages, returns = _advantages(cfg, trajectory)[:2]
    policy, value = recipe._models.policy, recipe._models.value
    optimizer, scheduler = recipe._update.optimizer, recipe._update.lr_scheduler
    assert [g["lr"] for g in optimizer.param_groups] == [0.0]  # warm-up's first step

    policy0 = [p.detach().clone() for p in policy.parameters()]
    value0 = [p.detach().clone() for p in value.parameters()]
    recipe._update(trajectory, advantages, returns, PhaseTimer(CPU), step=1, value_pretrain=True)
    assert all(torch.equal(a, b) for a, b in zip(policy0, policy.parameters()))
    assert max((a - b).abs().max().item() for a, b in zip(value0, value.parameters())) > 1e-5
    assert not any(p in optimizer.state for p in policy.parameters())
    assert scheduler.last_epoch == 0 and [g["lr"] for g in optimizer.param_groups] == [0.0]

    # the same update as a PPO step: lr 0, nothing moves, the schedule advances
    value1 = [p.detach().clone() for p in value.parameters()]
    recipe._update(trajectory, advantages, returns, PhaseTimer(CPU), step=1)
    assert all(torch.equal(a, b) for a, b in zip(value1, value.parameters()))
    assert scheduler.last_epoch == 1
