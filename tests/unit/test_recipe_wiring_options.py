"""Options whose only effect is through recipes/ppo_full_finetune.py, checked at a value other than
the default on the tiny task in this process (eager, a few seconds each): a sampling temperature
reaching the loss step's logprobs, ``top_k``/``top_p`` reaching the sampler, ``penalise_no_eos``
reaching the scores, the adaptive KL coefficient carried across a resume, the token means of the
``rollout_corr/*`` metrics; the save rules (``save_every_n_steps`` in global steps after value
pretraining, ``save_every_n_epochs`` with the loader's batches an epoch) and
``keep_last_n_checkpoints`` through the run's loop; the batch's references reaching a reward
function; TIS and MIS in bf16 with compiled scoring against eager; the one-pass bf16 master step
clipping as the four passes; and 35 keys at once at a value other than the default, each read
where the recipe put it."""

import logging

import pytest
import torch

from test_recipe_wiring import _first_batch, _record_rollouts


def test_a_sampling_temperature_reaches_the_loss_steps_logprobs(make_recipe):
    """At 0.7 the rollout's logprobs are of the tempered distribution; the loss step must read the
    same, so at a step's first minibatch (here its only one, every micro-step before the optimizer
    steps) the policy ratio is 1 and the rollout and the trainer agree token for token."""
    recipe, cfg = make_recipe(temperature=0.7, ppo_epochs=1, ppo_batch_size=8, gradient_accumulation_steps=2)
    seen = _record_rollouts(recipe)
    metrics = recipe.train_step(*_first_batch(recipe), 0)
    assert metrics["ratios"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["rollout_corr/abs_diff_max"] < 1e-4
    # not vacuous: untempered logprobs of the same tokens are far from the sampled ones
    (traj,) = seen
    valid = ~traj.response_padding_masks
    with torch.no_grad():
        logits = recipe._models.policy(traj.query_responses, mask=traj.masks, input_pos=traj.position_ids)
    p = cfg.max_prompt_len
    plain = torch.log_softmax(logits[:, p - 1:-1].float(), -1).gather(2, traj.query_responses[:, p:, None])[..., 0]
    assert (plain - traj.logprobs)[valid].abs().max() > 1e-2


@pytest.mark.parametrize("option", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k", "top_p"])
def test_top_k_and_top_p_reach_the_generator(make_recipe, option):
    """``top_k=1`` or a tiny ``top_p`` leaves one candidate a position: every sampled token is the
    policy's most likely next token (at the default temperature the tiny policy samples others)."""
    recipe, cfg = make_recipe(ppo_epochs=1, **option)
    p, best = cfg.max_prompt_len, []

    def most_likely(traj):  # the policy's argmax at the rollout's weights, before the update
        with torch.no_grad():
            logits = recipe._models.policy(traj.query_responses, mask=traj.masks, input_pos=traj.position_ids)
        best.append(logits[:, p - 1:-1].argmax(-1))
        return traj

    seen = _record_rollouts(recipe, most_likely)
    recipe.train_step(*_first_batch(recipe), 0)
    (traj,), (argmax,) = seen, best
    valid = ~traj.response_padding_masks
    assert torch.equal(argmax[valid], traj.query_responses[:, p:][valid])


@pytest.mark.parametrize("penalise", [True, False])
def test_penalise_no_eos_reaches_the_scores(make_recipe, penalise):
    """Responses cut at 4 tokens: those without a stop token score ``reward_penalty`` exactly when
    ``penalise_no_eos`` is on; the others keep the reward model's score."""
    recipe, cfg = make_recipe(penalise_no_eos=penalise, reward_penalty=-7.0, max_generated_tokens=4,
                              ppo_epochs=1)
    seen = _record_rollouts(recipe)
    recipe.train_step(*_first_batch(recipe), 0)
    (traj,) = seen
    responses = traj.query_responses[:, cfg.max_prompt_len:]
    no_stop = ~torch.isin(responses, torch.tensor(list(cfg.stop_token_ids))).any(-1)
    assert no_stop.any()
    assert (traj.scores == -7.0).tolist() == (no_stop & penalise).tolist()


def test_the_adaptive_kl_coefficient_is_carried_across_a_resume(make_recipe, tmp_path):
    """A step adapts the coefficient towards ``kl_target``; the checkpoint carries it, and the
    resumed run's next step uses the adapted one, not the config's ``kl_coeff``."""
    settings = dict(kl_coeff=0.1, kl_target=1e-4, kl_horizon=40, ppo_epochs=1, output_dir=tmp_path / "run")
    first, _ = make_recipe(num_ppo_steps=1, **settings)
    first.train()  # saves at the end
    adapted = first._kl.value
    assert adapted != 0.1
    first.cleanup()  # lets go of the output folder's lock
    resumed, _ = make_recipe(num_ppo_steps=2, resume_from_checkpoint=True, **settings)
    assert resumed._kl.value == adapted
    metrics = resumed.train_step(*_first_batch(resumed), 0)
    assert metrics["kl_coeff"] == adapted


def _shifted(field, T):
    """Moves ``field`` (the rollout's logprobs as the update reads them) by ``delta``, which grows
    along each row: 0.01, 0.02, ... on valid tokens; returns the change and the deltas seen."""
    deltas = []

    def change(t):
        valid = ~t.response_padding_masks
        delta = 0.01 * torch.arange(1, T + 1, dtype=torch.float32)[None] * valid
        deltas.append((delta, valid))
        moved = getattr(t, field) + delta
        if field == "logprobs":  # no recomputation: the generator's logprobs are both
            return t._replace(logprobs=moved, rollout_logprobs=moved)
        return t._replace(rollout_logprobs=moved)

    return change, deltas


@pytest.mark.parametrize("correction", [None, "tis"])
def test_rollout_corr_means_are_over_tokens(make_recipe, correction):
    """``rollout_corr/*`` are means over the valid tokens (not over sequences), of the rollout's
    logprobs against the trainer's: measured at the first minibatch (all 8 rows here) or, with
    ``rollout_correction``, over the recomputed batch. The rollout's logprobs are moved by a known
    ``delta`` per token, so ``d = trainer - rollout`` is ``-delta`` up to fp32 rounding."""
    extra = {} if correction is None else {"rollout_correction.mode": correction, "rollout_correction.threshold": 100.0}
    recipe, cfg = make_recipe(ppo_epochs=1, ppo_batch_size=8, **extra)
    change, deltas = _shifted("logprobs" if correction is None else "rollout_logprobs", cfg.max_generated_tokens)
    _record_rollouts(recipe, change)
    metrics = recipe.train_step(*_first_batch(recipe), 0)
    ((delta, valid),) = deltas
    d = -delta.double()[valid]
    tokens, rows = int(valid.sum()), valid.shape[0]
    assert tokens > rows  # more tokens than sequences: the two means differ
    assert metrics["rollout_corr/log_ratio_mean"] == pytest.approx(float(d.sum()) / tokens, abs=1e-4)
    assert metrics["rollout_corr/abs_diff_mean"] == pytest.approx(float(d.abs().sum()) / tokens, abs=1e-4)
    assert metrics["rollout_corr/abs_diff_max"] == pytest.approx(float(d.abs().max()), abs=1e-4)
    assert metrics["rollout_corr/kl_k3"] == pytest.approx(float((torch.expm1(d) - d).sum()) / tokens, rel=1e-2)
    assert metrics["rollout_corr/log_ratio_mean"] != pytest.approx(float(d.sum()) / rows, abs=1e-3)


@pytest.mark.parametrize("mode", [None, "tis"])
def test_rollout_correction_takes_the_old_logprobs_from_the_trainers_forward(make_recipe, mode):
    """With ``rollout_correction`` the scoring recomputes the sampled tokens' logprobs with the
    policy's own forward: the trajectory's ``logprobs`` are the trainer's, the generator's are kept
    as ``rollout_logprobs``. The generator's logprobs are moved by 0.5 here, so only a recomputed
    ``logprobs`` stays away from them; without correction both are the generator's."""
    extra = {} if mode is None else {"rollout_correction.mode": mode, "rollout_correction.threshold": 100.0}
    recipe, _ = make_recipe(ppo_epochs=1, ppo_batch_size=8, **extra)
    generator = recipe._rollout.generator
    generate = generator.generate

    def moved(*args, **kwargs):
        out = generate(*args, **kwargs)
        return out._replace(logprobs=out.logprobs - 0.5)

    generator.generate = moved
    seen = _record_rollouts(recipe)
    recipe.train_step(*_first_batch(recipe), 0)
    (t,) = seen
    valid = ~t.response_padding_masks
    if mode is None:
        assert t.rollout_logprobs is None or torch.equal(t.rollout_logprobs[valid], t.logprobs[valid])
        return
    gap = (t.logprobs - t.rollout_logprobs)[valid]
    assert gap.abs().min() > 0.45 and gap.abs().max() < 0.55, gap  # the trainer's, 0.5 from the generator's


@pytest.mark.parametrize("adapters_only", [False, True])
def test_a_lora_runs_last_save_merges_the_adapters_unless_told_not_to(make_recipe, adapters_only):
    """The run's last save of a LoRA policy writes merged full weights beside its adapters
    (``save_adapter_weights_only: False``, the default), and only the adapters when it is True."""
    from pathlib import Path

    from safetensors.torch import load_file

    recipe, _ = make_recipe("ppo_tiny_sentiment_lora.yaml", save_adapter_weights_only=adapters_only)
    path = Path(recipe._checkpoints.save(1, recipe._progress.state_dict(), final=True))
    weights = {k for f in (path / "policy").rglob("*.safetensors") if "adapter" not in f.name
               for k in load_file(f)}
    assert sorted(p.name for p in path.rglob("adapter_config.json"))  # the adapters, either way
    if adapters_only:
        assert not weights, sorted(weights)[:5]
    else:  # the base's names, the adapters folded into them
        assert weights and not any("lora" in k for k in weights), sorted(weights)[:5]


def test_group_metrics_are_logged_from_two_samples_a_prompt(make_recipe):
    """``group_score_std`` and ``zero_std_groups`` (advantages.group_metrics) are logged for any
    group size from 2, the smallest group there is, and are over the step's own scores."""
    from torchtune_ppo.ppo.advantages import group_metrics

    recipe, cfg = make_recipe("grpo_tiny_arithmetic.yaml", num_samples_per_prompt=2, batch_size=4,
                              forward_batch_size=8, ppo_batch_size=8)
    seen = _record_rollouts(recipe)
    batch = next(iter(recipe._dataloader))
    metrics = recipe.train_step(batch["tokens"], batch["prompt_lens"], 0, batch.get("references"))
    (t,) = seen
    expected = group_metrics(t.scores, 2)
    assert set(expected) <= set(metrics), sorted(metrics)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_checkpoint_format_reaches_the_save(make_recipe, fmt):
    """``checkpoint_format: sharded`` writes the step's tensors as shards (torch.distributed.checkpoint
    under ``shards/``), ``full`` as HF weights with no shards."""
    from pathlib import Path

    from torchtune_ppo.checkpointing.store import SHARDS_DIRNAME

    recipe, _ = make_recipe(checkpoint_format=fmt)
    path = Path(recipe.save_checkpoint(1))
    shards = sorted(p.name for p in (path / SHARDS_DIRNAME).glob("*.distcp"))
    assert bool(shards) == (fmt == "sharded"), sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


# ---- the save rules and the pruning, through the recipe's loop --------------------------------


def _fake_steps(recipe):
    """The recipe's loop with each step's work replaced by a row of metrics (a value loss that
    keeps value pretraining going): what is left is the loop's own bookkeeping, its save rules
    and its checkpoint manager. Returns the list of steps the recipe saved."""
    saved, save = [], recipe.save_checkpoint

    def step(*args, **kwargs):
        return {"scores": 0.0, "kl": 0.0, "time/generate": 0.0, "value_loss": 1.0}

    def recording(step_, rng=None):
        saved.append(step_)
        return save(step_, rng)

    recipe.train_step, recipe.save_checkpoint = step, recording
    return saved


def _prompts(tmp_path, n):
    import json

    import torchtune_ppo

    with open(torchtune_ppo.asset_path("tiny_sentiment/prompts.json")) as f:
        data = tmp_path / f"prompts_{n}.json"
        data.write_text(json.dumps(json.load(f)[:n]))
    return str(data)


def test_save_every_n_steps_counts_value_pretraining_steps(make_recipe, tmp_path):
    """Steps are numbered pretraining's first: 3 pretraining steps then 4 PPO steps are global
    steps 1-7, so ``save_every_n_steps=2`` saves after global steps 2, 4 and 6 (not PPO steps 2
    and 4, which are global 5 and 7), and the last step at the end."""
    recipe, _ = make_recipe(num_ppo_steps=4, save_every_n_steps=2, keep_last_n_checkpoints="null",
                            **{"value_pretrain.max_steps": 3})
    saved = _fake_steps(recipe)
    recipe.train()
    assert saved == [2, 4, 6, 7]
    assert sorted(p.name for p in (tmp_path / "run0" / "checkpoints").glob("step_*")) == [
        f"step_{s}" for s in (2, 4, 6, 7)]


def test_save_every_n_epochs_takes_the_loaders_batches_per_epoch(make_recipe, tmp_path):
    """24 prompts in batches of 8: 3 batches an epoch, so ``save_every_n_epochs=2`` saves after
    step 6 (the last batch of epoch 2), then the last step (7) at the end."""
    recipe, _ = make_recipe(num_ppo_steps=7, save_every_n_epochs=2, save_every_n_steps="null",
                            keep_last_n_checkpoints="null", **{"dataset.data_files": _prompts(tmp_path, 24)})
    assert len(recipe._dataloader) == 3
    saved = _fake_steps(recipe)
    recipe.train()
    assert saved == [6, 7]


def test_shuffle_false_takes_the_prompts_in_the_datasets_order(make_recipe, tmp_path):
    """``shuffle: False``: every epoch's batches are the dataset's rows in order (16 prompts,
    2 batches an epoch, 4 steps)."""
    recipe, _ = make_recipe(num_ppo_steps=4, shuffle=False, **{"dataset.data_files": _prompts(tmp_path, 16)})
    _fake_steps(recipe)
    seen, step = [], recipe.train_step

    def recording(prompts, prompt_lens, *args, **kwargs):
        seen.extend(row[len(row) - int(n):].tolist() for row, n in zip(prompts, prompt_lens))
        return step(prompts, prompt_lens, *args, **kwargs)

    recipe.train_step = recording
    recipe.train()
    dataset = [list(recipe._dataloader.dataset[i]["tokens"]) for i in range(16)]
    assert seen == dataset + dataset


def test_keep_last_n_checkpoints_prunes_the_recipes_saves(make_recipe, tmp_path):
    """``keep_last_n_checkpoints=2`` reaches the checkpoint manager the recipe saves with: of the
    saves after steps 1-5, the last two are left."""
    recipe, _ = make_recipe(num_ppo_steps=5, save_every_n_steps=1, keep_last_n_checkpoints=2)
    saved = _fake_steps(recipe)
    recipe.train()
    assert saved == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "run0" / "checkpoints").glob("step_*")) == ["step_4", "step_5"]


