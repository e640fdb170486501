"""SmolLM2 (HuggingFaceTB/SmolLM2-*) policy, value / reward model and tokenizer builders.

SmolLM2 is a Llama: GQA attention without biases, SwiGLU MLP, RMSNorm, tied embeddings, but
*plain* RoPE (``rope_theta`` 100000, ``rope_scaling: null``). torchtune 0.6.1 has no builder
for that combination: ``llama3_2`` ties embeddings but always applies Llama-3's RoPE scaling,
``llama3`` has plain RoPE but an untied head. :func:`smollm2` assembles torchtune's own modules
(those ``llama3`` uses) with a ``TiedLinear`` head, so the layers are exactly torchtune's.

Checkpoints are Hugging Face ``LlamaForCausalLM`` folders (e.g. the one
``tools/prepare_smollm2.py`` writes): the policy loads with
``torchtune.training.FullModelHFCheckpointer(model_type="LLAMA3_2")`` (Llama's q/k conversion;
``LLAMA3_2`` also drops an ``output.weight`` on save, right for tied embeddings), a value model
with :class:`torchtune_ppo.models.ClassifierHFCheckpointer` (``model_type: LLAMA3_2``,
``value_head_init: zeros`` to start it from the policy checkpoint).
"""

from typing import Callable, List, Optional

from torch import nn
from torchtune.modules.peft import LoRALinear
from torchtune.modules import (
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

from torchtune_ppo._patches.torchtune_modules import llama3_mlp, lora_llama3_mlp
from torchtune_ppo.models._component_builders import with_classifier_head
from torchtune_ppo.models._hf_tokenizer import HFChatTokenizer, hf_chat_tokenizer

__all__ = [
    "lora_smollm2",
    "lora_smollm2_135m",
    "lora_smollm2_135m_classifier",
    "lora_smollm2_classifier",
    "smollm2",
    "smollm2_135m",
    "smollm2_135m_classifier",
    "smollm2_classifier",
    "smollm2_tokenizer",
]

# SmolLM2-135M(-Instruct)'s config.json.
_SMOLLM2_135M = dict(
    vocab_size=49152,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    embed_dim=576,
    intermediate_dim=1536,
    rope_base=100_000.0,
    norm_eps=1e-5,
)
# Special tokens of the SmolLM2 vocabulary (ids 0-16 are StarCoder-style control tokens).
_IM_END = "<|im_end|>"
_ENDOFTEXT = "<|endoftext|>"
# A control token a chat model never writes (it marks an empty Jupyter output in code data):
# the pad token must differ from every stop token, and the config's pad (<|im_end|>) is one.
_SMOLLM2_PAD = "<empty_output>"


def smollm2(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    rope_base: float = 100_000.0,
    norm_eps: float = 1e-5,
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """Build a SmolLM2 decoder (Llama layers, plain RoPE, tied embeddings by default).

    Args:
        vocab_size (int): number of tokens in the vocabulary.
        num_layers (int): number of transformer layers.
        num_heads (int): number of query heads.
        num_kv_heads (int): number of key and value heads (grouped-query attention).
        embed_dim (int): embedding dimension; ``head_dim`` is ``embed_dim // num_heads``.
        intermediate_dim (int): MLP hidden size.
        max_seq_len (int): maximum sequence length (sizes the RoPE and KV caches).
        attn_dropout (float): dropout passed to scaled_dot_product_attention. Default: 0.0
        rope_base (float): ``rope_theta``. Default: 100_000.0
        norm_eps (float): epsilon of the RMS norms. Default: 1e-5
        tie_word_embeddings (bool): share the LM head with the token embeddings. Default: True

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, vocab_size]`` logits.
    """
    layers = _layers(
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, embed_dim=embed_dim,
        intermediate_dim=intermediate_dim, max_seq_len=max_seq_len, attn_dropout=attn_dropout,
        rope_base=rope_base, norm_eps=norm_eps,
    )
    return _decoder(layers, vocab_size, embed_dim, num_heads, max_seq_len, norm_eps, tie_word_embeddings)


def _layers(
    *, num_layers: int, num_heads: int, num_kv_heads: int, embed_dim: int, intermediate_dim: int,
    max_seq_len: int, attn_dropout: float, rope_base: float, norm_eps: float,
    linear: Optional[Callable[[str, int, int], nn.Module]] = None, lora_mlp: Optional[dict] = None,
) -> nn.ModuleList:
    """SmolLM2's layers; ``linear(name, in, out)`` builds each attention projection (a plain
    ``nn.Linear`` by default), and ``lora_mlp`` (``lora_rank``, ``lora_alpha``, ``lora_dropout``)
    puts LoRA adapters on the MLP."""
    linear = linear or (lambda name, d_in, d_out: nn.Linear(d_in, d_out, bias=False))
    head_dim = embed_dim // num_heads
    # One RoPE module shared by every layer, as torchtune's llama builders do.
    rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = MultiHeadAttention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=linear("q_proj", embed_dim, num_heads * head_dim),
            k_proj=linear("k_proj", embed_dim, num_kv_heads * head_dim),
            v_proj=linear("v_proj", embed_dim, num_kv_heads * head_dim),
            output_proj=linear("output_proj", num_heads * head_dim, embed_dim),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
        )
        mlp = (llama3_mlp(dim=embed_dim, hidden_dim=intermediate_dim) if lora_mlp is None
               else lora_llama3_mlp(dim=embed_dim, hidden_dim=intermediate_dim, **lora_mlp))
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )
        )
    return layers


