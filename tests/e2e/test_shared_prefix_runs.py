"""Whole runs with the prefix every prompt begins with packed once per row
(``share_prompt_prefix``): the tiny sentiment task's prompts behind one long common opening, the
run without sharing within float rounding, fewer loss-step slots, and compiled == eager with
nothing recompiled after step 1."""

import json

import pytest

from conftest import TINY_CONFIG, assert_compiled_matches_eager

OPENING = "to put it in a few words , what i would say about this one is that"
SHAPE = dict(batch_size=8, forward_batch_size=8, ppo_batch_size=8, gradient_accumulation_steps=1,
             max_prompt_len=32, num_ppo_steps=3, save_every_n_steps="null")


@pytest.fixture
def prompts_file(tmp_path):
    source = TINY_CONFIG.parents[3] / "torchtune_ppo/tasks/tiny_sentiment/assets/prompts.json"
    rows = [{"prompt": f"{OPENING} {row['prompt']}"} for row in json.loads(source.read_text())]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(rows))
    return str(path)


def _train(recipe):
    rows = []
    recipe.train(on_step=lambda step, metrics: rows.append(metrics))
    return rows


def test_prefix_run_matches_the_unshared_run(make_recipe, prompts_file):
    """Three PPO steps with a value model and a reward model: every logged number of the run
    that packs the opening once per row is the unshared run's, to float32 rounding grown over
    the updates (the bound of compiled against eager); its loss step runs on fewer slots."""
    shared_recipe, cfg = make_recipe(**SHAPE, **{"dataset.data_files": prompts_file})
    assert cfg.share_prompt_prefix is None and shared_recipe._prefix  # on: the opening is long enough
    assert shared_recipe._rollout._share_prefix and shared_recipe._update._share_prefix
    gen = shared_recipe._rollout.generator  # generation computes the opening once a call too
    assert gen.prefix_len > len(OPENING.split()) // 2
    shared = _train(shared_recipe)
    assert gen.prefix_shared  # the last call did
    unshared_recipe, _ = make_recipe(**SHAPE, share_prompt_prefix=False, **{"dataset.data_files": prompts_file})
    assert not unshared_recipe._prefix and unshared_recipe._rollout.generator.prefix_len == 0
    unshared = _train(unshared_recipe)
    assert len(shared) == len(unshared) == 3
    assert_compiled_matches_eager(shared, unshared, steps=3)
    for a, b in zip(shared, unshared):
        assert a["response_lengths"] == b["response_lengths"] and a["scores"] == pytest.approx(b["scores"], abs=1e-5)
        assert a["loss_step_slots_per_token"] < 0.8 * b["loss_step_slots_per_token"]


def test_the_shipped_tiny_prompts_share_too_little(make_recipe):
    recipe, _ = make_recipe()
    assert not recipe._prefix and not recipe._rollout._share_prefix and recipe._rollout.generator.prefix_len == 0


def test_compiled_prefix_run_matches_eager_without_recompiles(make_recipe, prompts_file, monkeypatch):
    """Generation (the opening once a call), scoring and the loss step compiled (dynamo's eager
    backend: the same tracing and guards as inductor), rows cut to their length: the eager run's
    numbers, no graph after step 1."""
    data = {"dataset.data_files": prompts_file}
    eager = _train(make_recipe(**SHAPE, **data)[0])
    monkeypatch.setenv("TORCHTUNE_PPO_COMPILE_BACKEND", "eager")
    recipe, _ = make_recipe(**SHAPE, **data, **{
        "compile.generate": True, "compile.trajectory": True, "compile.loss_step": True, "compile.rollout": False})
    compiled = _train(recipe)
    assert recipe._rollout.generator.prefix_shared
    assert [r["recompiles"] for r in compiled[1:]] == [0, 0]
    assert_compiled_matches_eager(compiled, eager, steps=3)
