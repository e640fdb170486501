"""The tiny arithmetic task at run time: its model and tokenizer builders.

A policy pretrained on problems such as ``12+7=19`` and ``5-12=-7`` answers about a third
of unseen problems correctly; the reward is exact match with the reference answer (a
function of the text, no reward model); PPO should raise the share of correct answers.
See ``assets/README.md``; ``tools/tasks/build_tiny_arithmetic.py`` (in the repository)
rebuilds the assets.

Config builders: ``torchtune_ppo.tasks.tiny_arithmetic.tiny_policy``,
``torchtune_ppo.tasks.tiny_arithmetic.tiny_value``,
``torchtune_ppo.tasks.tiny_arithmetic.tiny_tokenizer``.
"""

from typing import Optional

from torchtune.models.llama2 import Llama2Tokenizer, llama2, llama2_classifier
from torchtune.modules import TransformerDecoder

from torchtune_ppo import asset_path

TASK = "tiny_arithmetic"

# Token ids: SentencePiece defaults, as in Llama-2; pad is the unk id 0, which never occurs
# in encoded problems. The 13 other pieces are the digits and "+", "-", "=", one each.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 16
MAX_SEQ_LEN = 32  # only sizes the RoPE cache: prompts are at most 7 tokens, answers 4
ROPE_BASE = 10000.0  # llama2_classifier has no rope_base argument and uses this default
NORM_EPS = 1e-5

# The one place the committed dims live: the builders below build from these and
# tools/tasks/build_tiny_arithmetic.py writes config.json from them.
POLICY_DIMS = dict(
    vocab_size=VOCAB_SIZE,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,  # grouped-query attention, head_dim 16
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


def tiny_value() -> TransformerDecoder:
    """The task's value model: the policy's architecture with one output per token.

    There is no reward model to start it from: it starts from the policy's weights with a
    fresh head, e.g. through ``torchtune_ppo.models.ClassifierHFCheckpointer`` with
    ``value_head_init: zeros`` on ``assets/policy``.

    Returns:
        TransformerDecoder: ``[b, s] -> [b, s, 1]``, randomly initialised.
    """
    return llama2_classifier(num_classes=1, **POLICY_DIMS, norm_eps=NORM_EPS)


def tiny_tokenizer(path: Optional[str] = None, max_seq_len: Optional[int] = None) -> Llama2Tokenizer:
    """The task's tokenizer: one piece per digit or sign, Llama-2 SentencePiece conventions.

    Args:
        path (Optional[str]): a ``tokenizer.model``; defaults to the shipped one.
        max_seq_len (Optional[int]): truncate encoded sequences to this length.

    Returns:
        Llama2Tokenizer: pad/unk 0, bos 1, eos 2.
    """
    if path is None:
        path = asset_path(f"{TASK}/tokenizer.model")
    return Llama2Tokenizer(path=path, max_seq_len=max_seq_len, prompt_template=None)
