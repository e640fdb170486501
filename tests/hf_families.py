"""Tiny random Hugging Face models of each family and the matching torchtune builds.

Shared by tests/parity/test_models_hf.py. Each :class:`Family` pairs a transformers config (small
dims, grouped-query attention, the family's RoPE, Qwen's qkv biases, tied or untied
embeddings) with our / torchtune's builders at the same dims, and the checkpointer
``model_type`` that converts between them.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch
from safetensors.torch import save_file
from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask
from torchtune.models.llama3_1._component_builders import llama3_1
from torchtune.models.llama3_2._component_builders import llama3_2
from torchtune.models.mistral._component_builders import mistral, mistral_classifier
from torchtune.models.qwen2._component_builders import qwen2

from torchtune_ppo.models import llama3_1_classifier, llama3_2_classifier, qwen2_classifier

PAD_ID, EOS_ID = 0, 2
VOCAB = 128
MAX_SEQ_LEN = 64
# head_dim 16: with Llama-3's rope_theta 500000 its frequencies span all three bands of the
# Llama-3 RoPE scaling (kept, smoothed, divided by the factor).
DIMS = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=96)
HF_DIMS = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    intermediate_size=96,
    max_position_embeddings=131072,
    pad_token_id=PAD_ID,
    bos_token_id=1,
    eos_token_id=EOS_ID,
    # 10x transformers' default: at 0.02 every layer is close to the identity, greedy decoding
    # just repeats the last token, and comparisons see little but the embeddings.
    initializer_range=0.2,
)


def _llama3_rope(factor: float) -> Dict[str, Any]:
    return dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


@dataclass(frozen=True)
class Family:
    """One model family at tiny dims: the HF config and the torchtune builds that match it."""

    name: str
    config_cls: str  # transformers class names
    causal_cls: str
    classifier_cls: str
    model_type: str  # checkpointer model_type of the policy and of ClassifierHFCheckpointer
    hf_config: Dict[str, Any]
    policy: Callable[[], torch.nn.Module]
    classifier: Callable[[], torch.nn.Module]
    tied: bool = False

    def config(self, num_labels: int = 0, **overrides: Any):
        import transformers

        kwargs = {**HF_DIMS, **self.hf_config, "tie_word_embeddings": self.tied, **overrides}
        if num_labels:
            kwargs["num_labels"] = num_labels
        return getattr(transformers, self.config_cls)(**kwargs)

    def hf_causal(self, seed: int, **overrides: Any):
        import transformers

        torch.manual_seed(seed)
        model = getattr(transformers, self.causal_cls)(self.config(**overrides))
        _randomise_norms(model)
        return model.eval()

    def hf_classifier(self, seed: int, **overrides: Any):
        import transformers

        torch.manual_seed(seed)
        model = getattr(transformers, self.classifier_cls)(self.config(num_labels=1, **overrides))
        _randomise_norms(model)
        # transformers initialises the score head at std 0.02; larger makes score errors visible.
        with torch.no_grad():
            model.score.weight.normal_(std=0.5)
        return model.eval()


def _randomise_norms(model: torch.nn.Module) -> None:
    # RMSNorm weights start at 1; random ones catch a norm loaded into the wrong place.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(std=0.1)  # Qwen's qkv biases start at 0


TT = dict(**DIMS, max_seq_len=MAX_SEQ_LEN)

FAMILIES: List[Family] = [
    Family(
        name="llama3_2_tied",
        config_cls="LlamaConfig",
        causal_cls="LlamaForCausalLM",
        classifier_cls="LlamaForSequenceClassification",
        model_type="LLAMA3_2",
        hf_config=dict(rms_norm_eps=1e-5, rope_parameters=_llama3_rope(32.0)),
        tied=True,
        policy=lambda: llama3_2(**TT, norm_eps=1e-5, rope_base=500_000, scale_factor=32, tie_word_embeddings=True),
        classifier=lambda: llama3_2_classifier(1, **TT, norm_eps=1e-5, rope_base=500_000, scale_factor=32),
    ),
    Family(
        name="llama3_1",
        config_cls="LlamaConfig",
        causal_cls="LlamaForCausalLM",
        classifier_cls="LlamaForSequenceClassification",
        model_type="LLAMA3",
        hf_config=dict(rms_norm_eps=1e-5, rope_parameters=_llama3_rope(8.0)),
        policy=lambda: llama3_1(**TT, norm_eps=1e-5, rope_base=500_000, scale_factor=8),
        classifier=lambda: llama3_1_classifier(1, **TT, norm_eps=1e-5, rope_base=500_000),
    ),
    Family(
        name="qwen2_5_tied",
        config_cls="Qwen2Config",
        causal_cls="Qwen2ForCausalLM",
        classifier_cls="Qwen2ForSequenceClassification",
        model_type="QWEN2",
        hf_config=dict(rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0)),
        tied=True,
        policy=lambda: qwen2(**TT, norm_eps=1e-6, rope_base=1_000_000.0, tie_word_embeddings=True),
        classifier=lambda: qwen2_classifier(1, **TT, norm_eps=1e-6, rope_base=1_000_000.0),
    ),
    Family(
        name="qwen2_5_untied",
        config_cls="Qwen2Config",
        causal_cls="Qwen2ForCausalLM",
        classifier_cls="Qwen2ForSequenceClassification",
        model_type="QWEN2",
        hf_config=dict(rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0)),
        policy=lambda: qwen2(**TT, norm_eps=1e-6, rope_base=1_000_000.0, tie_word_embeddings=False),
        classifier=lambda: qwen2_classifier(1, **TT, norm_eps=1e-6, rope_base=1_000_000.0),
    ),
    Family(
        name="mistral",
        config_cls="MistralConfig",
        causal_cls="MistralForCausalLM",
        classifier_cls="MistralForSequenceClassification",
        model_type="MISTRAL",
        # No sliding window: torchtune's Mistral has none (sequences here are far shorter).
        hf_config=dict(
            rms_norm_eps=1e-5, sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
        policy=lambda: mistral(**TT, norm_eps=1e-5, rope_base=1_000_000),
        classifier=lambda: mistral_classifier(1, **TT, norm_eps=1e-5, rope_base=1_000_000),
    ),
]


def left_padded(lengths: Sequence[int], width: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """``[len(lengths), width]`` prompts of the given real lengths; no pad or eos inside."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), width), PAD_ID, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
    return out


