"""How recipes/ppo_full_finetune.py connects the library's pieces, checked on the tiny task in
this process: the LoRA reference is the base model after the adapters moved, infinite scores or
KL skip the step and leave the KL controller alone, value pretraining's own lambda and the KL
controller across it, every must-match resume key refused, and the pretraining stop rule at
its boundaries."""

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.checkpointing import resume_config as rc
from torchtune_ppo.config.schema import MUST_MATCH
from torchtune_ppo.ppo.value_pretrain import ValuePretraining, relative_change, settled
from torchtune_ppo.run.progress import Progress

from conftest import recipe_config


def _first_batch(recipe):
    batch = next(iter(recipe._dataloader))
    return batch["tokens"], batch["prompt_lens"]


def _record_rollouts(recipe, change=None):
    """Wraps the recipe's rollout: each trajectory (after ``change``, if given) is recorded."""
    rollout, seen = recipe._rollout, []

    def recorded(*args, **kwargs):
        trajectory = rollout(*args, **kwargs)
        trajectory = change(trajectory) if change is not None else trajectory
        seen.append(trajectory)
        return trajectory

    recipe._rollout = recorded
    return seen


class _UpdateSpy:
    """The recipe's PPOUpdate, recording what each call was given."""

    def __init__(self, update):
        self._inner, self.calls = update, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, trajectory, advantages, returns, timer, step, value_pretrain=False):
        self.calls.append(dict(trajectory=trajectory, returns=returns, value_pretrain=value_pretrain))
        return self._inner(trajectory, advantages, returns, timer, step, value_pretrain=value_pretrain)