def _decoder(layers: nn.ModuleList, vocab_size: int, embed_dim: int, num_heads: int, max_seq_len: int,
             norm_eps: float, tie_word_embeddings: bool) -> TransformerDecoder:
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    output = TiedLinear(tok_embeddings) if tie_word_embeddings else nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=embed_dim // num_heads,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


def smollm2_classifier(
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
    rope_base: float = 100_000.0,
    norm_eps: float = 1e-5,
) -> TransformerDecoder:
    """A SmolLM2 decoder with an untied ``[num_classes, embed_dim]`` head (reward / value model).

    The layout of ``LlamaForSequenceClassification`` (``score.weight``), as
    :class:`torchtune_ppo.models.ClassifierHFCheckpointer` reads and writes it.

    Args:
        num_classes (int): width of the head; 1 for a reward or value model.
        vocab_size (int): number of tokens in the vocabulary.
        num_layers (int): number of transformer layers.
        num_heads (int): number of query heads.
        num_kv_heads (int): number of key and value heads.
        embed_dim (int): embedding dimension.
        intermediate_dim (int): MLP hidden size.
        max_seq_len (int): maximum sequence length.
        attn_dropout (float): dropout passed to scaled_dot_product_attention. Default: 0.0
        rope_base (float): ``rope_theta``. Default: 100_000.0
        norm_eps (float): epsilon of the RMS norms. Default: 1e-5

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` float32 scores.
    """
    # Tied while building: no [vocab, embed_dim] output matrix is allocated, only replaced.
    model = smollm2(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len,
        attn_dropout=attn_dropout, rope_base=rope_base, norm_eps=norm_eps, tie_word_embeddings=True,
    )
    return with_classifier_head(model, embed_dim, num_classes)


def smollm2_135m(max_seq_len: int = 8192) -> TransformerDecoder:
    """SmolLM2-135M(-Instruct): 30 layers, dim 576, 9 heads / 3 KV heads, FFN 1536, tied.

    Args:
        max_seq_len (int): maximum sequence length. Default: 8192 (the model's context)

    Returns:
        TransformerDecoder: the policy, ``[b, s] -> [b, s, 49152]`` logits.
    """
    return smollm2(**_SMOLLM2_135M, max_seq_len=max_seq_len)


def smollm2_135m_classifier(num_classes: int = 1, max_seq_len: int = 8192) -> TransformerDecoder:
    """SmolLM2-135M with a ``num_classes``-wide head (a ``LlamaForSequenceClassification``).

    Args:
        num_classes (int): width of the head. Default: 1 (a reward or value model)
        max_seq_len (int): maximum sequence length. Default: 8192

    Returns:
        TransformerDecoder: the classifier, ``[b, s] -> [b, s, num_classes]``.
    """
    return smollm2_classifier(num_classes, **_SMOLLM2_135M, max_seq_len=max_seq_len)


