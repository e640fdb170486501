"""Reward and value models for Llama-3.x, Qwen2.5, Mistral and SmolLM2, and their HF checkpoints.

- Classifier builders (one output per token, untied head), named like torchtune's:
  ``llama3_2_1b_classifier``, ``llama3_2_3b_classifier``, ``llama3_1_8b_classifier``,
  ``qwen2_5_{0_5b,1_5b,3b,7b}_classifier``; component builders taking dims:
  ``llama3_2_classifier``, ``llama3_1_classifier``, ``qwen2_classifier``; with LoRA adapters
  (a value model that trains adapters and its head) ``lora_llama3_2_1b_classifier``,
  ``lora_qwen2_5_0_5b_classifier``, ``lora_mistral_7b_classifier``, ``lora_llama3_2_classifier``,
  ``lora_qwen2_classifier``, ``lora_mistral_classifier`` (torchtune's, with a head trained whole).
  Mistral's plain ones are torchtune's own (``torchtune.models.mistral.mistral_classifier``).
- :class:`ClassifierHFCheckpointer`: HF ``*ForSequenceClassification`` checkpoints of any of
  these families, loaded and saved with ``score.weight``; it can also start a value model
  from a policy checkpoint (``value_head_init``), as :func:`value_head_from_policy` does for a
  state dict.
- SmolLM2 (Llama layers, plain RoPE, tied embeddings), which torchtune has no builder for:
  ``smollm2_135m`` (policy), ``smollm2_135m_classifier`` (value / reward model), component
  builders ``smollm2`` and ``smollm2_classifier``, with LoRA adapters ``lora_smollm2_135m``,
  ``lora_smollm2_135m_classifier`` (``lora_smollm2``, ``lora_smollm2_classifier``), and
  ``smollm2_tokenizer``; checkpoints
  load with ``model_type`` ``LLAMA3_2``. ``tools/prepare_smollm2.py`` writes the checkpoint.
- :class:`HFChatTokenizer` (builder ``hf_chat_tokenizer``): a torchtune model tokenizer over a
  Hugging Face ``tokenizer.json`` that renders messages with the model's chat template;
  :func:`render_chat_prompt` turns ``{"role", "content"}`` dicts into prompt ids.

Other policies need nothing new: torchtune's builders (``torchtune.models.llama3_2.llama3_2_1b``,
``torchtune.models.qwen2_5.qwen2_5_0_5b``, ``torchtune.models.mistral.mistral_7b``) with
``torchtune.training.FullModelHFCheckpointer`` and ``model_type`` ``LLAMA3_2``, ``QWEN2``,
``MISTRAL``.
"""

from torchtune_ppo.models._checkpointer import (
    CLASSIFIER_MODEL_TYPES,
    ClassifierHFCheckpointer,
    VALUE_HEAD_INITS,
    value_head_from_policy,
)
from torchtune_ppo.models._component_builders import (
    llama3_1_classifier,
    llama3_2_classifier,
    lora_llama3_2_classifier,
    lora_mistral_classifier,
    lora_qwen2_classifier,
    qwen2_classifier,
)
from torchtune_ppo.models._hf_tokenizer import HFChatTokenizer, hf_chat_tokenizer, render_chat_prompt
from torchtune_ppo.models._model_builders import (
    llama3_1_8b_classifier,
    llama3_2_1b_classifier,
    llama3_2_3b_classifier,
    lora_llama3_2_1b_classifier,
    lora_mistral_7b_classifier,
    lora_qwen2_5_0_5b_classifier,
    qwen2_5_0_5b_classifier,
    qwen2_5_1_5b_classifier,
    qwen2_5_3b_classifier,
    qwen2_5_7b_classifier,
)
from torchtune_ppo.models._smollm2 import (
    lora_smollm2,
    lora_smollm2_135m,
    lora_smollm2_135m_classifier,
    lora_smollm2_classifier,
    smollm2,
    smollm2_135m,
    smollm2_135m_classifier,
    smollm2_classifier,
    smollm2_tokenizer,
)

__all__ = [
    "CLASSIFIER_MODEL_TYPES",
    "ClassifierHFCheckpointer",
    "HFChatTokenizer",
    "VALUE_HEAD_INITS",
    "hf_chat_tokenizer",
    "llama3_1_8b_classifier",
    "llama3_1_classifier",
    "llama3_2_1b_classifier",
    "llama3_2_3b_classifier",
    "llama3_2_classifier",
    "lora_llama3_2_1b_classifier",
    "lora_llama3_2_classifier",
    "lora_mistral_7b_classifier",
    "lora_mistral_classifier",
    "lora_qwen2_5_0_5b_classifier",
    "lora_qwen2_classifier",
    "qwen2_5_0_5b_classifier",
    "qwen2_5_1_5b_classifier",
    "qwen2_5_3b_classifier",
    "qwen2_5_7b_classifier",
    "qwen2_classifier",
    "render_chat_prompt",
    "lora_smollm2",
    "lora_smollm2_135m",
    "lora_smollm2_135m_classifier",
    "lora_smollm2_classifier",
    "smollm2",
    "smollm2_135m",
    "smollm2_135m_classifier",
    "smollm2_classifier",
    "smollm2_tokenizer",
    "value_head_from_policy",
]
