"""The tiny sentiment task at run time: its model and tokenizer builders.

A policy pretrained on short synthetic reviews continues a sentiment-neutral opening
("honestly the acting was"); a reward model scores the sentiment; PPO should teach the
policy to write positive reviews. See ``assets/README.md``;
``tools/tasks/build_tiny_sentiment.py`` (in the repository) rebuilds the assets.

Config builders: ``torchtune_ppo.tasks.tiny_sentiment.tiny_policy``,
``torchtune_ppo.tasks.tiny_sentiment.tiny_reward``,
``torchtune_ppo.tasks.tiny_sentiment.tiny_tokenizer``; with LoRA adapters:
``torchtune_ppo.tasks.tiny_sentiment.tiny_lora_policy``, ``torchtune_ppo.tasks.tiny_sentiment.tiny_lora_reward``.
"""

from typing import List, Optional

from torchtune.models.llama2 import Llama2Tokenizer, llama2, llama2_classifier, lora_llama2, lora_llama2_classifier
from torchtune.modules import TransformerDecoder

from torchtune_ppo import asset_path

TASK = "tiny_sentiment"

# Token ids: SentencePiece defaults, as in Llama-2. torchtune's Llama2Tokenizer pads with
# the unk id 0, which never occurs in encoded text (the corpus is fully covered).
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 512
MAX_SEQ_LEN = 128
ROPE_BASE = 10000.0  # llama2_classifier has no rope_base argument and uses this default
NORM_EPS = 1e-5

# The one place the committed dims live: the builders below build from these and
# tools/tasks/build_tiny_sentiment.py writes config.json from them.
POLICY_DIMS = dict(
    vocab_size=VOCAB_SIZE,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,  # grouped-query attention, head_dim 32
    embed_dim=128,
    intermediate_dim=384,
    max_seq_len=MAX_SEQ_LEN,
)
REWARD_DIMS = dict(
    vocab_size=VOCAB_SIZE,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,  # head_dim 16
    embed_dim=64,
    intermediate_dim=192,
    max_seq_len=MAX_SEQ_LEN,
)


def tiny_policy() -> TransformerDecoder:
    """The task's policy: a 4-layer llama-style decoder with grouped-query attention.

    Returns:
        TransformerDecoder: randomly initialised; load ``assets/policy`` into it.
    """
    return llama2(**POLICY_DIMS, norm_eps=NORM_EPS, rope_base=ROPE_BASE)


def tiny_reward() -> TransformerDecoder:
    """The task's reward model: a 2-layer llama classifier with one output per token.

    Returns:
        TransformerDecoder: randomly initialised; load ``assets/reward`` into it.
    """
    return llama2_classifier(num_classes=1, **REWARD_DIMS, norm_eps=NORM_EPS)


def tiny_tokenizer(path: Optional[str] = None, max_seq_len: Optional[int] = None) -> Llama2Tokenizer:
    """The task's tokenizer (Llama-2 SentencePiece conventions, no chat template).

    Args:
        path (Optional[str]): a ``tokenizer.model``; defaults to the shipped one.
        max_seq_len (Optional[int]): truncate encoded sequences to this length.

    Returns:
        Llama2Tokenizer: pad/unk 0, bos 1, eos 2.
    """
    if path is None:
        path = asset_path(f"{TASK}/tokenizer.model")
    return Llama2Tokenizer(path=path, max_seq_len=max_seq_len, prompt_template=None)


def tiny_lora_policy(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
) -> TransformerDecoder:
    """:func:`tiny_policy` with LoRA adapters (torchtune's ``lora_llama2``): load
    ``assets/policy`` into its base; the adapters start with ``lora_b`` at zero.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters, of
            ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        apply_lora_to_output (bool): an adapter on the LM head too. Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): adapter scale numerator (the update is ``alpha / rank * B A x``). Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0

    Returns:
        TransformerDecoder: the policy with ``LoRALinear`` layers where asked.
    """
    return lora_llama2(
        lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output, **POLICY_DIMS, norm_eps=NORM_EPS,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
    )


def tiny_lora_reward(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
) -> TransformerDecoder:
    """:func:`tiny_reward` with LoRA adapters (torchtune's ``lora_llama2_classifier``): as
    ``reward_and_value_model`` the value model trains its adapters and its head, and the reward
    model keeps its adapters off.

    Args:
        lora_attn_modules (List[str]): attention linears that get adapters.
        apply_lora_to_mlp (bool): adapters on the MLP linears too. Default: False
        lora_rank (int): rank of each adapter. Default: 8
        lora_alpha (float): the update is ``alpha / rank * B A x``. Default: 16
        lora_dropout (float): dropout on the adapters' input. Default: 0.0

    Returns:
        TransformerDecoder: the classifier with ``LoRALinear`` layers where asked.
    """
    return lora_llama2_classifier(
        lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=False, num_classes=1, **REWARD_DIMS, norm_eps=NORM_EPS,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
    )
