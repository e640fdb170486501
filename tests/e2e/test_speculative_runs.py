"""Speculative rollouts through `tune run` on the tiny task, 8 prompts so every step is an epoch:
drafts from the previous epoch change nothing the run logs but how the responses were computed,
and a resumed run (its draft store in the checkpoint) repeats the uninterrupted one."""

import json
import shutil

import pytest

from torchtune_ppo import asset_path

from e2e.test_recipe import run_recipe

STEPS = 4
SPEC = ["compile=False", f"num_ppo_steps={STEPS}", "speculative.enabled=True", "speculative.noise=per_prompt",
        "speculative.max_draft_tokens=4"]
SAME = ("scores", "response_lengths", "num_stop_tokens")
CLOSE = ("loss", "policy_loss", "value_loss", "kl", "ratios")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts8.json"
    with open(asset_path("tiny_sentiment/prompts.json")) as f:
        path.write_text(json.dumps(json.load(f)[:8]))
    return path


@pytest.fixture(scope="module")
def runs(prompts, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    data = f"dataset.data_files={prompts}"
    _, plain = run_recipe(root / "plain", *SPEC, data, "speculative.draft=none")
    _, drafted = run_recipe(root / "drafted", *SPEC, data, "save_every_n_steps=2")
    return root, data, plain, drafted


def test_drafts_change_how_not_what(runs):
    _, _, plain, drafted = runs
    assert len(plain) == len(drafted) == STEPS
    for step in range(STEPS):
        for key in SAME:
            assert drafted[step][key] == plain[step][key], (step, key)
        # a chunk forward rounds the logprobs differently from a one-token forward
        for key in CLOSE:
            assert drafted[step][key] == pytest.approx(plain[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert plain[step]["spec/verify_forwards"] == 0
    assert drafted[0]["spec/rows_with_draft"] == 0  # the first epoch has no drafts
    for row in drafted[1:]:
        assert row["spec/rows_with_draft"] == 1.0 and row["spec/acceptance"] > 0 and row["spec/forwards_saved"] > 0
        assert row["spec/forwards"] < plain[1]["spec/forwards"] + plain[2]["spec/forwards"]


def test_a_resumed_run_keeps_its_drafts(runs, tmp_path):
    root, data, _, drafted = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "drafted", resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS}")
    shutil.rmtree(resumed / "logs")
    _, again = run_recipe(resumed, *SPEC, data, "resume_from_checkpoint=True")
    assert len(again) == 2
    for got, want in zip(again, drafted[2:]):
        for key in (*SAME, *CLOSE, "spec/acceptance", "spec/forwards"):
            assert got[key] == want[key], key



def test_compiled_speculation_compiles_in_the_first_step_and_matches_eager(runs, tmp_path):
    """compile=True (every region, one layer compiled per use): the first step has no drafts, yet
    both verification regions compile in it; the steps with drafts compile nothing."""
    from conftest import assert_compiled_matches_eager

    _, data, plain, _ = runs
    compiled_spec = [s for s in SPEC if s != "compile=False"]
    _, rows = run_recipe(tmp_path / "compiled", *compiled_spec, data, "compile=True")
    assert [r["recompiles"] for r in rows] == [0] * STEPS
    assert all(r["spec/verify_forwards"] > 0 for r in rows[1:])
    assert_compiled_matches_eager(rows, plain, STEPS)


def test_groups_get_their_own_drafts(runs, tmp_path):
    """GRPO with 2 samples a prompt: each sample's draft is its own last response (sample index in
    the key), and the drafted run logs the plain one's scores and group statistics."""
    root, data, _, _ = runs
    grpo = ["advantage_estimator=grpo", "num_samples_per_prompt=2"]
    _, plain = run_recipe(tmp_path / "plain", *SPEC, data, *grpo, "speculative.draft=none")
    _, drafted = run_recipe(tmp_path / "drafted", *SPEC, data, *grpo)
    for step in range(STEPS):
        for key in (*SAME, "group_score_std", "zero_std_groups"):
            assert drafted[step][key] == plain[step][key], (step, key)
        assert drafted[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-4, abs=1e-6)
    assert all(r["spec/acceptance"] > 0 for r in drafted[1:])
    # the two samples of a prompt are two draws (their keys differ), so some group's scores differ
    assert any(r["group_score_std"] > 0 for r in plain)


def test_prompt_lookup_drafts_change_how_not_what(runs, tmp_path):
    _, data, plain, _ = runs
    _, rows = run_recipe(tmp_path / "ngram", *SPEC, data, "speculative.draft=ngram")
    for step in range(STEPS):
        for key in SAME:
            assert rows[step][key] == plain[step][key], (step, key)
        assert rows[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-4, abs=1e-6)
