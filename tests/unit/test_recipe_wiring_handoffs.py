"""Config keys that recipes/ppo_full_finetune.py, torchtune_ppo/config and torchtune_ppo/run hand
to a part of the run (the generator, the rollout, the update, the advantages, the value
pretraining, the evaluator, the checkpoint client, the metric logger, the models' builder, the
compiled regions, the optimizer's masters), each set to a value other than its default and the
tiny config's, and read back from the part that got it. A hand-off that drops a key, swaps two,
or passes the default instead leaves the part at the default value and fails its row.

A few builds of the tiny tasks serve every row (module-scoped, built once, on first use); keys
whose only trace is a behaviour (the logging period, a resume over changed data) run the
recipe's loop with each step's work replaced by a row of metrics. test_recipe_wiring_options.py
holds the keys checked before this file (``_NON_DEFAULTS`` and the behaviour tests there)."""

import functools
import json
import os
import warnings

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_ppo
from torchtune_ppo.config.schema import KEYS

from conftest import recipe_config
from test_recipe_wiring_options import _fake_steps

# ---- the builds ----------------------------------------------------------------------------

# Each build: a shipped tiny config and its overrides (dotted keys). Every value below is other
# than the schema's default and the shipped config's own value
# (test_every_builds_value_is_other_than_the_default_and_the_shipped_configs); the names in
# PATHS stand for paths in the build's own folder.
BUILDS = {
    "sentiment": ("ppo_tiny_sentiment.yaml", {
        "batch_size": 4, "max_prompt_len": 14, "long_prompts": "error", "lmbda_length_alpha": 0.05,
        "rollout_correction.mode": "mis", "rollout_correction.level": "sequence",
        "rollout_correction.threshold": 3.0,
        "loss.epsilon_low": 0.1, "loss.dual_clip": 3.0, "loss.kl_coeff": 0.02, "loss.kl_estimator": "k2",
        "value_pretrain.max_steps": 4, "value_pretrain.tolerance": 0.05, "value_pretrain.window": 3,
        "value_pretrain.lmbda": 0.9,
        "segment_attention": True, "share_prompt_prefix": True, "enable_activation_checkpointing": True,
        "log_samples_every_n_steps": 2, "cpu_threads": 2, "optimizer.weight_decay": 0.01,
        "speculative.enabled": True, "speculative.draft": "ngram", "speculative.max_draft_tokens": 3,
        "speculative.min_draft_rows": 0.25, "speculative.noise": "per_prompt", "speculative.max_stored": 100,
        "checkpoint_format": "sharded", "async_save": True,
        "profiler._component_": "torchtune.training.setup_torch_profiler", "profiler.enabled": True,
        "profiler.output_dir": "PROFILES", "metric_logger.log_dir": "LOGS",
    }),
    "arithmetic": ("ppo_tiny_arithmetic.yaml", {
        "reward.tolerance": 0.5,
        "eval.every_n_steps": 3, "eval.before_training": False, "eval.max_prompts": 5, "eval.num_samples": 2,
        "eval.temperature": 0.7, "eval.top_k": 4, "eval.top_p": 0.8, "eval.max_generated_tokens": 5,
        "eval.batch_size": 6, "eval.reward._component_": "torchtune_ppo.rewards.ExactMatch",
        "eval.reward.tolerance": 0.25, "eval.correct_threshold": 0.5, "eval.best_metric": "val/pass@2",
        "eval.best_mode": "min", "eval.early_stop_patience": 2, "eval.on_error": "skip",
        # the training split instead of the default held-out one
        "eval.dataset._component_": "torchtune_ppo.data.prompt_dataset", "eval.dataset.source": "json",
        "eval.dataset.data_files": "${ppo_asset:tiny_arithmetic/problems.json}", "eval.dataset.field": "train",
        "eval.dataset.column": "prompt", "eval.dataset.reference_column": "answer", "eval.dataset.split": "train",
    }),
    "eval_sets": ("ppo_tiny_arithmetic.yaml", {
        "eval.datasets.heldout": None, "eval.datasets.again": None, "eval.best_metric": "val/again/pass@1",
    }),
    # evaluation prompts that share their first 11 tokens (BOS and "0+0+0+0+0+"), which the
    # evaluation's generator would compute once a call
    "eval_prefix": ("ppo_tiny_arithmetic.yaml", {
        "share_prompt_prefix": False, "max_prompt_len": 20, "eval.max_prompts": 8,
        "eval.dataset._component_": "torchtune_ppo.data.prompt_dataset", "eval.dataset.source": "json",
        "eval.dataset.data_files": "EVALDATA", "eval.dataset.column": "prompt",
        "eval.dataset.reference_column": "answer", "eval.dataset.split": "train",
    }),
    # the same with share_prompt_prefix at its default (null): the evaluation shares the prefix
    "eval_prefix_default": ("ppo_tiny_arithmetic.yaml", {
        "max_prompt_len": 20, "eval.max_prompts": 8,
        "eval.dataset._component_": "torchtune_ppo.data.prompt_dataset", "eval.dataset.source": "json",
        "eval.dataset.data_files": "EVALDATA", "eval.dataset.column": "prompt",
        "eval.dataset.reference_column": "answer", "eval.dataset.split": "train",
    }),
    "bf16_compiled": ("ppo_tiny_sentiment.yaml", {
        "dtype": "bf16", "master_rounding": "nearest", "compile.generate": True, "compile.trajectory": True,
        "compile.loss_step": True, "compile.rollout": False, "compile.optimizer": True,
        "compile.mode": "reduce-overhead", "compile_cache": "CACHE",
    }),
    "bf16_rollout": ("ppo_tiny_sentiment.yaml", {
        "dtype": "bf16", "master_weights": False, "compile.generate": False, "compile.trajectory": False,
        "compile.loss_step": False, "compile.rollout": True,
    }),
    "layers": ("ppo_tiny_sentiment.yaml", {
        "compile.generate": False, "compile.trajectory": False, "compile.loss_step": True,
        "compile.rollout": False, "compile.layers": True,
    }),
    "grpo": ("grpo_tiny_arithmetic.yaml", {}),
    "grpo_unshared": ("grpo_tiny_arithmetic.yaml", {"share_group_prefill": False}),
    "tools": ("ppo_tiny_tools.yaml", {
        "turns.max_turns": 2, "turns.max_observation_tokens": 6, "turns.observation_template": "'=>{observation}'",
        "turns.cache_tokens": 40, "turns.timeout_s": 5.0, "turns.isolation": "thread",
        "turns.stop_strings": "['</calc>']", "turns.max_env_failures": 3, "turns.gae": "turn",
        "eval.every_n_steps": None,  # off, for a short build: not checked here
    }),
    "lora_unshared": ("ppo_tiny_sentiment_lora.yaml", {"share_reward_value_base": False}),
}


