"""``dtype=bf16`` through ``tune run`` on the tiny task: bf16 weights, fp32 master weights in the
optimizer and in every checkpoint, and a resume that repeats the uninterrupted run exactly."""

import math
from pathlib import Path

import pytest
import torch

from torchtune_ppo.checkpointing.store import load_training_state

from test_recipe import run_recipe

BF16 = ("dtype=bf16", "compile=False", "save_every_n_steps=2")
# fused against four passes, mean |gap| over the mean move of four steps: measured 0.26% (Adam
# moves a weight by ~lr whatever its gradient's size, so a gradient near 0 that a bf16 rounding
# flipped moves it the other way); a step missing its bias correction or clip moves them ~3x.
MASTER_TOL = 0.02
# bf16 with inductor's kernels against eager bf16, step 1 on the tiny task; measured (2026-12-07):
# scores and lengths equal, kl 0 against -5.3e-3, loss 2e-3 relative, policy loss 4e-4, value
# loss 4e-5 relative, ratios 1.3e-4. The bounds are ~4-25x those; step 1's KL with a wrong mask or
# position is several times larger.
BF16_INDUCTOR_TOL = {"scores": dict(rel=1e-3, abs=1e-3), "kl": dict(abs=2e-2), "loss": dict(rel=1e-2),
                     "policy_loss": dict(abs=2e-3), "value_loss": dict(rel=1e-3), "ratios": dict(abs=1e-3)}


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step}"


def test_bf16_run_keeps_fp32_masters_and_resumes_exactly(tmp_path):
    straight, rows = run_recipe(tmp_path / "straight", "num_ppo_steps=4", *BF16)
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)
    state = load_training_state(_step(tmp_path / "straight", 2))
    masters = state["master_weights"]["masters"]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    # the optimizer's state is the masters': fp32 too
    exp_avg = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert exp_avg and all(t.dtype == torch.float32 for t in exp_avg)
    # the saved bf16 weights are the masters rounded (the policy's first trained parameter)
    from safetensors.torch import load_file

    weights = load_file(str(next((_step(tmp_path / "straight", 2) / "policy").glob("*.safetensors"))))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())

    out = tmp_path / "resumed"
    run_recipe(out, "num_ppo_steps=2", *BF16)
    _, resumed = run_recipe(out, "num_ppo_steps=4", "resume_from_checkpoint=True", *BF16)
    assert len(resumed) == 2
    for a, b in zip(rows[2:], resumed):  # steps 3 and 4, bit for bit
        for key in ("loss", "policy_loss", "value_loss", "kl", "scores", "ratios"):
            assert a[key] == b[key], key
    final_a = load_training_state(_step(tmp_path / "straight", 4))["master_weights"]["masters"]
    final_b = load_training_state(_step(out, 4))["master_weights"]["masters"]
    assert all(torch.equal(x, y) for x, y in zip(final_a, final_b))


def test_the_rollout_training_mismatch_is_logged_in_fp32_and_bf16(tmp_path):
    """rollout_corr/*: the generator's logprobs against the trainer's at the first minibatch.
    In fp32 the two forwards agree to rounding. In bf16 on CPU, where attention is computed in
    fp32 by the generator and the trainer alike, the tiny model's products round the same way
    in both (measured: 0 exactly; SmolLM2-135M's do not, ~4e-2: docs/precision.md), so the bf16
    bound is the one a bf16 forward can miss by, not a floor. In fp32 the cached decode and the
    packed forward sum in different orders: the gap is rounding, above 0 (a metric never
    computed, logged as 0, fails here) and below 1e-4."""
    _, fp32 = run_recipe(tmp_path / "fp32", "num_ppo_steps=1", "compile=False")
    _, bf16 = run_recipe(tmp_path / "bf16", "num_ppo_steps=1", "compile=False", "dtype=bf16")
    a, b = fp32[0], bf16[0]
    assert 0 < a["rollout_corr/abs_diff_mean"] <= a["rollout_corr/abs_diff_max"] < 1e-4
    assert 0 <= a["rollout_corr/kl_k3"] < 1e-8
    assert 0 <= b["rollout_corr/abs_diff_mean"] <= b["rollout_corr/abs_diff_max"] < 5e-2
    assert abs(b["rollout_corr/kl_k3"]) < 1e-3 and abs(b["rollout_corr/log_ratio_mean"]) < 1e-2


