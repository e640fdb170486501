"""Whole runs with a group's prompt computed once (share_group_prefill, on by default with
groups): the run of each response with its own prompt copy, drawn by the same whole groups,
within float rounding; compiled == eager with nothing recompiled after step 1; on 2 processes
(FSDP2, fixed-shape loss steps) the 1-process unshared run's numbers."""

import pytest
import torch

from conftest import assert_compiled_matches_eager

GROUPS = dict(num_samples_per_prompt=4, batch_size=4, forward_batch_size=8, ppo_batch_size=8,
              gradient_accumulation_steps=2, num_ppo_steps=3, save_every_n_steps="null")


def _train(recipe):
    rows = []
    recipe.train(on_step=lambda step, metrics: rows.append(metrics))
    return rows


def _unshared(recipe):
    """The same recipe with each response scored and trained with its own prompt copy; the
    generation's one prefill per group (bit for bit the n prefills' tokens on CPU) and the
    group-wise minibatch draw stay."""
    recipe._rollout._group_size = 1
    recipe._update._share = False
    return recipe


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_shared_run_matches_the_unshared_run_with_the_same_draw(make_recipe, estimator):
    """Three steps of GRPO (no value model) and of PPO with a value model, on the tiny task's
    reward model: every logged number of the shared run is the unshared run's, to float32
    rounding grown over the updates (the same bound as compiled against eager)."""
    shared_recipe, cfg = make_recipe(advantage_estimator=estimator, **GROUPS)
    assert shared_recipe._group == 4 and cfg.share_group_prefill is None  # on by default
    shared = _train(shared_recipe)
    unshared = _train(_unshared(make_recipe(advantage_estimator=estimator, **GROUPS)[0]))
    assert len(shared) == len(unshared) == 3
    assert_compiled_matches_eager(shared, unshared, steps=3)
    for a, b in zip(shared, unshared):
        assert a["response_lengths"] == b["response_lengths"] and a["scores"] == pytest.approx(b["scores"], abs=1e-5)
        if estimator == "gae":
            assert a["value_loss"] == pytest.approx(b["value_loss"], rel=2e-2, abs=2e-4) and b["value_loss"] > 0


def test_off_draws_rows_and_packs_each_prompt(make_recipe):
    recipe, _ = make_recipe(advantage_estimator="grpo", share_group_prefill=False, **GROUPS)
    assert recipe._group == 1 and recipe._update.group_size == 1 and recipe._rollout._group_size == 1


def test_compiled_shared_run_matches_eager_without_recompiles(make_recipe, monkeypatch):
    """Scoring and loss step compiled (dynamo's eager backend: the same tracing and guards as
    inductor) with shared prompts: the eager run's numbers, no graph compiled after step 1."""
    eager = _train(make_recipe(advantage_estimator="gae", **GROUPS)[0])
    monkeypatch.setenv("TORCHTUNE_PPO_COMPILE_BACKEND", "eager")
    recipe, _ = make_recipe(advantage_estimator="gae", **GROUPS, **{
        "compile.generate": False, "compile.trajectory": True, "compile.loss_step": True, "compile.rollout": False})
    compiled = _train(recipe)
    assert [r["recompiles"] for r in compiled[1:]] == [0, 0]
    assert_compiled_matches_eager(compiled, eager, steps=3)


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_two_processes_shared_match_one_process_unshared(tmp_path):
    """PPO with a value model, groups of 2, greedy: on 2 processes (FSDP2, the loss step's fixed
    shapes) with shared prompts, and on 1 process with each prompt copied per response, one
    minibatch of the 16 responses, so that the draw does not matter: the same logged numbers."""
    from test_distributed import _assert_rows_match, _launch
    from torchtune_ppo.run.logs import read_disk_log

    groups = ("num_samples_per_prompt=2", "forward_batch_size=16", "ppo_batch_size=16")
    _launch(tmp_path / "one", 1, *groups, "share_group_prefill=False")
    out = _launch(tmp_path / "two", 2, *groups, "share_group_prefill=True")
    assert "share_group_prefill is off" not in out
    one, two = read_disk_log(tmp_path / "one/logs"), read_disk_log(tmp_path / "two/logs")
    assert len(one) == len(two) == 3
    _assert_rows_match(one, two)
