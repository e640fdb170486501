"""Group sampling and the critic-free advantage estimators of issue #19, against numbers worked
by hand, and their config rules."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.config import validate_config
from torchtune_ppo.ppo import advantages as adv_module
from torchtune_ppo.config.batches import check_world_size
from torchtune_ppo.ppo.advantages import AdvantageSettings, estimate_advantages, group_metrics
from torchtune_ppo.rlhf import discounted_returns, group_baseline, repeat_prompts

from twins.ranks import on_two_ranks

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
F64 = torch.float64


def _cfg(**overrides):
    cfg = OmegaConf.load(CONFIG)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


# ---- groups -----------------------------------------------------------------------------------


def test_repeat_prompts_keeps_groups_contiguous():
    prompts, lens = torch.tensor([[0, 5], [6, 7]]), torch.tensor([1, 2])
    p, l, refs = repeat_prompts(prompts, lens, ["a", None], 3)
    assert p.tolist() == [[0, 5]] * 3 + [[6, 7]] * 3
    assert l.tolist() == [1, 1, 1, 2, 2, 2] and refs == ["a", "a", "a", None, None, None]
    same = repeat_prompts(prompts, lens, None, 1)
    assert same[0] is prompts and same[1] is lens and same[2] is None  # n = 1: today's batch, untouched


@pytest.mark.parametrize("estimator,expected", [
    # groups [1, 0] (mean 0.5, std sqrt(0.5)) and [3, 3] (std 0: advantages 0)
    ("grpo", [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0.0, 0.0]),
    ("dr_grpo", [0.5, -0.5, 0.0, 0.0]),
    ("reinforce_plus_plus_baseline", [0.5, -0.5, 0.0, 0.0]),
    ("rloo", [1.0, -1.0, 0.0, 0.0]),  # r minus the other one's reward
])
def test_group_baselines_by_hand_pairs(estimator, expected):
    out = group_baseline(torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=F64), 2, estimator)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64))


@pytest.mark.parametrize("estimator,expected", [
    # [3, 0, 0]: mean 1, unbiased std sqrt((4 + 1 + 1) / 2) = sqrt(3)
    ("grpo", [2 / (math.sqrt(3) + 1e-6), -1 / (math.sqrt(3) + 1e-6), -1 / (math.sqrt(3) + 1e-6)]),
    ("dr_grpo", [2.0, -1.0, -1.0]),
    # leave-one-out: 3 - mean(0, 0) = 3, 0 - mean(3, 0) = -1.5
    ("rloo", [3.0, -1.5, -1.5]),
])
def test_group_baselines_by_hand_triple(estimator, expected):
    out = group_baseline(torch.tensor([3.0, 0.0, 0.0], dtype=F64), 3, estimator)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64))


def test_group_baseline_needs_groups():
    with pytest.raises(ValueError, match="num_samples_per_prompt >= 2, got 1"):
        group_baseline(torch.ones(4), 1, "grpo")


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 9.0]], dtype=F64)
    masks = torch.tensor([[True, True, True, False]])
    # G2 = 3, G1 = 2 + 0.5 * 3, G0 = 1 + 0.5 * 3.5; nothing past the last valid token
    torch.testing.assert_close(discounted_returns(rewards, masks, 0.5), torch.tensor([[2.75, 3.5, 3.0, 0.0]], dtype=F64))


# ---- estimate_advantages on a scored batch ------------------------------------------------------


def _estimate(trajectory, *, kl_coeff, **settings):
    return estimate_advantages(trajectory, AdvantageSettings(**settings), kl_coeff)


def _trajectory():
    """Two rows, one group: row 0 has 3 valid tokens and score 1, row 1 has 2 and score -1.
    k1 KL d = logp - ref: row 0 [0.2, 0, -0.2], row 1 [0.4, 0.2, (invalid)]."""
    valid = torch.tensor([[True, True, True], [True, True, False]])
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]], dtype=F64)
    ref = logprobs - torch.tensor([[0.2, 0.0, -0.2], [0.4, 0.2, 0.0]], dtype=F64)
    return SimpleNamespace(
        scores=torch.tensor([1.0, -1.0], dtype=F64), logprobs=logprobs * valid, ref_logprobs=ref * valid,
        seq_lens=torch.tensor([3, 2]), response_padding_masks=~valid, values=torch.zeros(2, 3, dtype=F64),
    )


def _advantages(estimator, n=2):
    return _estimate(_trajectory(), kl_coeff=0.5, gamma=1.0, lmbda=0.95, whiten_rewards=False,
                               advantage_estimator=estimator, num_samples_per_prompt=n)


# rewards -0.5 d, score on the last valid token: row 0 [-0.1, 0, 1.1] (sum 1.0), row 1 [-0.2, -1.1] (sum -1.3)
@pytest.mark.parametrize("estimator,row0,row1", [
    ("grpo", 1.15 / (1.15 * math.sqrt(2) + 1e-6), -1.15 / (1.15 * math.sqrt(2) + 1e-6)),  # mean -0.15
    ("dr_grpo", 1.15, -1.15),
    ("rloo", 2.3, -2.3),
])
def test_outcome_estimators_by_hand(estimator, row0, row1):
    out = _advantages(estimator)
    expected = torch.tensor([[row0] * 3, [row1, row1, 0.0]], dtype=F64)
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected)


def test_reinforce_plus_plus_by_hand():
    out = _advantages("reinforce_plus_plus", n=1)
    # returns-to-go: row 0 [1.0, 1.1, 1.1], row 1 [-1.3, -1.1]; over the 5 valid tokens mean 0.16,
    # deviations [0.84, 0.94, 0.94, -1.46, -1.26], unbiased variance 6.192 / 4
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.1, 1.1], [-1.3, -1.1, 0.0]], dtype=F64))
    std = math.sqrt(6.192 / 4 + 1e-8)
    expected = torch.tensor([[0.84, 0.94, 0.94], [-1.46, -1.26, 0.0]], dtype=F64) / std
    torch.testing.assert_close(out.advantages, expected)


def test_reinforce_plus_plus_baseline_by_hand():
    out = _advantages("reinforce_plus_plus_baseline")
    # r - group mean = +-1.15 on each valid token: [1.15] * 3, [-1.15] * 2; mean 0.23, deviations
    # [0.92] * 3, [-1.38] * 2, unbiased variance (3 * 0.8464 + 2 * 1.9044) / 4
    std = math.sqrt(6.348 / 4 + 1e-8)
    expected = torch.tensor([[0.92, 0.92, 0.92], [-1.38, -1.38, 0.0]], dtype=F64) / std
    torch.testing.assert_close(out.advantages, expected)


def test_gae_is_the_default():
    from torchtune_ppo import rlhf

    traj = _trajectory()
    traj.values = torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, 0.0]], dtype=F64)
    out = _estimate(traj, kl_coeff=0.5, gamma=0.9, lmbda=0.8, whiten_rewards=False)
    valid = ~traj.response_padding_masks
    rewards = rlhf.get_rewards_ppo(traj.scores, traj.logprobs, traj.ref_logprobs, 0.5, traj.seq_lens, valid)[0]
    gae, returns = rlhf.gae_advantages(traj.values, rewards, 0.9, 0.8, valid)
    assert torch.equal(out.advantages, gae) and torch.equal(out.returns, returns)


def test_two_ranks_give_the_one_process_advantages(monkeypatch):
    """Each rank holds whole groups (it repeats its own prompts): the group baselines are local,
    the whitening sums over both ranks. Two threads stand in for the ranks."""
    g = torch.Generator().manual_seed(0)
    b, T, n = 8, 5, 2
    counts = torch.tensor([5, 1, 3, 2, 4, 5, 2, 1])
    valid = torch.arange(T)[None, :] < counts[:, None]
    logprobs = -torch.rand(b, T, generator=g, dtype=F64) * valid
    traj = SimpleNamespace(
        scores=torch.randn(b, generator=g, dtype=F64), logprobs=logprobs,
        ref_logprobs=(logprobs + 0.1 * torch.randn(b, T, generator=g, dtype=F64)) * valid,
        seq_lens=counts, response_padding_masks=~valid, values=torch.zeros(b, T, dtype=F64),
    )
    kw = dict(kl_coeff=0.1, gamma=0.9, lmbda=0.95, whiten_rewards=False, num_samples_per_prompt=n)
    estimators = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
    one = {e: _estimate(traj, advantage_estimator=e, **kw).advantages for e in estimators}
    one_metrics = group_metrics(traj.scores, n)

    def rank(r):
        rows = slice(r * b // 2, (r + 1) * b // 2)
        part = SimpleNamespace(**{k: v[rows] for k, v in vars(traj).items()})
        out = {e: _estimate(part, advantage_estimator=e, **kw).advantages for e in estimators}
        out["metrics"] = group_metrics(part.scores, n)
        return out

    results = on_two_ranks(monkeypatch, rank)
    for e in estimators:
        torch.testing.assert_close(torch.cat([results[0][e], results[1][e]]), one[e], rtol=1e-12, atol=1e-12)
    assert results[0]["metrics"] == results[1]["metrics"] == pytest.approx(one_metrics, rel=1e-12)
    assert not torch.equal(one["reinforce_plus_plus"], discounted_returns(
        torch.zeros(b, T), valid, 0.9))  # not vacuous


def test_group_metrics_by_hand():
    m = group_metrics(torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0]), 2)
    # group stds 0, sqrt(2), 0
    assert m == pytest.approx({"group_score_std": math.sqrt(2) / 3, "zero_std_groups": 2 / 3})


# ---- config -------------------------------------------------------------------------------------


def test_defaults_keep_ppo():
    cfg = validate_config(_cfg())
    assert cfg.advantage_estimator == "gae" and cfg.num_samples_per_prompt == 1
    assert cfg.value_checkpointer is not None


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "reinforce_plus_plus_baseline"])
def test_group_estimators_need_two_samples(estimator):
    with pytest.raises(ValueError, match=rf"advantage_estimator={estimator} compares the responses to the "
                                         r"same prompt, so num_samples_per_prompt must be at least 2, got 1"):
        validate_config(_cfg(advantage_estimator=estimator))


def test_critic_free_run_ignores_the_value_checkpointer():
    cfg = validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=4))
    assert cfg.value_checkpointer is None  # noted, then dropped: nothing loads or saves a value model
    no_value = _cfg(advantage_estimator="reinforce_plus_plus")
    del no_value["value_checkpointer"]
    assert validate_config(no_value).value_checkpointer is None


def test_gae_needs_a_value_checkpointer():
    cfg = _cfg()
    del cfg["value_checkpointer"]
    with pytest.raises(ValueError, match="advantage_estimator=gae trains a value model: give value_checkpointer"):
        validate_config(cfg)


def test_responses_per_step_must_split_into_batches():
    # 8 prompts x 3 = 24 responses; forward_batch_size 16 does not divide them
    with pytest.raises(ValueError, match=r"forward_batch_size \(16\) counts responses and must divide "
                                         r"batch_size \* num_samples_per_prompt \(8 prompts \* 3 = 24 "
                                         r"responses a step\); e.g. forward_batch_size=12"):
        validate_config(_cfg(batch_size=8, num_samples_per_prompt=3, forward_batch_size=16, ppo_batch_size=8))
    # 32 prompts x 2: ppo_batch_size 64 (> batch_size) is one minibatch of every response
    cfg = validate_config(_cfg(num_samples_per_prompt=2, advantage_estimator="rloo", ppo_batch_size=64))
    assert cfg.ppo_batch_size == 64


@pytest.mark.parametrize("key,value,message", [
    ("advantage_estimator", "ppo", r"advantage_estimator must be one of \['gae', 'grpo', 'dr_grpo', 'rloo', "
                                   r"'reinforce_plus_plus', 'reinforce_plus_plus_baseline'\], got 'ppo'"),
    ("num_samples_per_prompt", 0, r"num_samples_per_prompt must be a positive integer, got 0"),
])
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**{key: value}))


def test_whiten_rewards_is_gae_only():
    with pytest.raises(ValueError, match="whiten_rewards=True whitens the rewards before GAE; "
                                         "advantage_estimator=rloo uses no GAE"):
        validate_config(_cfg(advantage_estimator="rloo", num_samples_per_prompt=2, whiten_rewards=True))


def test_memory_plan_of_a_critic_free_run_has_no_value_model():
    from torchtune_ppo.run import memory
    from torchtune_ppo.tasks.tiny_sentiment import tiny_policy, tiny_reward

    n_policy = sum(p.numel() for p in tiny_policy().parameters())
    n_value = sum(p.numel() for p in tiny_reward().parameters())
    ppo = memory.memory_plan(validate_config(_cfg()))
    grpo = memory.memory_plan(validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=2)))
    ppo_rows, grpo_rows = list(ppo.rows.values()), list(grpo.rows.values())
    assert ppo_rows[1] == 2 * n_value * 4 and grpo_rows[1] == n_value * 4  # the reward model only
    assert ppo_rows[2] == (n_policy + n_value) * 4 and grpo_rows[2] == n_policy * 4  # gradients
    assert ppo_rows[3] == 2 * (n_policy + n_value) * 4 and grpo_rows[3] == 2 * n_policy * 4  # AdamW state
    assert grpo_rows[5] < ppo_rows[5]  # activations of the policy's layers only
    assert "no value model" in grpo.table() and "policy + value" in ppo.table()


def test_a_rounding_error_apart_counts_as_zero_std():
    # the same response packed at another position can score 1e-7 apart
    m = group_metrics(torch.tensor([0.5, 0.5 + 1e-7, 0.0, 1.0]), 2)
    assert m["zero_std_groups"] == 0.5


def test_reward_and_value_model_only_where_a_model_needs_it():
    arithmetic = OmegaConf.load(CONFIG.parent / "grpo_tiny_arithmetic.yaml")  # a function reward, GRPO
    assert "reward_and_value_model" not in arithmetic and "value_checkpointer" not in arithmetic
    cfg = validate_config(arithmetic)
    assert cfg.reward_and_value_model is None and cfg.advantage_estimator == "grpo"
    from torchtune_ppo.run import memory

    assert "no value model" in memory.memory_plan(cfg).table()
    sentiment = _cfg(advantage_estimator="grpo", num_samples_per_prompt=2)
    del sentiment["reward_and_value_model"]  # its reward model is built by it
    with pytest.raises(ValueError, match=r"reward_and_value_model is null, but the run needs a reward model "
                                         r"\(reward_checkpointer\) built by it"):
        validate_config(sentiment)
    ppo = OmegaConf.merge(arithmetic, {"advantage_estimator": "gae", "num_samples_per_prompt": 1, "batch_size": 64})
    with pytest.raises(ValueError, match=r"needs a value model \(advantage_estimator=gae\) built by it"):
        validate_config(ppo)


def test_checkpoint_of_a_critic_free_run_holds_the_policy_only(tmp_path):
    from torchtune import config, training

    from torchtune_ppo.checkpointing import store

    block = OmegaConf.create({
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": torchtune_ppo.asset_path("tiny_sentiment/policy"),
        "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA2", "output_dir": str(tmp_path / "x"),
    })
    policy = config.instantiate(block).load_checkpoint()[training.MODEL_KEY]
    manager = store.CheckpointManager(tmp_path / "run", block, None)
    with pytest.raises(ValueError, match=r"a value state dict \(or value adapters\) goes with a value checkpointer, got one and none"):
        manager.save(1, policy, policy, {"step": 1})
    path = manager.save(1, policy, None, {"step": 1})
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "policy", "training_state.pt"]
    assert store.latest_checkpoint(tmp_path / "run", verify=True) == path  # complete without value/
    assert list(store.checkpointer_overrides(path)) == ["policy"]
    # a marker that lists no policy weights is still refused
    marker = json.loads((path / store.MARKER_FNAME).read_text())
    marker["checkpoint_files"] = {}
    (path / store.MARKER_FNAME).write_text(json.dumps(marker))
    assert store.latest_checkpoint(tmp_path / "run") is None


# ---- with the loss options, decoupled GAE, critic warm-up and LoRA ----------------------------


@pytest.mark.parametrize("key,value,fix", [
    ("critic_warmup_steps", 3, "critic_warmup_steps=0"),
    ("lmbda_actor", 0.9, "lmbda_actor=null"),
    ("lmbda_actor", 0.0, "lmbda_actor=null"),  # 0 is a lambda, not off
    ("lmbda_length_alpha", 0.05, "lmbda_length_alpha=null"),
])
@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_critic_options_are_refused_without_a_critic(estimator, key, value, fix):
    n = 1 if estimator == "reinforce_plus_plus" else 2
    with pytest.raises(ValueError, match=rf"{key}={value} is for the value model and GAE; "
                                         rf"advantage_estimator={estimator} has neither \(no critic\)\. Set {fix}"):
        validate_config(_cfg(advantage_estimator=estimator, num_samples_per_prompt=n, **{key: value}))
    # the same keys with gae are accepted
    validate_config(_cfg(**{key: value}))


def test_loss_options_are_accepted_without_a_critic():
    cfg = validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=2, kl_coeff=0.0,
                               **{"loss.entropy_coeff": 0.01, "loss.kl_coeff": 0.1, "loss.kl_estimator": "k3+"}))
    assert cfg.loss.entropy_coeff == 0.01 and cfg.loss.kl_coeff == 0.1 and cfg.loss.kl_estimator == "k3+"


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_critic_free_advantages_log_no_explained_variance_or_actor_lambda(estimator):
    out = _advantages(estimator)
    assert out.lmbda_actor is None and out.explained_variance is None
    metrics = adv_module.advantage_metrics(out)
    assert set(metrics) == {"explained_variance", "lmbda_actor"}
    assert all(math.isnan(v) for v in metrics.values())
    with pytest.raises(ValueError, match=rf"lmbda_actor and lmbda_length_alpha are GAE's; advantage_estimator "
                                         rf"'{estimator}' takes neither, got 0.9 and None"):
        _estimate(_trajectory(), kl_coeff=0.5, gamma=1.0, lmbda=0.95, whiten_rewards=False,
                            advantage_estimator=estimator, num_samples_per_prompt=2, lmbda_actor=0.9)


def test_gae_still_logs_explained_variance_and_actor_lambda():
    out = _estimate(_trajectory(), kl_coeff=0.5, gamma=1.0, lmbda=0.95, whiten_rewards=False,
                              lmbda_actor=0.5)
    metrics = adv_module.advantage_metrics(out)
    assert metrics["lmbda_actor"] == 0.5 and math.isfinite(metrics["explained_variance"])


def test_memory_plan_of_a_critic_free_lora_run():
    from torchtune_ppo.run import memory
    from torchtune_ppo.tasks.tiny_sentiment import tiny_lora_policy, tiny_lora_reward, tiny_reward

    lora_cfg = OmegaConf.load(CONFIG.parent / "ppo_tiny_sentiment_lora.yaml")  # LoRA policy and value model
    grpo = OmegaConf.merge(lora_cfg, {"advantage_estimator": "grpo", "num_samples_per_prompt": 2})
    plan = memory.memory_plan(validate_config(grpo))
    policy = tiny_lora_policy(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)
    n_policy = sum(p.numel() for p in policy.parameters())
    n_adapters = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    # the reward_and_value_model block builds only the reward model here, its adapters off
    n_reward = sum(p.numel() for p in tiny_lora_reward(["q_proj", "k_proj", "v_proj", "output_proj"],
                                                       apply_lora_to_mlp=True).parameters())
    names, rows = list(plan.rows), list(plan.rows.values())
    assert "reference: the base" in names[0] and rows[0] == n_policy * 4  # one copy: policy and reference
    assert "no value model" in names[1] and rows[1] == n_reward * 4  # the frozen reward model only
    assert names[2] == "gradients (policy adapters)" and rows[2] == n_adapters * 4
    assert rows[3] == 2 * n_adapters * 4  # AdamW state of the adapters only
    # with a full reward model, its own parameters
    full_reward = OmegaConf.merge(grpo, {})
    full_reward.reward_and_value_model = {"_component_": "torchtune_ppo.tasks.tiny_sentiment.tiny_reward"}
    rows = list(memory.memory_plan(validate_config(full_reward)).rows.values())
    n_full_reward = sum(p.numel() for p in tiny_reward().parameters())
    assert n_full_reward != n_reward and rows[1] == n_full_reward * 4 and rows[2] == n_adapters * 4


def test_checkpoint_of_a_critic_free_lora_run_holds_the_policy_adapters_only(tmp_path):
    from torchtune import config, training

    from torchtune_ppo.checkpointing import store

    block = OmegaConf.create({
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": torchtune_ppo.asset_path("tiny_sentiment/policy"),
        "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA2", "output_dir": str(tmp_path / "x"),
    })
    policy = config.instantiate(block).load_checkpoint()[training.MODEL_KEY]
    adapter = ({"layers.0.attn.q_proj.lora_a.weight": torch.ones(2, 4)},
               {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}, {})
    manager = store.CheckpointManager(tmp_path / "run", block, None)
    with pytest.raises(ValueError, match=r"a value state dict \(or value adapters\) goes with a value "
                                         r"checkpointer, got one and none"):
        manager.save(1, None, None, {"step": 1}, adapters={"policy": adapter, "value": adapter})
    path = manager.save(1, None, None, {"step": 1}, adapters={"policy": adapter})
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "policy", "training_state.pt"]
    assert store.latest_checkpoint(tmp_path / "run", verify=True) == path  # adapters only, no value/
    marker = json.loads((path / store.MARKER_FNAME).read_text())
    assert marker["adapter_files"]["policy"] and "value" not in marker["adapter_files"]
    marker["adapter_files"] = {}  # then neither weights nor adapters of the policy: refused
    (path / store.MARKER_FNAME).write_text(json.dumps(marker))
    assert store.latest_checkpoint(tmp_path / "run") is None


def test_share_group_prefill_needs_whole_groups_per_generation_call():
    assert validate_config(_cfg()).share_group_prefill is None  # default: on wherever the sizes allow
    ok = validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=4, share_group_prefill=True))
    assert ok.forward_batch_size % 4 == 0
    with pytest.raises(ValueError, match=r"forward_batch_size=4 is not a multiple of num_samples_per_prompt=8 \(the group size\): "
                                         r"one prefill per group.*forward_batch_size=8"):
        validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=8, forward_batch_size=4,
                             ppo_batch_size=16, share_group_prefill=True))
    # off, or n = 1: any forward_batch_size that divides the step's rows
    validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=8, forward_batch_size=4,
                         ppo_batch_size=16))
    validate_config(_cfg(share_group_prefill=True))
    with pytest.raises(ValueError, match="share_group_prefill=True with compile.rollout=True"):
        validate_config(_cfg(num_samples_per_prompt=2, share_group_prefill=True, **{"compile.rollout": True}))
    with pytest.raises(ValueError, match="share_group_prefill must be null or true or false, got 'maybe'"):
        validate_config(_cfg(share_group_prefill="maybe"))
    cfg = validate_config(_cfg(advantage_estimator="grpo", num_samples_per_prompt=4, share_group_prefill=True))
    with pytest.raises(ValueError, match="forward_batch_size=16 over 8 processes gives 2 rows per rank is not a "
                                         "multiple of num_samples_per_prompt=4"):
        check_world_size(OmegaConf.merge(cfg, {"batch_size": 32, "ppo_batch_size": 16}), 8)


def test_grpo_gives_a_group_within_rounding_of_equal_no_advantage():
    """Equal responses scored a rounding error apart (std 5e-8 here) get 0, not (r - mean) / 1e-6;
    a group with a real spread keeps the formula."""
    rounding = torch.tensor([3.0, 3.0 + 2.4e-7, 3.0, 3.0])  # float32 steps near 3 are 2.4e-7
    spread = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out = group_baseline(torch.cat([rounding, spread]), 4, "grpo")
    assert out[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    std = math.sqrt(0.25)  # unbiased: sum of squares 0.75 / 3
    expected = [0.75 / (std + 1e-6), -0.25 / (std + 1e-6), -0.25 / (std + 1e-6), -0.25 / (std + 1e-6)]
    assert out[4:].tolist() == pytest.approx(expected, rel=1e-6)
    # dr_grpo and rloo do not divide: their advantages stay the rounding error they are
    assert group_baseline(rounding, 4, "dr_grpo").abs().max() < 1e-6