def test_a_resumed_run_counts_its_restored_step_as_saved(make_recipe, tmp_path):
    """Resumed from its last checkpoint with nothing left to train, a run saves nothing again:
    the step it was restored from is counted as saved; with one step left, only that step is
    saved."""
    settings = dict(output_dir=tmp_path / "run", save_every_n_steps="null")
    first, _ = make_recipe(num_ppo_steps=2, **settings)
    _fake_steps(first)
    first.train()
    first.cleanup()  # lets go of the output folder's lock
    done, _ = make_recipe(num_ppo_steps=2, resume_from_checkpoint=True, **settings)
    saved = _fake_steps(done)
    done.train()
    assert saved == [] and not done._progress.unsaved
    done.cleanup()
    more, _ = make_recipe(num_ppo_steps=3, resume_from_checkpoint=True, **settings)
    saved = _fake_steps(more)
    more.train()
    assert saved == [3]


def test_a_rollout_failing_after_an_update_saves_the_last_completed_step(make_recipe, tmp_path):
    """Step 1 runs whole (its update included); step 2's rollout raises: the run saves step 1
    (the state after the last completed step), as it would had step 1 not updated anything."""
    recipe, _ = make_recipe(num_ppo_steps=3, save_every_n_steps="null", ppo_epochs=1,
                            output_dir=tmp_path / "run")
    rollout, calls = recipe._rollout, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the rollout broke")
        return rollout(*args, **kwargs)

    recipe._rollout = failing
    with pytest.raises(RuntimeError, match="the rollout broke"):
        recipe.train()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_1"]


