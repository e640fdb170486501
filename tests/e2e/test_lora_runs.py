"""LoRA PPO end to end through `tune run` on the tiny task: the first step is the full model's,
only adapters train, adapter checkpoints in PEFT layout, merged weights at the end that
transformers loads, exact resume, compiled equal to eager with no recompiles. The LoRA config's
value model starts from the reward checkpoint, so its reward model is the value model's base
with the adapters off (share_reward_value_base): every run here but `two_bases` shares it."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from torchtune import training
from torchtune.training import FullModelHFCheckpointer

import torchtune_ppo
from torchtune_ppo import checkpointing, lora
from torchtune_ppo.run.logs import read_disk_log
from torchtune_ppo.tasks.tiny_sentiment import tiny_lora_policy, tiny_lora_reward, tiny_reward

from conftest import ROOT, SMALL, TINY_CONFIG, TUNE, assert_compiled_matches_eager

LORA = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment_lora.yaml"
SAVE_EVERY_2 = ["save_every_n_steps=2", "keep_last_n_checkpoints=null"]
# The LoRA config's layers: 4 policy layers x (4 attention + 3 MLP linears), an A and a B
# each; the value model's 2 layers likewise, and its head.
NUM_ADAPTER_PARAMS = 4 * 7 * 2
NUM_VALUE_ADAPTER_PARAMS = 2 * 7 * 2


def _run(out, *overrides, config=LORA):
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(config), f"output_dir={out}", *SMALL, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)  # the last run's console
    return read_disk_log(out / "logs")  # this run's rows only


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    straight, resumed = base / "straight", base / "resumed"
    rows = _run(straight, "num_ppo_steps=4", *SAVE_EVERY_2)
    first = _run(resumed, "num_ppo_steps=2", *SAVE_EVERY_2, "save_adapter_weights_only=True")
    second = _run(resumed, "num_ppo_steps=4", *SAVE_EVERY_2, "save_adapter_weights_only=True",
                  "resume_from_checkpoint=True")
    full = _run(base / "full", "num_ppo_steps=1", config=TINY_CONFIG)
    return straight, rows, resumed, first, second, full


@pytest.fixture(scope="module")
def two_bases(runs):
    """The straight run again with a separate copy of the base for the reward model."""
    out = runs[0].parent / "two_bases"
    return out, _run(out, "num_ppo_steps=4", *SAVE_EVERY_2, "share_reward_value_base=False")


def _step(out, n):
    return out / checkpointing.CHECKPOINTS_DIRNAME / f"step_{n}"


def test_first_step_is_the_full_models(runs):
    """lora_b starts at zero: step 1's trajectory (sampled tokens, logprobs, reference logprobs
    from the policy with adapters off, scores) is the full-finetune run's, bit for bit."""
    _, rows, *_, full = runs
    for key in ("scores", "num_stop_tokens", "response_lengths", "rlhf_reward", "kl", "kl_reward"):
        assert rows[0][key] == full[0][key], key
    assert rows[0]["loss"] != full[0]["loss"]  # the updates differ: adapters only, another lr


def test_only_adapters_and_the_value_head_are_in_the_optimizer(runs):
    straight, *_ = runs
    state = checkpointing.load_training_state(_step(straight, 2))
    params = [p for group in state["optimizer"]["param_groups"] for p in group["params"]]
    assert len(params) == len(state["optimizer"]["state"]) == NUM_ADAPTER_PARAMS + NUM_VALUE_ADAPTER_PARAMS + 1
    assert load_file(_step(straight, 2) / "value" / "head.safetensors").keys() == {"output.weight"}


