"""LoRA in the config: what a LoRA policy asks of the other keys, checked before any weights
load, and the memory plan's LoRA rows."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  registers the config resolvers
from torchtune_ppo.config import validate_config
from torchtune_ppo.run import memory
from torchtune_ppo.tasks.tiny_sentiment import tiny_lora_policy, tiny_lora_reward, tiny_policy, tiny_reward

CONFIGS = Path(__file__).parents[2] / "recipes/configs/tiny"
LORA = CONFIGS / "ppo_tiny_sentiment_lora.yaml"
FULL = CONFIGS / "ppo_tiny_sentiment.yaml"


def _cfg(path=LORA, *overrides):
    return OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))


def test_the_lora_config_is_valid_without_a_reference_checkpointer():
    cfg = validate_config(_cfg())
    assert cfg.ref_policy_checkpointer is None and cfg.save_adapter_weights_only is False
    # and so is one naming the policy's own start as the reference (torchtune-style configs)
    validate_config(OmegaConf.merge(_cfg(), {"ref_policy_checkpointer": OmegaConf.load(FULL).ref_policy_checkpointer}))


def test_a_full_policy_needs_its_reference_checkpointer():
    cfg = _cfg(FULL)
    del cfg["ref_policy_checkpointer"]
    with pytest.raises(ValueError, match="missing ref_policy_checkpointer.*Only a LoRA policy_model"):
        validate_config(cfg)


@pytest.mark.parametrize("overrides, pattern", [
    (["ref_policy_checkpointer._component_=torchtune.training.FullModelHFCheckpointer",
      "ref_policy_checkpointer.checkpoint_dir=${ppo_asset:tiny_sentiment/reward}",
      "ref_policy_checkpointer.checkpoint_files=[model.safetensors]", "ref_policy_checkpointer.model_type=LLAMA2"],
     r"ref_policy_checkpointer loads '.*tiny_sentiment/assets/reward', not the policy's start"),
    (["compile.rollout=True"], r"compile.rollout=True with a LoRA policy_model"),
    (["optimizer_in_bwd=True", "clip_grad_norm=null"], r"optimizer_in_bwd=True with a LoRA policy_model"),
    (["rollout_correction.mode=tis"], r"rollout_correction.mode=tis with a LoRA policy_model: the old logprobs"),
    (["rollout_correction.mode=mis"], r"rollout_correction.mode=mis with a LoRA policy_model"),
])
def test_what_a_lora_policy_cannot_have(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_config(_cfg(LORA, *overrides))


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_correction_is_refused_with_the_fused_rollout_region(mode):
    """compile.rollout takes the generator's logprobs as the old ones: nothing to correct."""
    regions = "compile={generate: False, trajectory: False, loss_step: False, rollout: True}"
    with pytest.raises(ValueError, match=rf"rollout_correction.mode={mode} with compile.rollout=True: the fused region"):
        validate_config(_cfg(FULL, regions, f"rollout_correction.mode={mode}"))
    validate_config(_cfg(FULL, regions))  # the region alone is valid


