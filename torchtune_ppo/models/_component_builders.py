"""Classifier (reward / value model) component builders for Llama-3.x and Qwen2 / Qwen2.5.

torchtune 0.6.1 ships classifiers only for Llama-2 and Mistral. These build the decoder with
torchtune's own component builders and swap the output projection for a ``num_classes``-wide
head, so every layer (attention, RoPE variant, qkv biases, norms) is exactly torchtune's.

The decoder is built with tied embeddings (``TiedLinear``: no vocab-sized output matrix is
allocated) and the tie is then replaced by an untied ``nn.Linear(embed_dim, num_classes,
bias=False)``, the layout of Hugging Face's ``*ForSequenceClassification.score``. A classifier
never shares its head with the token embeddings, whatever the policy it came from does.
"""

from typing import Optional

from torch import nn
from torchtune.models.llama3_2 import llama3_2
from torchtune.models.qwen2 import qwen2
from torchtune.modules import TransformerDecoder

__all__ = ["llama3_1_classifier", "llama3_2_classifier", "qwen2_classifier"]


def with_classifier_head(model: TransformerDecoder, embed_dim: int, num_classes: int) -> TransformerDecoder:
    # Registered as a submodule in place of the (unregistered) TiedLinear, so the state dict
    # gains `output.weight` [num_classes, embed_dim] and nothing else changes.
    model.output = nn.Linear(embed_dim, num_classes, bias=False)
    return model


def llama3_2_classifier(
    num_classes: int,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    rope_base: int = 500_000,
    intermediate_dim: Optional[int] = None,
    norm_eps: float = 1e-5,
    scale_factor: int = 32,
) -> TransformerDecoder:
    """Build a Llama-3.2 decoder with a classification head instead of the LM head.

    The backbone is :func:`torchtune.models.llama3_2._component_builders.llama3_2` (Llama-3
    scaled RoPE); the head is an untied ``nn.Linear(embed_dim, num_classes, bias=False)``.

    Args:
        num_classes (int): width of the head; 1 for a reward or value model.
        vocab_size (int): number of tokens in vocabulary.
        num_layers (int): number of layers in the transformer decoder.
        num_heads (int): number of query heads.
        num_kv_heads (int): number of key and value heads (grouped-query attention).
        embed_dim (int): embedding dimension.
        max_seq_len (int): maximum sequence length the model will be run with.
        attn_dropout (float): dropout passed to scaled_dot_product_attention. Default: 0.0
        rope_base (int): base of the rotary embeddings. Default: 500_000
        intermediate_dim (Optional[int]): MLP hidden size; torchtune's llama3 default if None.
        norm_eps (float): epsilon of the RMS norms. Default: 1e-5
        scale_factor (int): RoPE scaling factor (``rope_scaling.factor`` in the HF config).
            Default: 32, as in Llama-3.2

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` float32 scores.
    """
    model = llama3_2(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        rope_base=rope_base,
        intermediate_dim=intermediate_dim,
        norm_eps=norm_eps,
        scale_factor=scale_factor,
        tie_word_embeddings=True,
    )
    return with_classifier_head(model, embed_dim, num_classes)


def llama3_1_classifier(
    num_classes: int,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    rope_base: int = 500_000,
    intermediate_dim: Optional[int] = None,
    norm_eps: float = 1e-5,
    scale_factor: int = 8,
) -> TransformerDecoder:
    """Build a Llama-3.1 decoder with a classification head instead of the LM head.

    Llama-3.1 and Llama-3.2 share one architecture and differ only in the RoPE scaling
    factor (8 vs 32), so this is :func:`llama3_2_classifier` with ``scale_factor=8``. Going
    through the Llama-3.2 builder (which can tie) avoids allocating the ``[vocab, embed_dim]``
    LM head that :func:`torchtune.models.llama3_1._component_builders.llama3_1` always builds.

    Args:
        num_classes (int): width of the head; 1 for a reward or value model.
        vocab_size (int): number of tokens in vocabulary.
        num_layers (int): number of layers in the transformer decoder.
        num_heads (int): number of query heads.
        num_kv_heads (int): number of key and value heads (grouped-query attention).
        embed_dim (int): embedding dimension.
        max_seq_len (int): maximum sequence length the model will be run with.
        attn_dropout (float): dropout passed to scaled_dot_product_attention. Default: 0.0
        rope_base (int): base of the rotary embeddings. Default: 500_000
        intermediate_dim (Optional[int]): MLP hidden size; torchtune's llama3 default if None.
        norm_eps (float): epsilon of the RMS norms. Default: 1e-5
        scale_factor (int): RoPE scaling factor. Default: 8, as in Llama-3.1

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` float32 scores.
    """
    return llama3_2_classifier(
        num_classes,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        rope_base=rope_base,
        intermediate_dim=intermediate_dim,
        norm_eps=norm_eps,
        scale_factor=scale_factor,
    )


def qwen2_classifier(
    num_classes: int,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
) -> TransformerDecoder:
    """Build a Qwen2 / Qwen2.5 decoder with a classification head instead of the LM head.

    The backbone is :func:`torchtune.models.qwen2._component_builders.qwen2` (qkv biases,
    Qwen2 RoPE), which torchtune's Qwen2.5 builders use too.

    Args:
        num_classes (int): width of the head; 1 for a reward or value model.
        vocab_size (int): number of tokens in vocabulary.
        num_layers (int): number of layers in the transformer decoder.
        num_heads (int): number of query heads.
        num_kv_heads (int): number of key and value heads (grouped-query attention).
        embed_dim (int): embedding dimension.
        intermediate_dim (int): MLP hidden size.
        max_seq_len (int): maximum sequence length the model will be run with.
        attn_dropout (float): dropout passed to scaled_dot_product_attention. Default: 0.0
        norm_eps (float): epsilon of the RMS norms. Default: 1e-6, as in Qwen2.5
        rope_base (float): base of the rotary embeddings. Default: 1_000_000.0

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` float32 scores.
    """
    model = qwen2(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        tie_word_embeddings=True,
    )
    return with_classifier_head(model, embed_dim, num_classes)