def test_adapters_in_peft_layout_at_every_save_and_merged_weights_at_the_end(runs):
    straight, *_ = runs
    for n in (2, 4):
        policy = _step(straight, n) / "policy"
        config = json.loads((policy / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
        assert sorted(config["target_modules"]) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        keys = load_file(policy / "adapter_model.safetensors").keys()
        assert len(keys) == NUM_ADAPTER_PARAMS
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
        assert "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight" in keys
    value_keys = load_file(_step(straight, 2) / "value" / "adapter_model.safetensors").keys()
    assert len(value_keys) == NUM_VALUE_ADAPTER_PARAMS
    for model in ("policy", "value"):
        assert not list((_step(straight, 2) / model).glob("model-*"))  # adapters only mid-run
        assert (_step(straight, 4) / model / "model-00001-of-00001.safetensors").is_file()


def _adapted_policy(step_dir, tmp_path):
    """The trained LoRA policy: the shipped base plus the checkpoint's adapters."""
    base = FullModelHFCheckpointer(
        checkpoint_dir=torchtune_ppo.asset_path("tiny_sentiment/policy"), checkpoint_files=["model.safetensors"],
        model_type="LLAMA2", output_dir=str(tmp_path)).load_checkpoint()[training.MODEL_KEY]
    model = tiny_lora_policy(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)
    lora.load_base(model, base, "base")
    lora.train_adapters_only(model)
    lora.load_adapters(model, checkpointing.load_adapters(step_dir, "policy"), str(step_dir))
    return model.eval()


@torch.no_grad()
def test_merged_checkpoint_loads_in_transformers_with_the_adapted_logits(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    straight, *_ = runs
    model = _adapted_policy(_step(straight, 4), tmp_path)
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_b" in n)  # trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(_step(straight, 4) / "policy"),
                                                           dtype=torch.float32).eval()
    tokens = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    adapted = model(tokens)
    # Logits reach ~22 here, and torchtune's and transformers' plain base models already differ
    # by up to 1.1e-5 on these tokens (op order; measured), so the bound is 3e-5. A merge that
    # lost the adapters would be off by the adapters' effect, checked to be far larger:
    with lora.adapters_off(model):
        assert (model(tokens) - adapted).abs().max() > 1e-2
    torch.testing.assert_close(hf(tokens).logits, adapted, atol=3e-5, rtol=0)


@torch.no_grad()
def test_merged_value_model_is_the_adapted_one(runs, tmp_path):
    straight, *_ = runs
    step = _step(straight, 4)
    base = FullModelHFCheckpointer(
        checkpoint_dir=torchtune_ppo.asset_path("tiny_sentiment/reward"), checkpoint_files=["model.safetensors"],
        model_type="REWARD", output_dir=str(tmp_path / "a")).load_checkpoint()[training.MODEL_KEY]
    adapted = tiny_lora_reward(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)
    lora.load_base(adapted, base, "base")
    lora.train_adapters_only(adapted, also=lora.head_names(adapted))
    lora.load_adapters(adapted, checkpointing.load_adapters(step, "value"), str(step))
    merged = FullModelHFCheckpointer(
        checkpoint_dir=str(step / "value"), checkpoint_files=["model-00001-of-00001.safetensors"],
        model_type="REWARD", output_dir=str(tmp_path / "b")).load_checkpoint()[training.MODEL_KEY]
    plain = tiny_reward()
    plain.load_state_dict(merged)
    tokens = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    values = adapted.eval()(tokens)
    assert not torch.equal(merged["output.weight"], base["output.weight"])  # the head trained
    torch.testing.assert_close(plain.eval()(tokens), values, atol=1e-5, rtol=1e-5)


def test_one_shared_base_repeats_the_run_with_two_bases_exactly(runs, two_bases):
    """The reward model on the value model's base (adapters off, the checkpoint's head) against
    its own copy: every logged number of every step, and the saved adapters, bit for bit."""
    straight, rows, *_ = runs
    separate, other = two_bases
    assert len(rows) == len(other) == 4
    for step, (a, b) in enumerate(zip(rows, other), 1):
        for key, value in a.items():
            if not key.startswith("time/") and "per_second" not in key:
                assert b[key] == value, (step, key)
    for n, model in [(2, "policy"), (4, "policy"), (2, "value"), (4, "value")]:
        a, b = (checkpointing.load_adapters(_step(out, n), model) for out in (straight, separate))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (n, model)
    # the reward head is never saved: the value model's adapters and head, as with two bases
    for out in (straight, separate):
        assert sorted(p.name for p in _step(out, 2).iterdir()) == [
            "COMPLETE", "config.yaml", "policy", "training_state.pt", "value"]
    console = (straight.parent / "straight.log").read_text()
    assert "The reward model is the value model's base with its adapters off" in console
    assert "value + reward parameters (one " in console  # the memory plan counts one base
    assert "value + reward parameters (one " not in (separate.parent / "two_bases.log").read_text()


def test_resume_from_the_adapter_checkpoint_repeats_the_uninterrupted_run(runs):
    straight, rows, resumed, first, second, _ = runs
    assert len(first) == len(second) == 2
    for step, row in enumerate(first + second, 1):
        for key, value in rows[step - 1].items():
            if not key.startswith("time/") and "per_second" not in key:
                assert row[key] == value, (step, key)
    for n, model in [(2, "policy"), (4, "policy"), (2, "value"), (4, "value")]:
        a = checkpointing.load_adapters(_step(resumed, n), model)
        b = checkpointing.load_adapters(_step(straight, n), model)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (n, model)
    # save_adapter_weights_only: no merged weights, not even at the end
    assert not list((_step(resumed, 4) / "policy").glob("model-*"))


def test_compiled_matches_eager_with_no_recompiles(runs, tmp_path):
    """Generation and the loss step run the policy with adapters on, the scoring region with
    them off: each region compiles once."""
    _, eager, *_ = runs
    _run(tmp_path / "run", "num_ppo_steps=4", "compile=True")
    compiled = read_disk_log(tmp_path / "run" / "logs")
    assert [row["recompiles"] for row in compiled[1:]] == [0, 0, 0]
    assert_compiled_matches_eager(compiled, eager, steps=4)


def test_critic_free_lora_run_trains_and_saves_the_policy_adapters_only(tmp_path):
    """GRPO with a LoRA policy: no value model anywhere (the LoRA config's value block builds
    the reward model only), the optimizer over the policy's adapters, adapter checkpoints of
    the policy alone mid-run and merged weights at the end; a resume repeats the run exactly."""
    import math
    import shutil

    grpo = ["advantage_estimator=grpo", "num_samples_per_prompt=2", "num_ppo_steps=2", "save_every_n_steps=1",
            "keep_last_n_checkpoints=null"]
    straight = tmp_path / "straight"
    rows = _run(straight, *grpo)
    assert len(rows) == 2
    for row in rows:
        assert row["value_loss"] == 0 and row["loss"] == row["policy_loss"] and math.isfinite(row["loss"])
        assert math.isnan(row["explained_variance"]) and math.isnan(row["lmbda_actor"])
    for n in (1, 2):
        assert sorted(p.name for p in _step(straight, n).iterdir()) == [
            "COMPLETE", "config.yaml", "policy", "training_state.pt"]
        assert len(checkpointing.load_adapters(_step(straight, n), "policy")) == NUM_ADAPTER_PARAMS
    assert not list((_step(straight, 1) / "policy").glob("model-*"))  # adapters only mid-run
    assert (_step(straight, 2) / "policy" / "model-00001-of-00001.safetensors").is_file()  # merged at the end
    state = checkpointing.load_training_state(_step(straight, 2))
    assert len([p for g in state["optimizer"]["param_groups"] for p in g["params"]]) == NUM_ADAPTER_PARAMS
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(_step(resumed, 2))
    shutil.rmtree(resumed / "logs")
    again = _run(resumed, *grpo, "resume_from_checkpoint=True")
    assert len(again) == 1
    for key, value in rows[1].items():
        if not key.startswith("time/") and "per_second" not in key and not (
                isinstance(value, float) and math.isnan(value)):
            assert again[0][key] == value, key