def test_a_failure_after_a_counted_step_saves_that_step(make_recipe, tmp_path, caplog):
    """Step 2 runs whole and is counted; the caller's ``on_step`` then raises (as a failing
    metric logger or progress callback would): the run saves step 2, says it failed after step
    2 (not during step 3's update), and the printed resume runs step 3 only."""
    settings = dict(num_ppo_steps=3, save_every_n_steps="null", ppo_epochs=1, output_dir=tmp_path / "run")
    recipe, _ = make_recipe(**settings)

    def on_step(step, metrics):
        if step == 2:
            raise RuntimeError("the callback broke")

    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="the callback broke"):
        recipe.train(on_step=on_step)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_2"]
    assert "PPO run failed after step 2 (RuntimeError: the callback broke)" in caplog.text, caplog.text
    assert "the state after step 2 is saved" in caplog.text, caplog.text
    more, _ = make_recipe(resume_from_checkpoint=True, **settings)
    steps = []
    more.train(on_step=lambda step, metrics: steps.append(step))
    assert steps == [3]


def test_references_reach_a_function_reward(make_recipe):
    """The arithmetic task's reward is a function of each response and its row's reference
    answer: in the run's loop the function is given the batch's references, row for row."""
    import functools

    recipe, _ = make_recipe("ppo_tiny_arithmetic.yaml", ppo_epochs=1, num_ppo_steps=1,
                            **{"eval.every_n_steps": "null", "eval.before_training": False})
    reward = recipe._rollout.reward
    fn, given = reward.fn, []

    @functools.wraps(fn)
    def recording(*args, **kwargs):
        given.extend(kwargs["references"])
        return fn(*args, **kwargs)

    reward.fn = recording
    recipe._sampler.set_epoch(0)
    batch = next(iter(recipe._dataloader))  # the first step's, as the run's loop draws it
    assert batch["references"] and len(set(batch["references"])) > 1
    recipe.train()
    assert given == list(batch["references"])