def lora_smollm2(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    tie_word_embeddings: bool = True,
    **dims,
) -> TransformerDecoder:
    """:func:`smollm2` with LoRA adapters, keys as torchtune's LoRA builders name them.

    The adapters are torchtune's ``LoRALinear`` on the chosen attention projections and, with
    ``apply_lora_to_mlp``, its ``lora_llama3_mlp``; the frozen weights keep :func:`smollm2`'s
    names, so the same checkpoint loads into the base.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters, of ``q_proj``,
            ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        apply_lora_to_output (bool): must be False: the head is the token embedding (tied), which
            an adapter cannot share. Default: False
        lora_rank (int): rank of each adapter.
        lora_alpha (float): the update is ``alpha / rank * B A x``.
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        tie_word_embeddings (bool): share the LM head with the token embeddings. Default: True
        **dims: the decoder's dims, as :func:`smollm2` takes them.

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, vocab_size]`` logits.

    Raises:
        ValueError: ``apply_lora_to_output=True``, or an unknown name in ``lora_attn_modules``.
    """
    if apply_lora_to_output:
        raise ValueError("apply_lora_to_output=True: SmolLM2's output projection is its token embedding "
                         "(tied), which a LoRA adapter cannot share. Set apply_lora_to_output=False.")
    names = ("q_proj", "k_proj", "v_proj", "output_proj")
    unknown = [m for m in lora_attn_modules if m not in names]
    if unknown:
        raise ValueError(f"lora_attn_modules has {unknown}: valid names are {list(names)}")
    adapter = dict(lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout)

    def linear(name: str, d_in: int, d_out: int) -> nn.Module:
        if name in lora_attn_modules:
            return LoRALinear(d_in, d_out, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
        return nn.Linear(d_in, d_out, bias=False)

    vocab_size, norm_eps = dims.pop("vocab_size"), dims.pop("norm_eps", 1e-5)
    layers = _layers(linear=linear, lora_mlp=adapter if apply_lora_to_mlp else None, norm_eps=norm_eps,
                     attn_dropout=dims.pop("attn_dropout", 0.0), rope_base=dims.pop("rope_base", 100_000.0), **dims)
    return _decoder(layers, vocab_size, dims["embed_dim"], dims["num_heads"], dims["max_seq_len"], norm_eps,
                    tie_word_embeddings)


def lora_smollm2_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    *,
    num_classes: int,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    **dims,
) -> TransformerDecoder:
    """:func:`smollm2_classifier` with LoRA adapters; the head is a plain ``nn.Linear``, trained
    whole with the adapters (a value model) or frozen (a reward model).

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        num_classes (int): width of the head; 1 for a reward or value model.
        lora_rank (int): rank of each adapter.
        lora_alpha (float): the update is ``alpha / rank * B A x``.
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        **dims: the decoder's dims, as :func:`smollm2` takes them.

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` scores.
    """
    embed_dim = dims["embed_dim"]
    model = lora_smollm2(lora_attn_modules, apply_lora_to_mlp, lora_rank=lora_rank, lora_alpha=lora_alpha,
                         lora_dropout=lora_dropout, tie_word_embeddings=True, **dims)
    return with_classifier_head(model, embed_dim, num_classes)


def lora_smollm2_135m(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    max_seq_len: int = 8192,
) -> TransformerDecoder:
    """SmolLM2-135M(-Instruct) with LoRA adapters (:func:`lora_smollm2`), the policy.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        apply_lora_to_output (bool): must be False (tied head). Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): the update is ``alpha / rank * B A x``. Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        max_seq_len (int): maximum sequence length. Default: 8192

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, 49152]`` logits.
    """
    return lora_smollm2(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank=lora_rank,
                        lora_alpha=lora_alpha, lora_dropout=lora_dropout, **_SMOLLM2_135M, max_seq_len=max_seq_len)


def lora_smollm2_135m_classifier(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    num_classes: int = 1,
    max_seq_len: int = 8192,
) -> TransformerDecoder:
    """SmolLM2-135M with LoRA adapters and a ``num_classes``-wide head (value / reward model).

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): the update is ``alpha / rank * B A x``. Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0
        num_classes (int): width of the head. Default: 1
        max_seq_len (int): maximum sequence length. Default: 8192

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, num_classes]`` scores.
    """
    return lora_smollm2_classifier(lora_attn_modules, apply_lora_to_mlp, num_classes=num_classes,
                                   lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                   **_SMOLLM2_135M, max_seq_len=max_seq_len)


def smollm2_tokenizer(
    path: str,
    max_seq_len: Optional[int] = None,
    pad_token: str = _SMOLLM2_PAD,
) -> HFChatTokenizer:
    """The SmolLM2 tokenizer with its ChatML chat template, from a prepared model folder.

    Stop tokens are ``<|im_end|>`` (the end of a chat turn, also the config's EOS) and
    ``<|endoftext|>`` (the end of a document, what the base model ends with). The config's pad
    token is ``<|im_end|>``, a stop token, so ``pad_id`` is another control token by default.

    Args:
        path (str): the folder, with ``tokenizer.json``, ``tokenizer_config.json`` and
            ``generation_config.json`` (e.g. from ``tools/prepare_smollm2.py``).
        max_seq_len (Optional[int]): truncation length of ``tokenize_messages``.
        pad_token (str): the padding token. Default: ``<empty_output>`` (id 16)

    Returns:
        HFChatTokenizer: ``bos_id`` 1 (``<|im_start|>``), ``eos_id`` 2, ``stop_tokens``
        ``[2, 0]``, ``pad_id`` 16.
    """
    return hf_chat_tokenizer(path, max_seq_len=max_seq_len, pad_token=pad_token, stop_tokens=[_IM_END, _ENDOFTEXT])
