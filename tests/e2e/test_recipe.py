"""End-to-end runs of the recipe through `tune run`, on the embedded tiny task."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchtune import training
from torchtune.training import FullModelHFCheckpointer

import torchtune_ppo
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy
from torchtune_ppo.run.logs import read_disk_log

from conftest import ROOT, SMALL, TUNE, assert_compiled_matches_eager
from conftest import TINY_CONFIG as CONFIG


def run_recipe(output_dir: Path, *overrides: str, cwd: Path = ROOT, recipe: str = "ppo_full_finetune", env=None):
    cmd = [*TUNE, "run", recipe, "--config", str(CONFIG), f"output_dir={output_dir}", *SMALL, *overrides]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, read_disk_log(output_dir / "logs")


def _load_policy(checkpoint_dir: Path, output_dir: Path, filename="model-00001-of-00001.safetensors"):
    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(checkpoint_dir),
        checkpoint_files=[filename],
        model_type="LLAMA2",
        output_dir=str(output_dir),
    )
    model = tiny_policy()
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model


def test_eager_run_trains_and_saves_hf_checkpoints(tmp_path):
    out = tmp_path / "run"
    proc, rows = run_recipe(out, "num_ppo_steps=3", "save_every_n_steps=2", "compile=False")
    assert len(rows) == 3
    for row in rows:
        for key in ("loss", "policy_loss", "value_loss", "kl", "scores", "ratios", "clipfrac"):
            assert math.isfinite(row[key]), (key, row)
        assert row["recompiles"] == 0
    # progress bar and phase times reach the user
    assert "PPO" in proc.stderr and "gen=" in proc.stderr

    for step in (2, 3):
        ckpt = out / "checkpoints" / f"step_{step}"
        for folder in ("policy", "value"):
            assert (ckpt / folder / "model-00001-of-00001.safetensors").is_file()
            assert (ckpt / folder / "config.json").is_file()
        assert (ckpt / "COMPLETE").is_file() and (ckpt / "training_state.pt").is_file()

    trained = _load_policy(out / "checkpoints" / "step_3" / "policy", tmp_path / "reload")
    original = _load_policy(
        Path(torchtune_ppo.asset_path("tiny_sentiment/policy")), tmp_path / "reload0", "model.safetensors"
    )
    # the checkpoint holds finite weights that moved away from the start
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(trained.state_dict().values(), original.state_dict().values())
    ]
    assert all(math.isfinite(d) for d in diffs)
    assert max(diffs) > 1e-4


GOLDEN = Path(__file__).parents[1] / "golden" / "tiny_sentiment_eager_4_steps.json"


def test_seeded_run_logs_the_recorded_metrics(tmp_path):
    """The seeded eager run logs, at every step, the metrics recorded in tests/golden."""
    golden = json.loads(GOLDEN.read_text())
    _, rows = run_recipe(tmp_path / "run", "num_ppo_steps=4", "compile=False")
    assert len(rows) == len(golden["steps"]) == 4
    for step, (row, expected) in enumerate(zip(rows, golden["steps"]), 1):
        for key, value in expected.items():
            # Summation order (the packed loss step against the padded one the numbers were
            # recorded with; another CPU's kernels) moves a metric by ~1e-7 absolute. kl, a sum
            # over the response of differences of near-equal logprobs, moves most: 1.4e-6 at
            # step 4 on an Intel Xeon against the numbers recorded on an AMD EPYC (1.4e-5
            # relative), every other key at most 2.4e-7. A wrong mask or weight moves these by
            # more than 1e-3.
            tol = 5e-6 if key == "kl" else 1e-6
            assert row[key] == pytest.approx(value, rel=1e-5, abs=tol), (step, key)


def test_loss_options_reach_the_update(tmp_path):
    """Clip-higher, dual-clip and a seq-mean aggregation from the config: the run trains and logs
    the clip-side fractions (the default run logs the recorded metrics above)."""
    _, rows = run_recipe(tmp_path / "run", "num_ppo_steps=1", "compile=False", "loss.epsilon_high=0.28",
                         "loss.dual_clip=1.5", "loss.aggregation=seq-mean-token-sum-norm")
    (row,) = rows
    assert math.isfinite(row["loss"]) and 0 <= row["clipfrac_low"] <= row["clipfrac"] <= 1
    assert {"clipfrac_high", "dualclip_frac"} <= row.keys()


def test_algorithm_options_reach_the_run(tmp_path):
    """Entropy bonus, a straight-through KL loss term instead of the reward's, critic warm-up and
    length-adaptive GAE from the config: the run trains and logs their metrics."""
    _, rows = run_recipe(tmp_path / "run", "num_ppo_steps=2", "compile=False", "loss.entropy_coeff=0.01",
                         "loss.kl_coeff=0.1", "loss.kl_estimator=k3+", "kl_coeff=0", "critic_warmup_steps=1",
                         "lmbda=1.0", "lmbda_length_alpha=0.05")
    first, second = rows
    for row in rows:
        for key in ("loss", "entropy", "kl_loss", "explained_variance", "lmbda_actor"):
            assert math.isfinite(row[key]), (key, row)
        # k3 = expm1(x) - x >= 0, also at the reference (|x| ~ 1e-5), where exp(x) - 1 cancels in float32
        assert row["entropy"] > 0 and row["kl_loss"] >= 0 and 0 <= row["lmbda_actor"] < 1
        assert row["kl_reward"] == 0.0
    # step 1 trained the value model only: step 2's rollout policy is still the reference
    assert abs(second["kl"]) < 1e-5 and abs(first["kl"]) < 1e-5
    assert second["kl_loss"] > 0  # step 2 moved the policy during its epochs


def test_bad_config_fails_before_loading_models(tmp_path):
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(CONFIG), f"output_dir={tmp_path}", "forward_batch_size=5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "batch_size (32) must be divisible by forward_batch_size (5)" in proc.stderr
    assert "Model checkpoint" not in proc.stderr and not (tmp_path / "policy").exists()


def test_user_copy_of_recipe_runs_from_its_own_folder(tmp_path):
    """A copy under another name runs with `tune run my_ppo.py` from the user's folder."""
    user_dir = tmp_path / "myproject"
    user_dir.mkdir()
    (user_dir / "my_ppo.py").write_text((ROOT / "recipes/ppo_full_finetune.py").read_text())
    _, rows = run_recipe(tmp_path / "run", "num_ppo_steps=1", "compile=False", cwd=user_dir, recipe="my_ppo.py")
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])


