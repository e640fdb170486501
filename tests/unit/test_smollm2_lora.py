"""SmolLM2's LoRA builders, at small dims (no weights needed): the base is smollm2's, named alike."""

import pytest
import torch
from torchtune.modules.peft import LoRALinear, get_adapter_params

from torchtune_ppo import lora
from torchtune_ppo.models import lora_smollm2, lora_smollm2_classifier, smollm2, smollm2_classifier

DIMS = dict(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=48,
            max_seq_len=32)
ADAPTER = dict(lora_rank=4, lora_alpha=8)


def _loaded(base: torch.nn.Module, adapted: torch.nn.Module) -> torch.nn.Module:
    missing, unexpected = adapted.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and all(".lora_" in k for k in missing), (missing, unexpected)
    return adapted


def test_base_weights_load_by_name_and_zero_adapters_give_the_base_logits():
    torch.manual_seed(0)
    base = smollm2(**DIMS)
    adapted = _loaded(base, lora_smollm2(["q_proj", "k_proj", "v_proj", "output_proj"], True, **ADAPTER, **DIMS))
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(base(tokens), adapted(tokens))  # lora_b starts at zero
        for name, p in adapted.named_parameters():
            if "lora_b" in name:
                p.normal_()
        moved = adapted(tokens)
        with lora.adapters_off(adapted):
            off = adapted(tokens)
    assert not torch.allclose(moved, off)
    assert torch.equal(off, base(tokens))  # adapters off: F.linear(x, W), the base bit for bit


def test_adapters_sit_where_asked_and_the_head_stays_tied():
    model = lora_smollm2(["q_proj", "v_proj"], False, **ADAPTER, **DIMS)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert isinstance(attn.q_proj, LoRALinear) and isinstance(attn.v_proj, LoRALinear)
    assert not isinstance(attn.k_proj, LoRALinear) and not isinstance(attn.output_proj, LoRALinear)
    assert not any(isinstance(m, LoRALinear) for m in mlp.modules())
    # 2 layers x (q: 32->32, v: 32->16), each A [4, in] + B [out, 4]
    assert sum(p.numel() for p in get_adapter_params(model).values()) == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert "output.weight" not in model.state_dict()  # tied to tok_embeddings
    assert lora.lora_settings(model).target_modules == ["q_proj", "v_proj"]


def test_classifier_has_the_plain_classifier_keys_plus_adapters():
    plain = smollm2_classifier(1, **DIMS)
    adapted = _loaded(plain, lora_smollm2_classifier(["q_proj", "v_proj"], True, num_classes=1, **ADAPTER, **DIMS))
    assert adapted.output.weight.shape == (1, 32)
    tokens = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(plain(tokens), adapted(tokens))


@pytest.mark.parametrize("kwargs, match", [
    (dict(apply_lora_to_output=True), "apply_lora_to_output=True"),
    (dict(lora_attn_modules=["q_proj", "gate_proj"]), r"\['gate_proj'\]"),
])
def test_bad_lora_settings_are_refused_by_name(kwargs, match):
    args = dict(lora_attn_modules=["q_proj"], **ADAPTER, **DIMS)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        lora_smollm2(**args)
