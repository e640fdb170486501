"""GRPO through `tune run` on the tiny task: groups of 2 responses per prompt, no value model
built, trained or saved; resume repeats the uninterrupted run; compiled scoring and loss step
(with no value model) match eager and do not recompile after step 1, on one process and on two; one
prefill per group (share_group_prefill) repeats the run of n prefills, eager and compiled."""

import math
import shutil
from pathlib import Path

import pytest
import torch

from torchtune_ppo.checkpointing.store import load_training_state
from torchtune_ppo.run.logs import read_disk_log, read_eval_log
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy

from conftest import assert_compiled_matches_eager
from test_recipe import run_recipe

GRPO = ["advantage_estimator=grpo", "num_samples_per_prompt=2", "num_ppo_steps=3", "save_every_n_steps=2"]


@pytest.fixture(scope="module")
def eager_grpo(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "eager"
    proc, rows = run_recipe(out, *GRPO, "compile=False")
    return out, proc, rows


def test_grpo_run_has_no_value_model(eager_grpo):
    out, proc, rows = eager_grpo
    assert len(rows) == 3
    for row in rows:
        assert math.isfinite(row["loss"]) and row["loss"] == row["policy_loss"] and row["value_loss"] == 0
        assert 0 <= row["zero_std_groups"] <= 1 and row["group_score_std"] >= 0
        assert row["num_stop_tokens"] <= 16  # 8 prompts x 2 responses
    assert "value_checkpointer is ignored" in proc.stderr
    assert "no value model" in proc.stderr  # the memory plan
    for step in (2, 3):
        ckpt = out / "checkpoints" / f"step_{step}"
        assert sorted(p.name for p in ckpt.iterdir()) == ["COMPLETE", "config.yaml", "policy", "training_state.pt"]
    # the optimizer holds the policy's parameters only
    state = load_training_state(out / "checkpoints/step_3")
    n_policy = len(list(tiny_policy().parameters()))
    assert [len(g["params"]) for g in state["optimizer"]["param_groups"]] == [n_policy]


def test_grpo_resume_repeats_the_uninterrupted_run(eager_grpo, tmp_path):
    out, _, rows = eager_grpo
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints/step_3")
    shutil.rmtree(resumed / "logs")
    _, again = run_recipe(resumed, *GRPO, "compile=False", "resume_from_checkpoint=True")
    assert len(again) == 1
    for key in ("scores", "kl", "loss", "policy_loss", "ratios", "group_score_std", "zero_std_groups"):
        assert again[0][key] == pytest.approx(rows[2][key], rel=1e-6, abs=1e-7), key


def test_compiled_grpo_matches_eager_without_recompiles(eager_grpo, tmp_path):
    _, _, eager = eager_grpo
    _, rows = run_recipe(tmp_path / "compiled", *GRPO, "compile.generate=False", "compile.trajectory=True",
                         "compile.loss_step=True", "compile.rollout=False")
    assert len(rows) == 3 and [r["recompiles"] for r in rows[1:]] == [0, 0]
    for step in range(3):
        # as test_recipe.test_all_compiled_matches_eager: same sampled tokens, fp32 summation order
        for key in ("scores", "response_lengths", "group_score_std"):
            assert rows[step][key] == pytest.approx(eager[step][key], rel=1e-3, abs=1e-3), (step, key)
        for key in ("loss", "policy_loss", "kl", "approx_policy_kl"):
            assert rows[step][key] == pytest.approx(eager[step][key], rel=2e-2, abs=2e-4), (step, key)
        assert rows[step]["value_loss"] == 0


def test_shared_group_prefill_repeats_the_n_prefill_run(eager_grpo, tmp_path):
    """One prefill per group, its KV cache copied into the group's rows: the same sampled tokens
    (the first token of each row from the group's shared logits and the row's own draw), so the
    same run. On CPU the prefill of B / n rows gives the bits of B rows (see
    parity/test_generation.py), so the metrics agree to float32 rounding."""
    _, _, eager = eager_grpo
    _, rows = run_recipe(tmp_path / "shared", *GRPO, "compile=False", "share_group_prefill=True")
    assert len(rows) == 3
    for step in range(3):
        for key in ("scores", "response_lengths", "num_stop_tokens", "group_score_std", "zero_std_groups"):
            assert rows[step][key] == eager[step][key], (step, key)
        for key in ("loss", "policy_loss", "kl", "ratios", "approx_policy_kl"):
            assert rows[step][key] == pytest.approx(eager[step][key], rel=1e-6, abs=1e-7), (step, key)


def test_compiled_shared_group_prefill_matches_eager_without_recompiles(eager_grpo, tmp_path):
    """compile.generate with share_group_prefill: its own prefill region (G = B / n rows) and the
    decode step each compile once, and the run matches the eager run of n prefills."""
    _, _, eager = eager_grpo
    _, rows = run_recipe(tmp_path / "compiled_shared", *GRPO, "share_group_prefill=True", "compile.generate=True",
                         "compile.trajectory=False", "compile.loss_step=False", "compile.rollout=False")
    assert len(rows) == 3 and [r["recompiles"] for r in rows[1:]] == [0, 0]
    assert_compiled_matches_eager(rows, eager, steps=3)


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_two_processes_match_one_without_a_value_model(tmp_path):
    """REINFORCE++ with 2 greedy responses per prompt: each rank repeats its own prompts, whitens
    over both ranks, shards and saves the policy only; the logged numbers are the 1-process run's."""
    from test_distributed import _assert_rows_match, _run

    options = ("advantage_estimator=reinforce_plus_plus", "num_samples_per_prompt=2",
               "forward_batch_size=16", "ppo_batch_size=16")  # one minibatch of the 16 responses
    one = _run(tmp_path / "one", 1, *options)
    two = _run(tmp_path / "two", 2, *options)
    assert len(one) == len(two) == 3
    _assert_rows_match(one, two)
    for a, b in zip(one, two):
        assert a["value_loss"] == b["value_loss"] == 0
        # greedy: both responses of a group are the same
        assert a["zero_std_groups"] == b["zero_std_groups"] == 1.0
    assert sorted(p.name for p in (tmp_path / "two/checkpoints/step_3").iterdir()) == [
        "COMPLETE", "config.yaml", "policy", "training_state.pt"]


# The GRPO config of the arithmetic task (a function reward, no reward model), greedy so that 1
# and 2 processes generate the same responses (test_distributed's OVERRIDES): both responses of
# a group are the same, so their rewards are exactly equal (ExactMatch; kl_coeff 0 keeps the
# KL's rounding out of them) and GRPO's advantages exactly 0. The policy moves by the loss's KL
# term and entropy bonus, which the critic-free loss step computes too. One minibatch of the 16
# responses: the ranks' rows form the 1-process minibatch. (With a reward model, equal responses
# may score a rounding error apart; GRPO gives a group with std at most 1e-6 no advantage, so
# that rounding is not divided up to O(0.1): unit/test_advantages.py.)
GRPO_CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/grpo_tiny_arithmetic.yaml"
GRPO_GREEDY = ("advantage_estimator=grpo", "num_samples_per_prompt=2", "forward_batch_size=16", "ppo_batch_size=16",
               "max_generated_tokens=6", "kl_coeff=0", "loss.kl_coeff=0.1", "loss.entropy_coeff=0.01",
               "num_ppo_steps=2", "save_every_n_steps=null")


@pytest.fixture(scope="module")
def one_eager_grpo_process(tmp_path_factory):
    """The run's logged rows, and its held-out evaluations (the config's: greedy, before step 1
    and after the last)."""
    from test_distributed import _run

    out = tmp_path_factory.mktemp("grpo_one") / "run"
    return _run(out, 1, *GRPO_GREEDY, config=GRPO_CONFIG), read_eval_log(out / "logs")


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_compiled_two_processes_match_one_eager_process_without_a_value_model(one_eager_grpo_process, tmp_path):
    """compile=True on 2 processes with no value model: generation, scoring (the reference,
    sharded and gathered) and the policy-only loss step under FSDP2 log the 1-process eager
    GRPO run's numbers, with nothing recompiled after step 1; the held-out evaluations, each
    process generating for its half of the prompts, log the 1-process run's metrics."""
    from test_distributed import _assert_rows_match, _launch

    one, one_evals = one_eager_grpo_process
    out = _launch(tmp_path / "two", 2, *GRPO_GREEDY, "compile=True", "shard_frozen_models=True", timeout=600,
                  config=GRPO_CONFIG)
    assert "CompileConfig(generate=True, trajectory=True, loss_step=True, rollout=False" in out
    two = read_disk_log(tmp_path / "two/logs")
    assert len(one) == len(two) == 2
    _assert_rows_match(one, two)  # and 0 recompiles in every row of the compiled run
    for a, b in zip(one, two):
        for key in ("entropy", "kl_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])
        assert a["value_loss"] == b["value_loss"] == 0
        assert a["policy_loss"] == b["policy_loss"] == 0  # GRPO's advantages: exactly 0
        assert a["zero_std_groups"] == b["zero_std_groups"] == 1.0
    # not vacuous: step 1 moved the policy away from the reference
    assert abs(one[1]["kl"]) > 1e-6 and abs(one[1]["kl_loss"]) > 1e-9
    # the last step's checkpoint is written before its evaluation, which is then recorded in it
    assert sorted(p.name for p in (tmp_path / "two/checkpoints/step_2").iterdir()) == [
        "COMPLETE", "config.yaml", "evaluation.json", "policy", "training_state.pt"]
    # each process evaluates its half of the 500 held-out problems: the sums give the one process's metrics
    two_evals = read_eval_log(tmp_path / "two/logs")
    assert [step for step, _ in two_evals] == [step for step, _ in one_evals] == [0, 2]
    for (_, a), (_, b) in zip(one_evals, two_evals):
        assert {k: v for k, v in a.items() if k != "time/eval"} == pytest.approx(
            {k: v for k, v in b.items() if k != "time/eval"}, rel=1e-12)
