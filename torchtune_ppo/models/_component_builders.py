"""Classifier (reward / value model) component builders for Llama-3.x and Qwen2 / Qwen2.5, and
Mistral's LoRA one.

torchtune 0.6.1 ships classifiers only for Llama-2 and Mistral. These build the decoder with
torchtune's own component builders and swap the output projection for a ``num_classes``-wide
head, so every layer (attention, RoPE variant, qkv biases, norms) is exactly torchtune's.

The decoder is built with tied embeddings (``TiedLinear``: no vocab-sized output matrix is
allocated) and the tie is then replaced by an untied ``nn.Linear(embed_dim, num_classes,
bias=False)``, the layout of Hugging Face's ``*ForSequenceClassification.score``. A classifier
never shares its head with the token embeddings, whatever the policy it came from does.

Mistral's classifiers are torchtune's (``torchtune.models.mistral.mistral_classifier``,
``lora_mistral_classifier``); :func:`lora_mistral_classifier` here only gives torchtune's LoRA one
the keys and the head of the LoRA builders above.
"""

from typing import List, Optional

from torch import nn
from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
from torchtune.models.mistral import lora_mistral_classifier as _torchtune_lora_mistral_classifier
from torchtune.models.qwen2 import lora_qwen2, qwen2
from torchtune.modules import TransformerDecoder

__all__ = ["llama3_1_classifier", "llama3_2_classifier", "lora_llama3_2_classifier", "lora_mistral_classifier",
           "lora_qwen2_classifier", "qwen2_classifier"]


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


def lora_llama3_2_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    *,
    num_classes: int,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    **dims,
) -> TransformerDecoder:
    """:func:`llama3_2_classifier` with LoRA adapters (torchtune's ``lora_llama3_2``).

    The head is a plain ``nn.Linear`` trained whole with the adapters (a value model) or frozen
    (a reward model): a ``[num_classes, D]`` head has nothing to gain from a low-rank update.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters, of ``q_proj``,
            ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        num_classes (int): width of the head; 1 for a reward or value model.
        lora_rank (int): rank of each adapter.
        lora_alpha (float): the update is ``alpha / rank * B A x``.
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        **dims: the decoder's dims, as :func:`llama3_2_classifier` takes them.

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` scores.
    """
    model = lora_llama3_2(lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
                          apply_lora_to_output=False, lora_rank=lora_rank, lora_alpha=lora_alpha,
                          lora_dropout=lora_dropout, tie_word_embeddings=True, **dims)
    return with_classifier_head(model, dims["embed_dim"], num_classes)


def lora_qwen2_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    *,
    num_classes: int,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    **dims,
) -> TransformerDecoder:
    """:func:`qwen2_classifier` with LoRA adapters (torchtune's ``lora_qwen2``); the head as in
    :func:`lora_llama3_2_classifier`.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        num_classes (int): width of the head; 1 for a reward or value model.
        lora_rank (int): rank of each adapter.
        lora_alpha (float): the update is ``alpha / rank * B A x``.
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        **dims: the decoder's dims, as :func:`qwen2_classifier` takes them.

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` scores.
    """
    model = lora_qwen2(lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
                       apply_lora_to_output=False, lora_rank=lora_rank, lora_alpha=lora_alpha,
                       lora_dropout=lora_dropout, tie_word_embeddings=True, **dims)
    return with_classifier_head(model, dims["embed_dim"], num_classes)


def lora_mistral_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    num_classes: int,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    **dims,
) -> TransformerDecoder:
    """torchtune's ``torchtune.models.mistral.lora_mistral_classifier`` (the decoder of
    ``mistral_classifier`` with LoRA adapters), with its head a plain ``nn.Linear`` as in
    :func:`lora_llama3_2_classifier`: trained whole (a value model) or frozen (a reward model).

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters, of ``q_proj``,
            ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        apply_lora_to_output (bool): must be False (the key of torchtune's
            ``lora_mistral_reward_7b``): the head is trained whole, not through an adapter.
        num_classes (int): width of the head; 1 for a reward or value model.
        lora_rank (int): rank of each adapter.
        lora_alpha (float): the update is ``alpha / rank * B A x``.
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        **dims: the decoder's dims, as ``torchtune.models.mistral.mistral_classifier`` takes them
            (``vocab_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``embed_dim``,
            ``intermediate_dim``, ``max_seq_len``, optional ``norm_eps``, ``rope_base``).

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` scores.

    Raises:
        ValueError: ``apply_lora_to_output`` is True.
    """
    if apply_lora_to_output:
        raise ValueError(
            f"apply_lora_to_output={apply_lora_to_output!r}: a classifier's [num_classes, embed_dim] "
            "head trains whole beside the adapters (a value model) or stays frozen (a reward model); "
            "set apply_lora_to_output=False.")
    return _torchtune_lora_mistral_classifier(
        lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=False, num_classes=num_classes, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, **dims)
