"""A LoRA run's 1-process optimizer state (numbered over the trained parameters only) loads by
parameter name, as a resume on several processes loads it."""

import torch

from torchtune_ppo import distributed, lora
from torchtune_ppo.tasks.tiny_sentiment import tiny_lora_policy, tiny_lora_reward


def _models():
    torch.manual_seed(0)
    policy = tiny_lora_policy(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    value = tiny_lora_reward(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    lora.train_adapters_only(policy)
    lora.train_adapters_only(value, also=lora.head_names(value))
    return {"policy": policy, "value": value}


def _optimizer(models):
    return torch.optim.AdamW([p for m in models.values() for p in m.parameters() if p.requires_grad], lr=1e-3)


def test_one_process_lora_optimizer_state_loads_by_name():
    models = _models()
    optimizer = _optimizer(models)
    g = torch.Generator().manual_seed(0)
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    saved = optimizer.state_dict()  # keyed 0..n-1 over the adapters and the head, not the base
    assert len(saved["state"]) == sum(len(lora.get_adapter_params(m)) for m in models.values()) + 1

    fresh = _models()
    loaded = _optimizer(fresh)
    distributed.load_full_optimizer_state_dict(fresh, loaded, saved)
    state = loaded.state_dict()["state"]
    assert state.keys() == saved["state"].keys()
    for i, s in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[i][key], s[key], rtol=0, atol=0, msg=f"{i} {key}")