@pytest.fixture(scope="module")
def compile_base(tmp_path_factory):
    return tmp_path_factory.mktemp("compile")


# Compiled runs share one inductor cache across processes, so only the first pays full compile time.
@pytest.fixture(scope="module")
def eager_and_compiled_runs(compile_base):
    base = compile_base
    _, eager = run_recipe(base / "eager", "num_ppo_steps=4", "compile=False")
    _, compiled = run_recipe(base / "compiled", "num_ppo_steps=4", "compile=True")
    return eager, compiled


def test_all_compiled_matches_eager(eager_and_compiled_runs):
    eager, compiled = eager_and_compiled_runs
    assert_compiled_matches_eager(compiled, eager, steps=4)


def test_no_recompiles_after_first_step(eager_and_compiled_runs):
    _, compiled = eager_and_compiled_runs
    assert len(compiled) == 4
    assert [row["recompiles"] for row in compiled[1:]] == [0, 0, 0]


def test_a_fresh_machine_compiles_nothing_with_the_runs_compile_cache(tmp_path, compile_base, eager_and_compiled_runs):
    """The compiled run left its regions' artifacts in compile_cache.bin; a run with an empty
    inductor cache (a fresh machine) that reads it compiles no inductor graph, and its steps are
    the compiled run's, bit for bit. The file it read is left as it was."""
    _, compiled = eager_and_compiled_runs
    cache = compile_base / "compiled" / "compile_cache.bin"
    assert cache.is_file()
    before = cache.read_bytes()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty_inductor_cache")}
    proc, rows = run_recipe(tmp_path / "fresh", "num_ppo_steps=2", "compile=True", f"compile_cache={cache}", env=env)
    assert re.search(r"Compile cache: [1-9]\d* compiled artifacts read from", proc.stderr), proc.stderr[-3000:]
    found = re.search(r"Compile cache: (\d+) of (\d+) inductor graphs read from a cache, (\d+) compiled", proc.stderr)
    assert found and int(found[1]) == int(found[2]) > 0 and found[3] == "0", proc.stderr[-3000:]
    for step in range(2):
        for key in ("scores", "loss", "policy_loss", "value_loss", "kl"):
            assert rows[step][key] == compiled[step][key], (step, key)
    assert cache.read_bytes() == before and not (tmp_path / "fresh" / "compile_cache.bin").exists()


