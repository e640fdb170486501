"""Mistral's LoRA classifier builders: torchtune's decoder with adapters, loading the plain
classifier's state dict, and equal to it with the adapters off (or their ``lora_b`` at zero)."""

import pytest
import torch
from torchtune.models.mistral import mistral_classifier, mistral_reward_7b
from torchtune.modules.peft import get_adapter_params

from hf_families import DIMS, MAX_SEQ_LEN
from torchtune_ppo import lora
from torchtune_ppo.models import lora_mistral_7b_classifier, lora_mistral_classifier

TT_DIMS = dict(DIMS, max_seq_len=MAX_SEQ_LEN, norm_eps=1e-5, rope_base=1_000_000)
WHERE = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)


def _models():
    torch.manual_seed(0)
    plain = mistral_classifier(1, **TT_DIMS).eval()
    adapted = lora_mistral_classifier(**WHERE, num_classes=1, lora_rank=4, lora_alpha=8.0, **TT_DIMS)
    lora.load_base(adapted, plain.state_dict(), "value_checkpointer")  # strict but for the adapters
    return plain, adapted.eval()


def _tokens():
    return torch.randint(0, DIMS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_loads_the_plain_classifier_and_equals_it_with_adapters_off():
    plain, adapted = _models()
    assert torch.equal(adapted(_tokens()), plain(_tokens()))  # lora_b starts at zero
    for name, p in adapted.named_parameters():
        if "lora_b" in name:
            p.normal_(std=0.1)
    on = adapted(_tokens())
    assert (on - plain(_tokens())).abs().max() > 1e-2  # the adapters change the scores
    with lora.adapters_off(adapted):
        assert torch.equal(adapted(_tokens()), plain(_tokens()))
    # 2 layers x (4 attention + 3 MLP linears); the head is a plain linear, trained whole
    assert len(get_adapter_params(adapted)) == 2 * 7 * 2
    assert type(adapted.output) is torch.nn.Linear and lora.head_names(adapted) == ["output.weight"]
    assert lora.lora_settings(adapted) == lora.LoraSettings(4, 8.0, ["k_proj", "output_proj", "q_proj", "v_proj",
                                                                     "w1", "w2", "w3"])


def test_7b_builder_is_torchtunes_reward_7b_with_adapters():
    with torch.device("meta"):
        plain = mistral_reward_7b()
        adapted = lora_mistral_7b_classifier(["q_proj", "v_proj"], lora_rank=16, lora_alpha=32)
        wide = lora_mistral_7b_classifier(["q_proj"], vocab_size=32_001)
    base = {n: p.shape for n, p in adapted.named_parameters() if n not in get_adapter_params(adapted)}
    assert base == {n: p.shape for n, p in plain.named_parameters()}
    assert len(get_adapter_params(adapted)) == 32 * 2 * 2
    assert adapted.output.weight.shape == (1, 4096) and adapted.max_seq_len == 32768
    assert wide.tok_embeddings.num_embeddings == 32_001
    assert lora.lora_settings(adapted) == lora.LoraSettings(16, 32.0, ["q_proj", "v_proj"])


def test_lora_on_the_head_is_refused_by_name():
    with pytest.raises(ValueError, match=r"apply_lora_to_output=True: .*set apply_lora_to_output=False"):
        with torch.device("meta"):
            lora_mistral_7b_classifier(["q_proj"], apply_lora_to_output=True)