def test_a_lora_value_model_is_valid_and_planned_with_adapter_gradients():
    cfg = _cfg()
    cfg.reward_and_value_model = {"_component_": "torchtune_ppo.tasks.tiny_sentiment.tiny_lora_reward",
                                  "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8}
    plan = memory.memory_plan(validate_config(cfg))
    value = tiny_lora_reward(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    policy = tiny_lora_policy(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)
    trained = sum(p.numel() for n, p in [*policy.named_parameters(), *value.named_parameters()]
                  if "lora_" in n) + value.output.weight.numel()
    rows = list(plan.rows.values())
    assert rows[2] == trained * 4 and rows[3] == 2 * trained * 4
    assert "value adapters + head" in list(plan.rows)[2]


def test_lora_under_torchrun_is_accepted_and_planned_per_device(monkeypatch):
    # 2 processes: the LoRA policy (base and adapters) is sharded like a trained model, and
    # compiled scoring gathers it whole again as the reference, beside the value model.
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = validate_config(_cfg(LORA, "compile.trajectory=True"))
    one, two = memory.memory_plan(cfg), memory.memory_plan(cfg, world_size=2)
    n_policy = sum(p.numel() for p in tiny_lora_policy(["q_proj", "k_proj", "v_proj", "output_proj"],
                                                       apply_lora_to_mlp=True).parameters())
    n_value = sum(p.numel() for p in tiny_lora_reward(["q_proj", "k_proj", "v_proj", "output_proj"],
                                                      apply_lora_to_mlp=True).parameters())
    assert list(one.rows.values())[0] == n_policy * 4 and list(two.rows.values())[0] == n_policy * 4 / 2
    assert "; 1/2)" in list(two.rows)[0]
    gathered = [(k, v) for k, v in two.rows.items() if k.startswith("gathered")]
    assert gathered == [("gathered whole for the rollout (policy, then value + reference)",
                         (n_policy + n_value) * 4)]


def test_memory_plan_counts_one_policy_copy_and_adapter_gradients_only():
    policy_only = _cfg()  # LoRA on the policy, the value model fully trained
    policy_only.reward_and_value_model = {"_component_": "torchtune_ppo.tasks.tiny_sentiment.tiny_reward"}
    full, lora = memory.memory_plan(validate_config(_cfg(FULL))), memory.memory_plan(validate_config(policy_only))
    n_base = sum(p.numel() for p in tiny_policy().parameters())
    model = tiny_lora_policy(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)
    n_adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    n_value = sum(p.numel() for p in tiny_reward().parameters())
    rows = list(lora.rows.values())
    assert rows[0] == (n_base + n_adapters) * 4  # fp32, one copy: policy and reference
    assert rows[1] == list(full.rows.values())[1]  # value and reward as before
    assert rows[2] == (n_adapters + n_value) * 4 and rows[3] == 2 * (n_adapters + n_value) * 4
    assert "reference: the base" in list(lora.rows)[0]
    assert lora.total < full.total


def test_the_reward_model_shares_the_lora_value_models_base_when_their_checkpoints_match():
    from torchtune_ppo.config import shares_reward_value_base

    assert shares_reward_value_base(validate_config(_cfg()), value_is_lora=True)  # the LoRA config's case
    assert not shares_reward_value_base(validate_config(_cfg()), value_is_lora=False)  # a plain value model
    for overrides in (["share_reward_value_base=False"],
                      # other files: the policy's
                      ["value_checkpointer.checkpoint_dir=${ppo_asset:tiny_sentiment/policy}",
                       "value_checkpointer.model_type=LLAMA2"],
                      # the same files read otherwise
                      ["value_checkpointer.model_type=LLAMA2"],
                      # no value model
                      ["advantage_estimator=grpo", "num_samples_per_prompt=2"]):
        assert not shares_reward_value_base(validate_config(_cfg(LORA, *overrides)), value_is_lora=True), overrides
    # the same files written another way still match; where each model saves does not matter
    same = _cfg(LORA, "value_checkpointer.output_dir=/tmp/elsewhere")
    same.value_checkpointer.checkpoint_dir = same.value_checkpointer.checkpoint_dir + "/"
    assert shares_reward_value_base(validate_config(same), value_is_lora=True)


def test_the_memory_plan_counts_one_base_for_the_shared_reward_and_value_models():
    value = tiny_lora_reward(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)
    n_value, n_head = sum(p.numel() for p in value.parameters()), value.output.weight.numel()
    shared = memory.memory_plan(validate_config(_cfg()))
    separate = memory.memory_plan(validate_config(_cfg(LORA, "share_reward_value_base=False")))
    assert list(shared.rows.values())[1] == (n_value + n_head) * 4
    assert list(separate.rows.values())[1] == 2 * n_value * 4
    assert separate.total - shared.total == (n_value - n_head) * 4
    assert "one" in list(shared.rows)[1] and "each" in list(separate.rows)[1]