def _weights(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


def _max_change(before, models):
    return max((a - b).abs().max().item() for a, b in zip(before, (p for m in models for p in m.parameters())))


# ---- LoRA: the reference is the base model, whatever the adapters have become ----------------


@pytest.mark.slow  # runs the LoRA config's steps
def test_lora_reference_logprobs_are_the_base_models_after_the_adapters_moved(make_recipe, tmp_path):
    recipe, cfg = make_recipe("ppo_tiny_sentiment_lora.yaml", **{"optimizer.lr": 1e-2})
    prompts, prompt_lens = _first_batch(recipe)
    recipe.train_step(prompts, prompt_lens, 0)  # step 1 moves the adapters
    adapters = [p for n, p in recipe._models.policy.named_parameters() if "lora_b" in n]
    assert adapters and max(p.abs().max().item() for p in adapters) > 1e-3
    seen = _record_rollouts(recipe)
    recipe.train_step(prompts, prompt_lens, 0)
    (traj,) = seen

    # the base: the plain task policy with the base checkpoint, a model of its own
    from torchtune_ppo.tasks.tiny_sentiment import tiny_policy

    base = tiny_policy()
    checkpointer = tt_config.instantiate(cfg.checkpointer, output_dir=str(tmp_path / "base"))
    base.load_state_dict(checkpointer.load_checkpoint()["model"])
    base.eval()
    p = cfg.max_prompt_len
    with torch.no_grad():
        logits = base(traj.query_responses, mask=traj.masks, input_pos=traj.position_ids)
    logprobs = torch.log_softmax(logits[:, p - 1 : -1].float() / float(cfg.temperature), -1)
    base_logprobs = logprobs.gather(2, traj.query_responses[:, p:, None]).squeeze(-1)
    valid = ~traj.response_padding_masks
    torch.testing.assert_close(traj.ref_logprobs[valid], base_logprobs[valid], atol=1e-5, rtol=1e-5)
    # not vacuous: the policy with its adapters on gives other logprobs
    assert (traj.logprobs - base_logprobs)[valid].abs().max() > 1e-3


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_lora_models_add_the_adapter_term_inside_the_base_product_in_bf16(make_recipe, dtype):
    """bf16: every trained model's adapters are ``OneRoundingLoRALinear`` (the term rounded once with
    the base product); fp32 keeps torchtune's ``LoRALinear`` as it is."""
    from torchtune.modules.peft import LoRALinear

    from torchtune_ppo.lora import OneRoundingLoRALinear

    recipe, cfg = make_recipe("ppo_tiny_sentiment_lora.yaml", dtype=dtype)
    for name in ("policy", "value"):
        kinds = {type(m) for m in getattr(recipe._models, name).modules() if isinstance(m, LoRALinear)}
        assert kinds == ({OneRoundingLoRALinear} if dtype == "bf16" else {LoRALinear}), (name, kinds)
    # and a checkpoint of them is written as before: the adapters' PEFT config, rank and alpha
    import json
    from pathlib import Path

    path = Path(recipe.save_checkpoint(1))
    configs = sorted(path.rglob("adapter_config.json"))
    assert configs, sorted(p.name for p in path.rglob("*"))
    adapter = json.loads(configs[0].read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (cfg.policy_model.lora_rank, cfg.policy_model.lora_alpha)


# ---- infinite scores and KL through the recipe's step ---------------------------------------


def _inf_score(sign):
    def change(t):
        return t._replace(scores=torch.where(torch.arange(len(t.scores)) == 1, sign * math.inf, t.scores))
    return change


def _inf_kl(sign):
    """k1 KL +inf (the reference gives the first token probability 0) or -inf (the policy does)."""
    def change(t):
        field = "ref_logprobs" if sign > 0 else "logprobs"
        x = getattr(t, field).clone()
        x[0, 0] = -math.inf
        return t._replace(**{field: x})
    return change


@pytest.mark.slow  # sets up the tiny config
@pytest.mark.parametrize("change,bad_rows,kl", [
    (_inf_score(1), 1, None), (_inf_score(-1), 1, None), (_inf_kl(1), 0, math.inf), (_inf_kl(-1), 0, -math.inf),
], ids=["score+inf", "score-inf", "kl+inf", "kl-inf"])
def test_an_infinite_score_or_kl_skips_the_step_and_leaves_the_kl_controller_finite(make_recipe, change, bad_rows, kl):
    """A step with a +-inf score gets no update (counted as non-finite rows); one with a +-inf
    KL gets NaN advantages and each minibatch update is skipped by the loss check. Either way
    the weights stay, the step counts as skipped, and the adaptive KL coefficient stays finite:
    adapted by the step's KL when that is finite, left as it was when it is not."""
    recipe, cfg = make_recipe(kl_coeff=0.1, kl_target=1e-4, kl_horizon=40)
    models = (recipe._models.policy, recipe._models.value)
    before = _weights(*models)
    rollout = recipe._rollout
    _record_rollouts(recipe, change)
    metrics = recipe.train_step(*_first_batch(recipe), 0)

    assert metrics["nonfinite_score_rows"] == bad_rows
    assert metrics["skipped_updates"] == recipe._update.num_updates == 4  # 2 epochs x 2 minibatches
    assert recipe._skipped.total == 1 and metrics["skipped_steps"] == 1
    assert _max_change(before, models) == 0.0
    assert metrics["kl_coeff"] == 0.1 and math.isfinite(recipe._kl.value)
    if kl is not None:
        assert metrics["kl"] == kl
        assert recipe._kl.value == 0.1
    else:  # the KL of the rollout is finite: the coefficient follows it, as after any step
        error = min(max(metrics["kl"] / 1e-4 - 1.0, -0.2), 0.2)
        assert recipe._kl.value == pytest.approx(0.1 * (1 + error * cfg.batch_size / 40), rel=1e-12)
    # a finite step after it updates and adapts the coefficient from where it is
    recipe._rollout = rollout
    coeff = recipe._kl.value
    finite = recipe.train_step(*_first_batch(recipe), 0)
    assert finite["skipped_updates"] == 0 and recipe._skipped.consecutive == 0
    assert _max_change(before, models) > 0.0
    error = min(max(finite["kl"] / 1e-4 - 1.0, -0.2), 0.2)
    assert recipe._kl.value == pytest.approx(coeff * (1 + error * cfg.batch_size / 40), rel=1e-12)


# ---- value pretraining: its own lambda, and the KL controller left alone ---------------------


def _hand_returns(traj, kl_coeff, gamma, lmbda):
    """GAE returns (advantages + values) of the k1-KL-penalised rewards, one token at a time."""
    out = torch.zeros_like(traj.values, dtype=torch.float64)
    for i in range(len(traj.scores)):
        n = int((~traj.response_padding_masks[i]).sum())
        values = traj.values[i, :n].double().tolist() + [0.0]
        rewards = [-kl_coeff * (traj.logprobs[i, t] - traj.ref_logprobs[i, t]).item() for t in range(n)]
        rewards[-1] += traj.scores[i].item()
        advantage = 0.0
        for t in reversed(range(n)):
            advantage = rewards[t] + gamma * values[t + 1] - values[t] + gamma * lmbda * advantage
            out[i, t] = advantage + values[t]
    return out


@pytest.mark.slow  # runs the tiny config's steps
@pytest.mark.parametrize("lmbda,pretrain_lmbda", [(0.5, 1.0), (1.0, 0.5)])
def test_value_pretraining_uses_its_own_lambda_and_does_not_adapt_the_kl_coefficient(
        make_recipe, lmbda, pretrain_lmbda):
    """One pretraining step, then one PPO step: the pretraining step's returns are GAE's with
    ``value_pretrain.lmbda``, the PPO step's with ``lmbda``; the adaptive KL coefficient is
    the same at both (pretraining does not adapt it) and moves after the PPO step."""
    recipe, cfg = make_recipe(num_ppo_steps=1, gamma=0.9, lmbda=lmbda, kl_coeff=0.1, kl_target=1e-4,
                              kl_horizon=40, **{"value_pretrain.max_steps": 1,
                                                "value_pretrain.lmbda": pretrain_lmbda})
    spy = recipe._update = _UpdateSpy(recipe._update)
    logged = []
    recipe.train(on_step=lambda step, metrics: logged.append(metrics))

    assert [c["value_pretrain"] for c in spy.calls] == [True, False]
    assert [m["value_pretrain"] for m in logged] == [1.0, 0.0]
    for call, used in zip(spy.calls, (pretrain_lmbda, lmbda)):
        expected = _hand_returns(call["trajectory"], 0.1, 0.9, used)
        other = _hand_returns(call["trajectory"], 0.1, 0.9, lmbda + pretrain_lmbda - used)
        valid = ~call["trajectory"].response_padding_masks
        torch.testing.assert_close(call["returns"][valid].double(), expected[valid], atol=1e-5, rtol=1e-5)
        assert (other - expected)[valid].abs().max() > 1e-2  # the other lambda gives other returns
    # the policy equals the reference during pretraining: KL ~0, far below the target, so an
    # adapted coefficient would have dropped by 0.2 * 8 / 40 = 4%
    assert abs(logged[0]["kl"]) < 1e-3
    assert logged[0]["kl_coeff"] == logged[1]["kl_coeff"] == 0.1
    error = min(max(logged[1]["kl"] / 1e-4 - 1.0, -0.2), 0.2)
    assert recipe._kl.value == pytest.approx(0.1 * (1 + error * cfg.batch_size / 40), rel=1e-12)
    assert recipe._kl.value != 0.1


# ---- every must-match key refused on resume --------------------------------------------------


def _flat(d, prefix=""):
    if isinstance(d, dict) and d:
        return {k: v for key, sub in d.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: d}


def _set(d, dotted, value):
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[last] = value


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return [*value, 1]
    return "other"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint folder holding the tiny config, as a run saves it."""
    folder = tmp_path_factory.mktemp("ckpt") / "step_1"
    folder.mkdir()
    saved = rc.config_to_save(recipe_config("/runs/a", **{"lr_scheduler._component_": "torchtune.training.lr_schedulers"
                                                     ".get_cosine_schedule_with_warmup",
                                                     "lr_scheduler.num_warmup_steps": 1}))
    (folder / rc.CONFIG_FNAME).write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    return folder, saved


@pytest.mark.parametrize("key", MUST_MATCH)
def test_every_must_match_key_changed_is_refused_on_resume(saved_run, key):
    folder, saved = saved_run
    new = copy.deepcopy(saved)
    new.update(output_dir="/runs/b", resume_from_checkpoint=True)
    assert rc.check_resume_config(folder, new) == []  # the same config resumes
    leaves = sorted(k for k in _flat(saved) if k == key or k.startswith(key + "."))
    changed = leaves[0] if leaves else key
    _set(new, changed, _other(_flat(saved).get(changed)))
    with pytest.raises(rc.ResumeConfigError) as err:
        rc.check_resume_config(folder, new)
    assert f"\n  {changed}: saved " in str(err.value)
    assert str(err.value).count(", now ") == 1


def test_the_keys_the_saved_state_depends_on_must_match():
    # resume_config's docstring: the data position (batch_size), the epoch permutation (seed,
    # shuffle, dataset), the LR schedule's optimizer steps (ppo_batch_size, ppo_epochs,
    # gradient_accumulation_steps, and the responses a step: num_samples_per_prompt), the
    # optimizer state (its class), the models the builders make
    for key in ("batch_size", "seed", "shuffle", "dataset", "ppo_batch_size", "ppo_epochs",
                "gradient_accumulation_steps", "num_samples_per_prompt", "optimizer._component_",
                "lr_scheduler._component_", "policy_model", "reward_and_value_model"):
        assert key in MUST_MATCH, key


def test_a_key_that_may_change_is_taken_with_a_note(saved_run):
    folder, saved = saved_run
    new = copy.deepcopy(saved)
    new.update(num_ppo_steps=saved["num_ppo_steps"] + 5, output_dir="/runs/b")
    new["optimizer"]["lr"] = 1e-5
    assert rc.check_resume_config(folder, new) == ["num_ppo_steps", "optimizer.lr"]


# ---- the value pretraining stop rule at its boundaries ---------------------------------------

# window 2: M_4 = mean(6, 6) = 6 against M_2 = mean(8, 8) = 8: a relative change of exactly 0.25
BOUNDARY = [8.0, 8.0, 6.0, 6.0]


def test_a_relative_change_exactly_at_the_tolerance_does_not_end_pretraining():
    assert relative_change(BOUNDARY, 2) == 0.25
    assert not settled(BOUNDARY, 2, 0.25)  # "below tolerance": strictly
    assert settled(BOUNDARY, 2, 0.25 + 1e-12)
    at = ValuePretraining(max_steps=10, tolerance=0.25, window=2, lmbda=1.0)
    above = ValuePretraining(max_steps=10, tolerance=0.2500001, window=2, lmbda=1.0)
    for loss in BOUNDARY:
        at.record(loss)
        above.record(loss)
    assert not at.done and above.done


def test_the_rule_needs_exactly_two_windows_of_losses():
    # equal losses: a relative change of 0 as soon as there are 2 windows of them, not before
    for window in (1, 2, 3):
        losses = [5.0] * (2 * window)
        assert relative_change(losses[:-1], window) is None
        assert not settled(losses[:-1], window, 0.5)
        assert relative_change(losses, window) == 0.0 and settled(losses, window, 0.5)
        pretrain = ValuePretraining(max_steps=100, tolerance=0.5, window=window, lmbda=1.0)
        for k, loss in enumerate(losses, 1):
            pretrain.record(loss)
            assert pretrain.done == (k == 2 * window), (window, k)


@pytest.mark.parametrize("max_steps", [1, 2, 3])
def test_max_steps_ends_pretraining_exactly_there_and_ppo_steps_follow(max_steps):
    pretrain = ValuePretraining(max_steps=max_steps, tolerance=None, window=1, lmbda=1.0)
    progress = Progress(num_ppo_steps=2, batches_per_epoch=100, value_pretrain=pretrain)
    phases = []
    while not progress.done:
        pretraining = progress.pretraining
        phases.append(pretraining)
        progress.count_step({"value_loss": 1.0}, pretraining)
    assert phases == [True] * max_steps + [False, False]
    assert pretrain.steps_run == max_steps and progress.steps_run == 2
    assert progress.global_step == max_steps + 2


def test_a_step_without_a_finite_value_loss_still_counts_towards_max_steps():
    pretrain = ValuePretraining(max_steps=3, tolerance=0.1, window=1, lmbda=1.0)
    for k, loss in enumerate([float("nan"), 4.0, float("inf")], 1):
        pretrain.record(loss)
        assert pretrain.done == (k == 3)
    assert pretrain.losses == [4.0]


# ---- the data order across epochs, and scoring's settings ---------------------------------


@pytest.mark.slow
def test_each_epoch_sees_the_prompts_in_a_new_order(make_recipe, tmp_path):
    """``shuffle: True`` draws a new order every epoch: the sampler is told the epoch."""
    import json

    with open(torchtune_ppo.asset_path("tiny_sentiment/prompts.json")) as f:
        data = tmp_path / "prompts.json"
        data.write_text(json.dumps(json.load(f)[:16]))  # 2 batches of 8 an epoch
    recipe, _ = make_recipe(**{"dataset.data_files": str(data), "num_ppo_steps": 4, "shuffle": True})
    seen, train_step = [], recipe.train_step

    def recording(prompts, *args, **kwargs):
        seen.append(prompts.clone())
        return train_step(prompts, *args, **kwargs)

    recipe.train_step = recording
    recipe.train()
    assert len(seen) == 4
    first, second = torch.cat(seen[:2]), torch.cat(seen[2:])
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))  # the same prompts
    assert not torch.equal(first, second)  # in another order


@pytest.mark.slow
def test_scoring_takes_the_configs_penalties_and_temperature(make_recipe):
    recipe, _ = make_recipe(min_response_length=5, penalise_no_eos=False, reward_penalty=-7.0, temperature=0.9)
    s = recipe._rollout.settings
    assert (s.min_response_length, s.penalise_no_eos, s.reward_penalty, s.temperature) == (5, False, -7.0, 0.9)


# ---- the epoch save rule -------------------------------------------------------------------


def test_save_every_n_epochs_saves_at_the_last_batch_of_every_nth_epoch():
    """2 batches an epoch, ``save_every_n_epochs=2``: steps 4, 8 and 12 save, no other."""
    progress = Progress(num_ppo_steps=12, batches_per_epoch=2, value_pretrain=ValuePretraining(0, None, 1, 1.0),
                        save_every_n_epochs=2)
    due = []
    for _ in range(6):  # epochs
        for _ in range(2):  # batches
            progress.count_step({"value_loss": 0.0}, pretraining=False)
            if progress.save_due():
                due.append(progress.global_step)
        progress.end_epoch()
    assert due == [4, 8, 12]