def test_rollout_corrections_recompute_the_old_logprobs_and_weight_the_loss(tmp_path):
    """With rollout_correction the trainer's logprobs are the old ones: in fp32 they are the
    generator's to rounding, so TIS truncates nothing and weighs ~1; MIS with a threshold within
    that rounding (log C = 1e-7; measured mean |d| ~4e-7, many tokens exactly 0) masks some
    tokens and keeps others. (The tiny model in bf16 on CPU shows no gap at all to mask.)"""
    _, fp32 = run_recipe(tmp_path / "tis", "num_ppo_steps=1", "compile=False", "rollout_correction.mode=tis")
    row = fp32[0]
    assert row["rollout_corr/corrected_frac"] == 0.0
    assert row["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert row["rollout_corr/abs_diff_max"] < 1e-4
    _, mis = run_recipe(tmp_path / "mis", "num_ppo_steps=1", "compile=False",
                        "rollout_correction.mode=mis", "rollout_correction.threshold=1.0000001")
    row = mis[0]
    assert 0.0 < row["rollout_corr/corrected_frac"] < 1.0 and 0.0 < row["rollout_corr/weight_mean"] < 1.0
    assert math.isfinite(row["loss"])


def test_bf16_compiled_equals_eager_without_recompiles(tmp_path, monkeypatch):
    """Every region compiled in bf16, traced by dynamo on its eager backend (the guards, and so
    the recompiles, are inductor's; the kernels are eager's, so the numbers are comparable
    exactly): 0 recompiles after step 1 and the eager run's metrics. The optimizer's one-pass
    step (compile.optimizer) is left out here: it computes the same fp32 update in another order
    (tests/unit/test_optim.py holds it to 1e-6 against the four passes), and a master within
    rounding of a bf16 midpoint then rounds to the other neighbour, which later steps' bf16
    forwards carry on; the next test runs it."""
    _, eager = run_recipe(tmp_path / "eager", "num_ppo_steps=3", *BF16)
    monkeypatch.setenv("TORCHTUNE_PPO_COMPILE_BACKEND", "eager")
    regions = ("compile.generate=True", "compile.trajectory=True", "compile.loss_step=True",
               "compile.rollout=False", "compile.optimizer=False")
    _, compiled = run_recipe(tmp_path / "compiled", "num_ppo_steps=3", "dtype=bf16", *regions)
    assert [r["recompiles"] for r in compiled] == [0.0, 0.0, 0.0]
    for a, b in zip(eager, compiled):
        for key in ("scores", "response_lengths", "loss", "policy_loss", "value_loss", "kl",
                    "rollout_corr/abs_diff_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_bf16_with_inductor_is_eager_within_bf16_rounding(tmp_path):
    """compile=True in bf16 with inductor's own kernels (one layer compiled per use, every
    region around it): step 1 against the eager run. Inductor fuses chains of ops that eager
    rounds to bf16 after each one, so the numbers differ by bf16 rounding, not more: the rollout
    (scores, response lengths, the KL to the reference: before any update) and the first
    minibatch's losses. BF16_INDUCTOR_TOL is what the tiny model's differences measured, with a
    margin; a wrong mask, position or temperature moves these by far more. Both round their masters
    to nearest: with ``dither`` every weight has a threshold somewhere in its spacing, so the two
    runs' fp32 masters, a rounding apart after the first update, flip a few weights apart and the
    later minibatches' ratios drift by more than the kernels' own differences (measured 3.4e-3);
    the dithered rounding itself is compared bit for bit in ``unit/test_optim.py``."""
    nearest = "master_rounding=nearest"
    _, eager = run_recipe(tmp_path / "eager", "num_ppo_steps=1", *BF16, nearest)
    _, compiled = run_recipe(tmp_path / "compiled", "num_ppo_steps=1", "dtype=bf16", "compile=True",
                             "save_every_n_steps=2", nearest)
    a, b = eager[0], compiled[0]
    assert b["response_lengths"] == a["response_lengths"]
    for key, tol in BF16_INDUCTOR_TOL.items():
        assert b[key] == pytest.approx(a[key], **tol), key


def test_the_one_pass_optimizer_step_trains_as_the_four_passes_without_recompiles(tmp_path, monkeypatch):
    """compile=True in bf16 includes compile.optimizer: each master's clip, AdamW step and
    rounding in one compiled pass. 0 recompiles after step 1 (one graph for every parameter
    shape); step 1's rollout (before any update) the eager run's; and step 1's four optimizer
    steps on that one rollout leave the fp32 masters as the four passes do, to a small share of
    what they moved (a skipped clip, decay or bias correction changes the move itself). Later
    steps are not compared: a master within rounding of a bf16 midpoint rounds to the other
    neighbour, the next rollout samples other tokens, and the runs part."""
    _, eager = run_recipe(tmp_path / "eager", "num_ppo_steps=2", "dtype=bf16", "compile=False", "save_every_n_steps=1")
    monkeypatch.setenv("TORCHTUNE_PPO_COMPILE_BACKEND", "eager")
    proc, fused = run_recipe(tmp_path / "fused", "num_ppo_steps=2", "dtype=bf16", "compile=True",
                             "save_every_n_steps=1")
    assert "one compiled pass (compile.optimizer)" in proc.stdout + proc.stderr
    assert [r["recompiles"] for r in fused] == [0.0, 0.0]
    # the rollout of step 1 comes before any optimizer step (its losses come after four)
    for key in ("scores", "response_lengths", "kl", "rollout_corr/abs_diff_max"):
        assert fused[0][key] == pytest.approx(eager[0][key], rel=1e-5, abs=1e-6), key
    a = load_training_state(_step(tmp_path / "eager", 1))["master_weights"]["masters"]
    b = load_training_state(_step(tmp_path / "fused", 1))["master_weights"]["masters"]
    later = load_training_state(_step(tmp_path / "eager", 2))["master_weights"]["masters"]
    moved = torch.cat([(x - s).abs().flatten() for x, s in zip(later, a)])  # what four steps move them
    gap = torch.cat([(x - y).abs().flatten() for x, y in zip(a, b)])
    print(f"four steps move the masters by {moved.mean():.3e} on average (max {moved.max():.3e}); "
          f"after step 1 fused against four passes {gap.mean():.3e} (max {gap.max():.3e})")
    assert moved.mean() > 1e-5 and gap.mean() < MASTER_TOL * moved.mean()


def test_plain_bf16_runs_without_masters(tmp_path):
    _, rows = run_recipe(tmp_path / "plain", "num_ppo_steps=2", "master_weights=False", *BF16)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert "master_weights" not in load_training_state(_step(tmp_path / "plain", 2))
