"""Reward / value model builders at the published sizes of Llama-3.x, Qwen2.5 and Mistral-7B.

Each matches its torchtune policy builder (``torchtune.models.llama3_2.llama3_2_1b``,
``torchtune.models.qwen2_5.qwen2_5_0_5b``, ...) layer for layer, with a one-output head in
place of the LM head: the layout of a Hugging Face ``*ForSequenceClassification`` checkpoint
with ``num_labels=1``. Load one with :class:`torchtune_ppo.models.ClassifierHFCheckpointer`.

``max_seq_len`` only sizes the RoPE cache: the defaults are the published context lengths of
the instruct models; lower it to save memory when sequences are short.
"""

from typing import List

from torchtune.modules import TransformerDecoder

from torchtune_ppo.models._component_builders import (
    llama3_1_classifier,
    llama3_2_classifier,
    lora_llama3_2_classifier,
    lora_mistral_classifier,
    lora_qwen2_classifier,
    qwen2_classifier,
)

__all__ = [
    "llama3_1_8b_classifier",
    "llama3_2_1b_classifier",
    "llama3_2_3b_classifier",
    "lora_llama3_2_1b_classifier",
    "lora_mistral_7b_classifier",
    "lora_qwen2_5_0_5b_classifier",
    "qwen2_5_0_5b_classifier",
    "qwen2_5_1_5b_classifier",
    "qwen2_5_3b_classifier",
    "qwen2_5_7b_classifier",
]


def llama3_2_1b_classifier(num_classes: int = 1, max_seq_len: int = 131072) -> TransformerDecoder:
    """Llama-3.2-1B with a ``num_classes``-wide head (e.g. a ``LlamaForSequenceClassification``).

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 131072

    Returns:
        TransformerDecoder: the classifier.
    """
    return llama3_2_classifier(
        num_classes,
        vocab_size=128_256,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=2048,
        max_seq_len=max_seq_len,
        intermediate_dim=8192,
        norm_eps=1e-5,
        rope_base=500_000,
        scale_factor=32,
    )


def llama3_2_3b_classifier(num_classes: int = 1, max_seq_len: int = 131072) -> TransformerDecoder:
    """Llama-3.2-3B with a ``num_classes``-wide head.

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 131072

    Returns:
        TransformerDecoder: the classifier.
    """
    return llama3_2_classifier(
        num_classes,
        vocab_size=128_256,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        embed_dim=3072,
        max_seq_len=max_seq_len,
        intermediate_dim=8192,
        norm_eps=1e-5,
        rope_base=500_000,
        scale_factor=32,
    )


def llama3_1_8b_classifier(num_classes: int = 1, max_seq_len: int = 131072) -> TransformerDecoder:
    """Llama-3.1-8B with a ``num_classes``-wide head.

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 131072

    Returns:
        TransformerDecoder: the classifier.
    """
    return llama3_1_classifier(
        num_classes,
        vocab_size=128_256,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=4096,
        max_seq_len=max_seq_len,
        intermediate_dim=14336,
        norm_eps=1e-5,
        rope_base=500_000,
        scale_factor=8,
    )


def qwen2_5_0_5b_classifier(num_classes: int = 1, max_seq_len: int = 32768) -> TransformerDecoder:
    """Qwen2.5-0.5B with a ``num_classes``-wide head (e.g. a ``Qwen2ForSequenceClassification``).

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 32768

    Returns:
        TransformerDecoder: the classifier.
    """
    return qwen2_classifier(
        num_classes,
        vocab_size=151936,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        embed_dim=896,
        intermediate_dim=4864,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_base=1_000_000.0,
    )


def qwen2_5_1_5b_classifier(num_classes: int = 1, max_seq_len: int = 32768) -> TransformerDecoder:
    """Qwen2.5-1.5B with a ``num_classes``-wide head.

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 32768

    Returns:
        TransformerDecoder: the classifier.
    """
    return qwen2_classifier(
        num_classes,
        vocab_size=151936,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        embed_dim=1536,
        intermediate_dim=8960,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_base=1_000_000.0,
    )


def qwen2_5_3b_classifier(num_classes: int = 1, max_seq_len: int = 32768) -> TransformerDecoder:
    """Qwen2.5-3B with a ``num_classes``-wide head.

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 32768

    Returns:
        TransformerDecoder: the classifier.
    """
    return qwen2_classifier(
        num_classes,
        vocab_size=151936,
        num_layers=36,
        num_heads=16,
        num_kv_heads=2,
        embed_dim=2048,
        intermediate_dim=11008,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_base=1_000_000.0,
    )


def qwen2_5_7b_classifier(num_classes: int = 1, max_seq_len: int = 32768) -> TransformerDecoder:
    """Qwen2.5-7B with a ``num_classes``-wide head.

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 32768

    Returns:
        TransformerDecoder: the classifier.
    """
    return qwen2_classifier(
        num_classes,
        vocab_size=152064,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        embed_dim=3584,
        intermediate_dim=18944,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_base=1_000_000.0,
    )


def lora_llama3_2_1b_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    num_classes: int = 1,
    max_seq_len: int = 131072,
) -> TransformerDecoder:
    """:func:`llama3_2_1b_classifier` with LoRA adapters, keys as torchtune's ``lora_llama3_2_1b``.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): the update is ``alpha / rank * B A x``. Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 131072

    Returns:
        TransformerDecoder: the classifier.
    """
    return lora_llama3_2_classifier(
        lora_attn_modules, apply_lora_to_mlp, num_classes=num_classes, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, vocab_size=128_256, num_layers=16,
        num_heads=32, num_kv_heads=8, embed_dim=2048, max_seq_len=max_seq_len, intermediate_dim=8192,
        norm_eps=1e-5, rope_base=500_000, scale_factor=32,
    )


def lora_qwen2_5_0_5b_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    num_classes: int = 1,
    max_seq_len: int = 32768,
) -> TransformerDecoder:
    """:func:`qwen2_5_0_5b_classifier` with LoRA adapters, keys as torchtune's ``lora_qwen2_5_0_5b``.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): the update is ``alpha / rank * B A x``. Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 32768

    Returns:
        TransformerDecoder: the classifier.
    """
    return lora_qwen2_classifier(
        lora_attn_modules, apply_lora_to_mlp, num_classes=num_classes, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, vocab_size=151936, num_layers=24,
        num_heads=14, num_kv_heads=2, embed_dim=896, intermediate_dim=4864, max_seq_len=max_seq_len,
        norm_eps=1e-6, rope_base=1_000_000.0,
    )


def lora_mistral_7b_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    num_classes: int = 1,
    vocab_size: int = 32_000,
    max_seq_len: int = 32768,
) -> TransformerDecoder:
    """Mistral-7B with a ``num_classes``-wide head and LoRA adapters: torchtune's
    ``lora_mistral_reward_7b`` with the head, vocabulary and length as keys.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        apply_lora_to_output (bool): must be False: the head trains whole. Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): the update is ``alpha / rank * B A x``. Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        vocab_size (int): rows of the token embeddings. Default: 32_000; reward models that
            added a pad token have 32_001 (e.g. ``weqweasdas/RM-Mistral-7B``)
        max_seq_len (int): maximum sequence length. Default: 32768

    Returns:
        TransformerDecoder: the classifier.
    """
    return lora_mistral_classifier(
        lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, num_classes=num_classes, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, vocab_size=vocab_size, num_layers=32, num_heads=32,
        num_kv_heads=8, embed_dim=4096, intermediate_dim=14336, max_seq_len=max_seq_len, norm_eps=1e-5,
        rope_base=10_000,
    )