def padding_inputs(lengths: Sequence[int], width: int):
    """The same left padding for both libraries.

    Returns:
        ``not_pad [b, s]`` bool; torchtune's ``mask [b, s, s]`` and ``input_pos [b, s]``;
        transformers' ``attention_mask [b, s]`` and ``position_ids [b, s]`` (the same
        positions: each row counts from its first real token).
    """
    not_pad = torch.arange(width)[None, :] >= (width - torch.tensor(lengths))[:, None]
    mask = get_causal_mask_from_padding_mask(not_pad)
    pos = get_position_ids_from_padding_mask(not_pad)
    return not_pad, mask, pos, not_pad.long(), pos.long()


def save_sharded(model: torch.nn.Module, folder: Path, filenames: Sequence[str]) -> None:
    """``save_pretrained`` (config.json and all), then the weights split into ``filenames``.

    Real checkpoints come in shards named in the configs (``pytorch_model-00001-of-00003.bin``,
    ``model-00001-of-00003.safetensors``); the stand-ins use the same names.
    """
    model.save_pretrained(folder)
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    keys = sorted(state)
    n = len(filenames)
    for i, name in enumerate(filenames):
        part = {k: state[k] for k in keys[i::n]}
        if name.endswith(".safetensors"):
            save_file(part, folder / name, metadata={"format": "pt"})
        else:
            torch.save(part, folder / name)