PATHS = ("PROFILES", "CACHE", "LOGS", "EVALDATA")  # stand for paths in the build's own folder


def _prefixed_prompts(path, prefix):
    """The arithmetic task's first held-out problems, each prompt after ``prefix``, as a JSON list."""
    with open(torchtune_ppo.asset_path("tiny_arithmetic/problems.json")) as f:
        rows = json.load(f)["heldout"][:8]
    path.write_text(json.dumps([dict(row, prompt=prefix + row["prompt"]) for row in rows]))


def _dotlist_value(value):
    return "null" if value is None else value


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name) -> (recipe, cfg, seen)``: ``BUILDS[name]`` set up once for the module, with
    what only the moment of building shows (``seen``: the CPU threads the recipe's constructor
    asked torch for, the warnings of its setup)."""
    from ppo_full_finetune import PPOFullFinetuneRecipe

    cache, failed = {}, {}

    def build(name):
        if name in failed:  # a build that failed fails every row of it at once
            raise failed[name]
        if name not in cache:
            config, overrides = BUILDS[name]
            out = tmp_path_factory.mktemp(name)
            overrides = {k: (str(out / v) if v in PATHS else _dotlist_value(v)) for k, v in overrides.items()}
            if "eval.dataset.data_files" in overrides and name.startswith("eval_prefix"):
                _prefixed_prompts(out / "EVALDATA", "0+0+0+0+0+")
            cfg = recipe_config(out / "run", config, **overrides)
            threads = []
            with pytest.MonkeyPatch.context() as mp:
                # cpu_threads: the count the recipe asks for is recorded, not set (this process keeps
                # its one thread); 4 cores seem free, so a number is not capped, and `auto` is 1
                mp.setenv("OMP_NUM_THREADS", "1")
                mp.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
                mp.setattr(torch, "set_num_threads", threads.append)
                try:
                    recipe = PPOFullFinetuneRecipe(cfg)
                except Exception as e:
                    failed[name] = e
                    raise
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    recipe.setup(cfg)
                except Exception as e:
                    failed[name] = e
                    raise
            cache[name] = (recipe, cfg, {"threads": threads[-1], "warnings": [str(w.message) for w in caught]})
        return cache[name]

    yield build
    for recipe, _, _ in cache.values():
        recipe.cleanup()


# ---- what each part holds ------------------------------------------------------------------


def _dataset_prefix(r):
    """The tokens the training prompts share, which the generator computes once a call when on."""
    from torchtune_ppo.config.batches import generation_prefix

    return generation_prefix(True, r._dataloader.dataset, r._prompt_len)


def _eval_prefix(r):
    """The tokens the evaluation prompts share, which its generator computes once a call unless off."""
    from torchtune_ppo.eval.evaluator import eval_prefix_len

    return eval_prefix_len(r._evaluator.prompts)


def _has_checkpoint_wrappers(model):
    return any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())


def _takes_layouts(model):
    from torchtune_ppo.rlhf.segments import accepts_segment_layouts

    return accepts_segment_layouts(model)


def _is_compiled(fn, eager):
    return fn is not None and fn is not eager


def _layer_steps(model):
    from torchtune_ppo._patches.torchtune_modules import LAYER_STEPS_ATTR

    return getattr(model, LAYER_STEPS_ATTR, None) is not None


def _eager():
    from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
    from torchtune_ppo.rollout.scoring import packed_score_trajectory
    from torchtune_ppo.run.optim import adam_master_step

    return packed_score_trajectory, packed_ppo_loss_step, adam_master_step


CFG = "<the build's value of the key>"

# (key, build, expected, reader): ``reader(recipe, seen)`` is what the part holds, ``expected``
# what it must be (``CFG``: the key's value in the build's config).
HANDOFFS = [
    # the data and the step's shape
    ("batch_size", "sentiment", CFG, lambda r, s: r._dataloader.batch_size),
    ("batch_size", "sentiment", 4, lambda r, s: r._rows_per_step),
    ("batch_size", "sentiment", 4, lambda r, s: r._update._batch_size),
    ("max_prompt_len", "sentiment", CFG, lambda r, s: r._prompt_len),
    ("max_prompt_len", "sentiment", 14, lambda r, s: r._rollout.generator.max_prompt_len),
    ("max_prompt_len", "sentiment", 14, lambda r, s: r._rollout.settings.prompt_len),
    ("max_prompt_len", "sentiment", 14, lambda r, s: r._update._prompt_len),
    ("max_prompt_len", "sentiment", 14, lambda r, s: r._samples.prompt_len),
    ("max_prompt_len", "sentiment", 14, lambda r, s: r._dataloader.collate_fn.keywords["max_prompt_len"]),
    ("long_prompts", "sentiment", CFG, lambda r, s: r._dataloader.collate_fn.keywords["long_prompts"]),
    # the advantages
    ("lmbda_length_alpha", "sentiment", CFG, lambda r, s: r._advantages.lmbda_length_alpha),
    ("rollout_correction.mode", "sentiment", CFG, lambda r, s: r._advantages.rollout_correction["mode"]),
    ("rollout_correction.mode", "sentiment", True, lambda r, s: r._rollout.recompute_logprobs),
    ("rollout_correction.level", "sentiment", CFG, lambda r, s: r._advantages.rollout_correction["level"]),
    ("rollout_correction.threshold", "sentiment", CFG,
     lambda r, s: r._advantages.rollout_correction["threshold"]),
    ("advantage_estimator", "grpo", "grpo", lambda r, s: r._advantages.advantage_estimator),
    ("advantage_estimator", "grpo", None, lambda r, s: r._models.value),  # a critic-free run builds none
    ("turns.gae", "tools", CFG, lambda r, s: r._advantages.gae_level),
    # the loss
    ("loss.epsilon_low", "sentiment", CFG, lambda r, s: r._update._loss.epsilon_low),
    ("loss.dual_clip", "sentiment", CFG, lambda r, s: r._update._loss.dual_clip),
    ("loss.kl_coeff", "sentiment", CFG, lambda r, s: r._update._loss.kl_coeff),
    ("loss.kl_estimator", "sentiment", CFG, lambda r, s: r._update._loss.kl_estimator),
    ("optimizer.weight_decay", "sentiment", CFG, lambda r, s: r._update.optimizer.param_groups[0]["weight_decay"]),
    # value pretraining
    ("value_pretrain.max_steps", "sentiment", CFG, lambda r, s: r._progress.value_pretrain.max_steps),
    ("value_pretrain.tolerance", "sentiment", CFG, lambda r, s: r._progress.value_pretrain.tolerance),
    ("value_pretrain.window", "sentiment", CFG, lambda r, s: r._progress.value_pretrain.window),
    ("value_pretrain.lmbda", "sentiment", CFG, lambda r, s: r._progress.value_pretrain.lmbda),
    # packing and attention
    ("segment_attention", "sentiment", True, lambda r, s: r._rollout._segments),
    ("segment_attention", "sentiment", True, lambda r, s: r._update._segments),
    ("segment_attention", "sentiment", True, lambda r, s: _takes_layouts(r._models.policy)),
    ("share_prompt_prefix", "sentiment", True, lambda r, s: r._rollout._share_prefix),
    ("share_prompt_prefix", "sentiment", True, lambda r, s: r._update._share_prefix),
    ("share_prompt_prefix", "sentiment", True, lambda r, s: r._rollout.generator.prefix_len == _dataset_prefix(r) > 0),
    ("share_prompt_prefix", "eval_prefix", (True, 0), lambda r, s: (_eval_prefix(r) > 0, r._evaluator.generator.prefix_len)),
    ("share_group_prefill", "grpo", 4, lambda r, s: r._rollout.generator.group_size),
    ("share_group_prefill", "grpo", 4, lambda r, s: r._rollout._group_size),
    ("share_group_prefill", "grpo", 4, lambda r, s: r._update.group_size),
    ("share_group_prefill", "grpo_unshared", 1, lambda r, s: r._rollout.generator.group_size),
    ("share_group_prefill", "grpo_unshared", 1, lambda r, s: r._rollout._group_size),
    ("share_group_prefill", "grpo_unshared", 1, lambda r, s: r._update.group_size),
    ("enable_activation_checkpointing", "sentiment", True, lambda r, s: _has_checkpoint_wrappers(r._models.policy)),
    ("enable_activation_checkpointing", "sentiment", True, lambda r, s: _has_checkpoint_wrappers(r._models.value)),
    # speculative rollouts
    ("speculative.enabled", "sentiment", True, lambda r, s: r._rollout.speculation is not None),
    ("speculative.enabled", "sentiment", True, lambda r, s: r._checkpoints.speculation is r._rollout.speculation),
    ("speculative.draft", "sentiment", CFG, lambda r, s: r._rollout.speculation.draft),
    ("speculative.max_draft_tokens", "sentiment", CFG, lambda r, s: r._rollout.generator.draft_tokens),
    ("speculative.min_draft_rows", "sentiment", CFG, lambda r, s: r._rollout.generator.min_draft_rows),
    ("speculative.noise", "sentiment", CFG, lambda r, s: r._rollout.speculation.noise),
    ("speculative.max_stored", "sentiment", CFG, lambda r, s: r._rollout.speculation.store.max_entries),
    # checkpoints, logs, the profiler, threads
    ("async_save", "sentiment", True, lambda r, s: r._checkpoints.shards.async_save),
    ("log_samples_every_n_steps", "sentiment", CFG, lambda r, s: r._samples.every),
    ("metric_logger", "sentiment", "LOGS", lambda r, s: r._metric_logger.log_dir.name),
    ("profiler", "sentiment", "profile", lambda r, s: type(r._profiler).__name__),
    ("cpu_threads", "sentiment", CFG, lambda r, s: s["threads"]),
    # the rewards and the evaluation
    ("reward", "arithmetic", 0.5, lambda r, s: r._rollout.reward.fn.tolerance),
    ("eval.every_n_steps", "arithmetic", CFG, lambda r, s: r._progress.evaluation.every_n_steps),
    ("eval.every_n_steps", "arithmetic", True, lambda r, s: r._evaluator.record is r._progress.evaluation),
    ("eval.before_training", "arithmetic", CFG, lambda r, s: r._progress.evaluation.before_training),
    ("eval.best_metric", "arithmetic", CFG, lambda r, s: r._progress.evaluation.best_metric),
    ("eval.best_mode", "arithmetic", CFG, lambda r, s: r._progress.evaluation.best_mode),
    # a new best's checkpoint is kept from pruning: the evaluator tells the run's checkpoint manager
    ("eval.best_metric", "arithmetic", True, lambda r, s: r._evaluator._keep_step == r._checkpoints.manager.keep_step),
    ("eval.early_stop_patience", "arithmetic", CFG, lambda r, s: r._progress.evaluation.early_stop_patience),
    ("eval.max_prompts", "arithmetic", CFG, lambda r, s: len(r._evaluator.prompts[0].tokens)),
    ("eval.num_samples", "arithmetic", CFG, lambda r, s: r._evaluator.num_samples),
    ("eval.temperature", "arithmetic", CFG, lambda r, s: r._evaluator.generator.sampling["temperature"]),
    ("eval.temperature", "arithmetic", 0.7, lambda r, s: r._evaluator.scorer.settings.temperature),
    ("eval.top_k", "arithmetic", CFG, lambda r, s: r._evaluator.generator.sampling["top_k"]),
    ("eval.top_p", "arithmetic", CFG, lambda r, s: r._evaluator.generator.sampling["top_p"]),
    ("eval.max_generated_tokens", "arithmetic", CFG, lambda r, s: r._evaluator.generator.max_generated_tokens),
    ("eval.batch_size", "arithmetic", CFG, lambda r, s: r._evaluator.generator.batch_size),
    ("eval.reward", "arithmetic", 0.25, lambda r, s: r._evaluator.scorer.reward.fn.tolerance),
    ("eval.correct_threshold", "arithmetic", CFG, lambda r, s: r._evaluator.correct_threshold),
    ("eval.on_error", "arithmetic", CFG, lambda r, s: r._evaluator.on_error),
    ("eval.dataset", "arithmetic", True, lambda r, s: r._evaluator.prompts[0].source.endswith(" (train)")),
    ("eval.datasets", "eval_sets", ["heldout", "again"], lambda r, s: [p.name for p in r._evaluator.prompts]),
    # precision and the compiled regions
    ("master_rounding", "bf16_compiled", CFG, lambda r, s: r._master.rounding),
    ("master_weights", "bf16_rollout", None, lambda r, s: r._master),
    ("master_weights", "bf16_rollout", None, lambda r, s: r._update._master),
    ("compile.generate", "bf16_compiled", True, lambda r, s: r._rollout.generator._steps.compiled),
    ("compile.trajectory", "bf16_compiled", True, lambda r, s: _is_compiled(r._rollout._score, _eager()[0])),
    ("compile.trajectory", "bf16_compiled", True, lambda r, s: r._rollout._compiled_scoring),
    ("compile.loss_step", "bf16_compiled", True, lambda r, s: _is_compiled(r._update.loss_step, _eager()[1])),
    ("compile.optimizer", "bf16_compiled", True, lambda r, s: _is_compiled(r._master._step_fn, _eager()[2])),
    ("compile.mode", "bf16_compiled", True, lambda r, s: any("uses CUDA graphs" in w for w in s["warnings"])),
    ("compile_cache", "bf16_compiled", "CACHE", lambda r, s: r._recompiles._cache.path.name),
    ("compile.rollout", "bf16_rollout", True, lambda r, s: r._rollout._fused is not None),
    ("compile.layers", "layers", True, lambda r, s: _layer_steps(r._models.policy)),
    ("compile.layers", "layers", True, lambda r, s: _layer_steps(r._models.value)),
    # multi-turn episodes
    ("turns.max_turns", "tools", CFG, lambda r, s: r._rollout.turns.settings.max_turns),
    ("turns.max_observation_tokens", "tools", CFG, lambda r, s: r._rollout.turns.settings.max_observation_tokens),
    ("turns.observation_template", "tools", ("=>", ""),
     lambda r, s: (r._rollout.turns.renderer.before, r._rollout.turns.renderer.after)),
    ("turns.cache_tokens", "tools", CFG, lambda r, s: r._rollout.generator.cache_tokens),
    ("turns.timeout_s", "tools", CFG, lambda r, s: r._rollout.turns.settings.timeout_s),
    ("turns.isolation", "tools", CFG, lambda r, s: r._rollout.turns.settings.isolation),
    ("turns.stop_strings", "tools", ("</calc>",), lambda r, s: r._rollout.turns.settings.stop_strings),
    ("turns.max_env_failures", "tools", CFG, lambda r, s: r._rollout.turns.settings.max_env_failures),
    # the models
    ("share_reward_value_base", "lora_unshared", False,
     lambda r, s: type(r._models.reward).__name__ == "SharedBaseReward"),
]


def _value(build, key):
    value = BUILDS[build][1][key]
    return OmegaConf.create({"v": value}).v if isinstance(value, str) and value.startswith(("[", "'")) else value


def _id(row):
    return f"{row[0]}@{row[1]}"


def _ids(rows):
    ids, seen = [], {}
    for row in rows:
        base = _id(row)
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return ids


@pytest.mark.parametrize("key,build,expected,reader", HANDOFFS, ids=_ids(HANDOFFS))
def test_a_key_at_a_value_other_than_its_default_reaches_its_part(built, key, build, expected, reader):
    recipe, cfg, seen = built(build)
    if expected is CFG:
        expected = OmegaConf.select(cfg, key)
    got = reader(recipe, seen)
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-6), (key, got)
    else:
        assert got == expected, (key, got)


def test_the_evaluation_shares_its_prompts_prefix_unless_told_not_to(built):
    """``share_prompt_prefix`` at its default (null) and true: the evaluation's generator computes
    the prefix its prompts share once a call; false: not (the ``eval_prefix`` build above)."""
    recipe, cfg, _ = built("eval_prefix_default")
    assert cfg.share_prompt_prefix is None
    assert recipe._evaluator.generator.prefix_len == _eval_prefix(recipe) > 0


def test_every_builds_value_is_other_than_the_default_and_the_shipped_configs():
    """Not vacuous: a hand-off that passes the default (or leaves the shipped config's value)
    would give each part another value than the build's."""
    from torchtune_ppo.config.schema import Block

    from conftest import TINY_CONFIG

    same = []
    for name, (config, overrides) in BUILDS.items():
        shipped = OmegaConf.load(TINY_CONFIG.parent / config)
        for key, value in overrides.items():
            top, _, sub = key.partition(".")
            if top in ("compile", "profiler", "metric_logger", "reward", "optimizer") or key.startswith(
                    ("eval.reward", "eval.dataset")):
                continue  # blocks: their default is off (null, false) or the shipped config's block
            default = KEYS[top].default
            if sub and isinstance(KEYS[top].kind, Block):
                default = KEYS[top].kind.defaults()[sub]
            value = _value(name, key)
            if value in PATHS or (name, key) == ("tools", "eval.every_n_steps"):
                continue
            if value == default or value == OmegaConf.select(shipped, key):
                same.append((name, key, value))
    assert same == []


# ---- behaviours ----------------------------------------------------------------------------


def _data(tmp_path, n, name="prompts.json"):
    with open(torchtune_ppo.asset_path("tiny_sentiment/prompts.json")) as f:
        rows = json.load(f)[:n]
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """6 steps of the recipe's loop (each step's work a row of metrics) with ``log_every_n_steps=3``
    over 16 prompts: the steps the metric logger was given, and the run's last checkpoint."""
    from ppo_full_finetune import PPOFullFinetuneRecipe

    tmp = tmp_path_factory.mktemp("fake_run")
    data = _data(tmp, 16)
    overrides = dict(num_ppo_steps=6, log_every_n_steps=3, save_every_n_steps="null",
                     **{"dataset.data_files": str(data)})
    cfg = recipe_config(tmp / "run", **overrides)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    _fake_steps(recipe)
    logged = []
    log_dict = recipe._metric_logger.log_dict

    @functools.wraps(log_dict)
    def recording(metrics, step):
        logged.append(step)
        return log_dict(metrics, step)

    recipe._metric_logger.log_dict = recording
    recipe.train()
    recipe.cleanup()
    return logged, cfg, overrides, data, tmp


def test_log_every_n_steps_reaches_the_metric_logging(fake_run):
    logged, *_ = fake_run
    assert logged == [3, 6]


def test_resume_accept_data_change_reaches_the_resumes_data_check(fake_run):
    """The data file changed after the run saved: the resume's preflight refuses it by default and
    takes it with ``resume_accept_data_change=True``."""
    from torchtune import utils

    from torchtune_ppo.checkpointing import release_output_dir
    from torchtune_ppo.run.preflight import preflight

    _, _, overrides, data, tmp = fake_run
    data.write_text(json.dumps(json.loads(data.read_text())[:12]))
    for accept in (False, True):
        cfg = recipe_config(tmp / "run", resume_from_checkpoint=True, resume_accept_data_change=accept, **overrides)
        try:
            if accept:
                assert preflight(cfg, world_size=1, log=utils.get_logger("INFO")).resume_from
            else:
                with pytest.raises(Exception, match="resume_accept_data_change"):
                    preflight(cfg, world_size=1, log=utils.get_logger("INFO"))
        finally:
            release_output_dir(cfg.output_dir)  # the preflight holds the run folder, as a run would