# ---- rollout correction in bf16, with the scoring region compiled -----------------------------


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_correction_in_bf16_with_compiled_scoring_is_eagers(make_recipe, monkeypatch, mode):
    """TIS/MIS in bf16 with the scoring region (which recomputes the old logprobs with the
    trainer's forward) and the loss step compiled, traced by dynamo on its eager backend: step 1
    and step 2 equal the eager run's, correction metrics included, with no recompile. The tiny
    model's bf16 rollout and trainer agree exactly on this CPU, so the rollout's logprobs are
    moved by a known shift (0.01-0.08 a token) and the weights are not all 1. The optimizer's
    one-pass step is left out: it rounds the fp32 update in another order (test_bf16.py says why
    that moves step 2's samples)."""
    extra = {"dtype": "bf16", "rollout_correction.mode": mode, "rollout_correction.threshold": 1.001,
             "ppo_epochs": 1, "num_ppo_steps": 2}
    rows = {}
    for name, compile_ in (("eager", {"compile": False}),
                           ("compiled", {"compile.trajectory": True, "compile.loss_step": True,
                                         "compile.generate": False, "compile.rollout": False,
                                         "compile.optimizer": False})):
        if name == "compiled":
            monkeypatch.setenv("TORCHTUNE_PPO_COMPILE_BACKEND", "eager")
        recipe, cfg = make_recipe(**extra, **compile_)
        _record_rollouts(recipe, _shifted("rollout_logprobs", cfg.max_generated_tokens)[0])
        logged = []
        recipe.train(on_step=lambda step, metrics: logged.append(dict(metrics)))
        rows[name] = logged
    for a, b in zip(rows["eager"], rows["compiled"]):
        for key in ("scores", "loss", "policy_loss", "kl", "rollout_corr/weight_mean",
                    "rollout_corr/corrected_frac", "rollout_corr/abs_diff_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert [r["recompiles"] for r in rows["compiled"]] == [0.0, 0.0]
    assert all(r["rollout_corr/weight_mean"] != 1.0 for r in rows["eager"]), rows["eager"]


# Every key below at a value other than the tiny config's and the schema's default, all in one
# recipe (one build, a few seconds); each line reads where the recipe put it.
_NON_DEFAULTS = {
    "seed": 5, "shuffle": False, "num_ppo_steps": 7, "save_every_n_steps": 5, "keep_last_n_checkpoints": 3,
    "max_consecutive_skipped_steps": 5, "temperature": 0.8, "top_k": 7, "top_p": 0.9,
    "max_generated_tokens": 10, "forward_batch_size": 8, "stop_token_ids": [2, 3],
    "ppo_epochs": 3, "ppo_batch_size": 8, "gradient_accumulation_steps": 4, "clip_grad_norm": 0.7,
    "critic_warmup_steps": 2, "penalise_no_eos": False, "reward_penalty": -2.5, "min_response_length": 3,
    "gamma": 0.9, "lmbda": 0.8, "whiten_rewards": True, "kl_estimator": "k3", "lmbda_actor": 0.7,
    "kl_coeff": 0.07, "kl_target": 0.5, "kl_horizon": 1234, "optimizer.lr": 1e-4,
    "loss.epsilon": 0.15, "loss.value_clip_range": 0.3, "loss.value_coeff": 0.2, "loss.epsilon_high": 0.25,
    "loss.entropy_coeff": 0.01, "loss.aggregation": "seq-mean-token-mean",
}


def _where_they_went(recipe):
    """Each key of ``_NON_DEFAULTS``: the value the part that uses it holds."""
    gen, scoring, update = recipe._rollout.generator, recipe._rollout.settings, recipe._update
    adv, loss, progress = recipe._advantages, update._loss, recipe._progress
    return {
        "seed": recipe._sampler.seed, "shuffle": recipe._sampler.shuffle, "num_ppo_steps": progress.num_ppo_steps,
        "save_every_n_steps": progress.save_every_n_steps,
        "keep_last_n_checkpoints": recipe._checkpoints.manager.keep_last_n,
        "max_consecutive_skipped_steps": recipe._skipped.max_consecutive,
        "temperature": gen.sampling["temperature"], "top_k": gen.sampling["top_k"], "top_p": gen.sampling["top_p"],
        "max_generated_tokens": gen.max_generated_tokens, "forward_batch_size": gen.batch_size,
        "stop_token_ids": recipe._rollout.stop_token_ids.tolist(),
        "ppo_epochs": update.ppo_epochs, "ppo_batch_size": update._ppo_batch_size,
        "gradient_accumulation_steps": update.gradient_accumulation_steps, "clip_grad_norm": update._max_norm,
        "critic_warmup_steps": update.critic_warmup_steps, "penalise_no_eos": scoring.penalise_no_eos,
        "reward_penalty": scoring.reward_penalty, "min_response_length": scoring.min_response_length,
        "gamma": adv.gamma, "lmbda": adv.lmbda, "whiten_rewards": adv.whiten_rewards,
        "kl_estimator": adv.kl_estimator, "lmbda_actor": adv.lmbda_actor,
        "kl_coeff": recipe._kl.value, "kl_target": recipe._kl.target, "kl_horizon": recipe._kl.horizon,
        "optimizer.lr": recipe._update.optimizer.param_groups[0]["lr"],
        "loss.epsilon": loss.epsilon, "loss.value_clip_range": loss.value_clip_range,
        "loss.value_coeff": loss.value_coeff, "loss.epsilon_high": loss.epsilon_high,
        "loss.entropy_coeff": loss.entropy_coeff, "loss.aggregation": loss.aggregation,
    }


def test_every_option_at_a_non_default_value_reaches_the_part_that_uses_it(make_recipe):
    """An option dropped on its way (a constant, the default, another key passed instead) leaves
    its part at the default: with every key at another value, each part must hold that value,
    and the stop tokens must reach the generator as well as the scoring. Behaviour is checked
    elsewhere (the sampler, the save rules, the loss); this catches the wiring of every key at
    once."""
    defaults, _ = make_recipe()
    recipe, cfg = make_recipe(**_NON_DEFAULTS)
    before, after = _where_they_went(defaults), _where_they_went(recipe)
    assert {k: v for k, v in after.items() if v != pytest.approx(_NON_DEFAULTS[k])} == {}
    assert not [k for k in _NON_DEFAULTS if before[k] == after[k]]  # every key moved off its default
    assert recipe._rollout.generator.stop_token_ids == [2, 3]


def test_the_one_pass_bf16_master_step_clips_as_the_four_passes(make_recipe):
    """bf16 masters stepped in one pass (``compile.optimizer``'s path, here its eager function)
    against the four passes, through the recipe's update, with a clip so tight that the clipped
    gradients fall far below AdamW's ``eps``: each master moves ~lr/10 clipped, ~lr not (Adam
    undoes a plain rescaling, so only such a clip shows whether it was applied). The masters
    must agree, and have moved less than a third of lr."""
    from torchtune_ppo.run.optim import adam_master_step

    masters, starts = [], []
    for one_pass in (False, True):
        recipe, cfg = make_recipe(dtype="bf16", clip_grad_norm=1e-9, ppo_epochs=1, ppo_batch_size=8)
        if one_pass:
            recipe._master._step_fn = adam_master_step
        assert recipe._master.fuses(recipe._update.optimizer) == one_pass
        starts.append([m.clone() for m in recipe._master.masters])
        recipe.train_step(*_first_batch(recipe), 0)
        masters.append([m.clone() for m in recipe._master.masters])
    lr = float(cfg.optimizer.lr)
    moved = max(float((b - a).abs().max()) for a, b in zip(starts[1], masters[1]))
    assert 0 < moved < lr / 3
    for a, b in zip(*masters):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=lr * 1e-3)