UNROLLED = ["compile.generate=True", "compile.trajectory=True", "compile.loss_step=True", "compile.rollout=False",
            "compile.layers=False"]


def test_unrolled_regions_match_eager_without_recompiles(tmp_path, eager_and_compiled_runs):
    """compile=True compiles one layer per use (compile.layers, the fixture's compiled run); with
    compile.layers=False every region holds all its layers in its own graph (inductor): 4 steps
    equal the eager run's as closely, and nothing compiles after step 1."""
    eager, _ = eager_and_compiled_runs
    proc, rows = run_recipe(tmp_path / "unrolled", "num_ppo_steps=4", *UNROLLED)
    assert "layers=False" in proc.stderr
    assert [row["recompiles"] for row in rows[1:]] == [0, 0, 0]
    assert_compiled_matches_eager(rows, eager, steps=4)


@pytest.mark.parametrize("switch", ["generate", "trajectory", "loss_step"])
def test_each_compile_switch_alone(tmp_path, switch, eager_and_compiled_runs):
    eager, _ = eager_and_compiled_runs
    others = [f"compile.{s}=False" for s in ("generate", "trajectory", "loss_step") if s != switch]
    _, rows = run_recipe(tmp_path / switch, "num_ppo_steps=2", f"compile.{switch}=True", *others)
    assert len(rows) == 2 and rows[1]["recompiles"] == 0
    for step in range(2):
        # step 1's loss comes from the loss step; step 2's scores come from weights it updated
        for key in ("scores", "response_lengths"):
            assert rows[step][key] == pytest.approx(eager[step][key], rel=1e-3, abs=1e-3), (step, key)
        for key in ("loss", "policy_loss", "value_loss", "approx_policy_kl"):
            assert rows[step][key] == pytest.approx(eager[step][key], rel=2e-2, abs=2e-4), (step, key)
        assert rows[step]["ratios"] - 1 == pytest.approx(eager[step]["ratios"] - 1, rel=2e-2, abs=2e-5)


ARITHMETIC = ROOT / "recipes/configs/tiny/ppo_tiny_arithmetic.yaml"


def test_arithmetic_task_trains_with_a_function_reward(tmp_path):
    """The verifiable-reward task: exact match as the reward, no reward model, value from the policy."""
    from torchtune_ppo.tasks.tiny_arithmetic import tiny_policy as arithmetic_policy

    out = tmp_path / "run"
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(ARITHMETIC), f"output_dir={out}",
           "num_ppo_steps=3", "batch_size=16", "forward_batch_size=8", "ppo_batch_size=8",
           "log_samples_every_n_steps=2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_disk_log(out / "logs")
    assert len(rows) == 3
    # samples of step 2 only: printed and kept, 4 rows, each with its text and score
    samples = [json.loads(line) for line in (out / "logs/samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] * 4
    assert all(s["prompt"].endswith("=") and s["score"] in (0.0, 1.0, -1.0) for s in samples)
    assert f"step 2 | score {samples[0]['score']:+.3f} | {samples[0]['prompt']!r}" in proc.stderr
    assert "Run done: 3 steps logged" in proc.stderr and "checkpoints/step_3" in proc.stderr
    # the plot command turns the run's logs into one PNG
    png = tmp_path / "run.png"
    subprocess.run([sys.executable, "-m", "torchtune_ppo.run.watch", str(out), "--out", str(png)],
                   check=True, capture_output=True, timeout=300)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    for row in rows:
        assert -1.0 <= row["scores"] <= 1.0  # exact match 0 or 1, reward_penalty -1
        assert math.isfinite(row["loss"]) and row["time/reward"] > 0
    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(out / "checkpoints/step_3/policy"),
        checkpoint_files=["model-00001-of-00001.safetensors"], model_type="LLAMA2",
        output_dir=str(tmp_path / "reload"),
    )
    trained = arithmetic_policy()
    trained.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    start = FullModelHFCheckpointer(
        checkpoint_dir=torchtune_ppo.asset_path("tiny_arithmetic/policy"),
        checkpoint_files=["model.safetensors"], model_type="LLAMA2", output_dir=str(tmp_path / "reload0"),
    ).load_checkpoint()[training.MODEL_KEY]
    moved = max((trained.state_dict()[k] - v).abs().max().item() for k, v in start.items())
    assert math.isfinite(moved) and moved > 1e-5
