"""Stand-ins for the downloads the real-model configs name, built offline at tiny dims.

For each config under recipes/configs/{llama3_2,qwen2_5,mistral}: a policy and a reward
checkpoint of its family written by transformers (full vocabulary, so the configs' stop
token ids stay valid; two layers of width 32 otherwise) under the file names the config lists,
a tokenizer file of the format its tokenizer builder reads, and the command-line overrides
that point the config at them.

The tokenizers are real files of the right format with a byte-level vocabulary and no
merges: llama3's tiktoken BPE file (256 byte tokens; special tokens keep their canonical ids
128000+), Qwen2.5's vocab.json + merges.txt (256 byte symbols; special tokens at 151643+),
and for Mistral a SentencePiece model (the tiny sentiment task's).
"""

import base64
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

from torchtune.models.qwen2._tokenizer import bytes_to_unicode

import torchtune_ppo
from hf_families import save_sharded

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "recipes" / "configs"
WIDTH = dict(num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64, max_seq_len=256)
HF_WIDTH = dict(
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=32,
    intermediate_size=64, max_position_embeddings=131072,
)
PROMPTS = [
    "the movie was", "honestly the acting was", "i went in expecting", "the plot of this film",
    "what a", "the director", "this is the kind of film", "my friends and i",
    "the ending", "two hours of", "the soundtrack", "i can not believe",
]


def llama3_tokenizer_file(path: Path) -> None:
    """A tiktoken BPE file: one line per byte, ``base64(byte) rank``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))


def qwen2_tokenizer_files(folder: Path) -> None:
    """vocab.json with the 256 byte symbols of byte-level BPE, and an empty merges.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")


def sentencepiece_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(torchtune_ppo.asset_path("tiny_sentiment/tokenizer.model"), path)


def _hf_model(cls_name: str, config_cls: str, vocab: int, tied: bool, num_labels: int = 0, **extra):
    import torch
    import transformers

    torch.manual_seed(vocab + num_labels)
    kwargs = dict(HF_WIDTH, vocab_size=vocab, tie_word_embeddings=tied, **extra)
    if num_labels:
        kwargs["num_labels"] = num_labels
    return getattr(transformers, cls_name)(getattr(transformers, config_cls)(**kwargs)).eval()


@dataclass(frozen=True)
class StandIn:
    """How to build the downloads of one config and point the config at them."""

    config: str  # relative to recipes/configs
    build: Callable[[Path], Dict[str, str]]  # folder -> path overrides
    tiny_models: List[str]  # overrides that build the models at the stand-ins' dims
    extra: List[str]  # overrides a CPU run needs (e.g. an optimizer without CUDA)


def _checkpointers(overrides: Dict[str, str], policy: Path, value: Path, reward: Path) -> Dict[str, str]:
    for key, folder in (("checkpointer", policy), ("ref_policy_checkpointer", policy),
                        ("value_checkpointer", value), ("reward_checkpointer", reward)):
        overrides[f"{key}.checkpoint_dir"] = str(folder)
    return overrides


def _llama3_2(root: Path) -> Dict[str, str]:
    policy, reward = root / "Llama-3.2-1B-Instruct", root / "Llama-3.2-1B-reward"
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    common = dict(rms_norm_eps=1e-5, rope_parameters=rope, pad_token_id=128004)
    _hf_model("LlamaForCausalLM", "LlamaConfig", 128256, True, **common).save_pretrained(policy)
    _hf_model("LlamaForSequenceClassification", "LlamaConfig", 128256, False, 1, **common).save_pretrained(reward)
    llama3_tokenizer_file(policy / "original" / "tokenizer.model")
    return _checkpointers({"tokenizer.path": str(policy / "original" / "tokenizer.model")}, policy, reward, reward)


def _qwen2_5(size: str, value_from_policy: bool) -> Callable[[Path], Dict[str, str]]:
    def build(root: Path) -> Dict[str, str]:
        policy, reward = root / f"Qwen2.5-{size}-Instruct", root / f"Qwen2.5-{size}-reward"
        common = dict(rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                      pad_token_id=151643)
        _hf_model("Qwen2ForCausalLM", "Qwen2Config", 151936, True, **common).save_pretrained(policy)
        _hf_model("Qwen2ForSequenceClassification", "Qwen2Config", 151936, False, 1, **common).save_pretrained(reward)
        qwen2_tokenizer_files(policy)
        overrides = {"tokenizer.path": str(policy / "vocab.json"), "tokenizer.merges_file": str(policy / "merges.txt")}
        return _checkpointers(overrides, policy, policy if value_from_policy else reward, reward)

    return build


def _mistral(root: Path) -> Dict[str, str]:
    policy, reward = root / "Mistral-7B-Instruct-v0.2", root / "RM-Mistral-7B"
    common = dict(rms_norm_eps=1e-5, sliding_window=None, pad_token_id=0,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    save_sharded(_hf_model("MistralForCausalLM", "MistralConfig", 32000, False, **common), policy,
                 [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)])
    save_sharded(_hf_model("MistralForSequenceClassification", "MistralConfig", 32001, False, 1, **common),
                 reward, [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)])
    sentencepiece_file(policy / "tokenizer.model")
    return _checkpointers({"tokenizer.path": str(policy / "tokenizer.model")}, policy, reward, reward)


def _tiny(key: str, component: str, **dims) -> List[str]:
    return [f"{key}._component_={component}", *(f"{key}.{k}={v}" for k, v in {**WIDTH, **dims}.items())]


STANDINS = [
    StandIn(
        "llama3_2/1B_ppo.yaml",
        _llama3_2,
        _tiny("policy_model", "torchtune.models.llama3_2._component_builders.llama3_2",
              vocab_size=128256, tie_word_embeddings=True)
        + _tiny("reward_and_value_model", "torchtune_ppo.models.llama3_2_classifier",
                num_classes=1, vocab_size=128256),
        [],
    ),
    StandIn(
        "qwen2_5/0.5B_ppo.yaml",
        _qwen2_5("0.5B", value_from_policy=True),
        _tiny("policy_model", "torchtune.models.qwen2._component_builders.qwen2",
              vocab_size=151936, tie_word_embeddings=True, norm_eps=1e-6)
        + _tiny("reward_and_value_model", "torchtune_ppo.models.qwen2_classifier",
                num_classes=1, vocab_size=151936),
        [],
    ),
    StandIn(
        "qwen2_5/1.5B_ppo.yaml",
        _qwen2_5("1.5B", value_from_policy=False),
        _tiny("policy_model", "torchtune.models.qwen2._component_builders.qwen2",
              vocab_size=151936, tie_word_embeddings=True, norm_eps=1e-6)
        + _tiny("reward_and_value_model", "torchtune_ppo.models.qwen2_classifier",
                num_classes=1, vocab_size=151936),
        [],
    ),
    StandIn(
        "mistral/7B_ppo_low_memory.yaml",
        _mistral,
        _tiny("policy_model", "torchtune.models.mistral._component_builders.mistral",
              vocab_size=32000, rope_base=10000)
        + _tiny("reward_and_value_model", "torchtune.models.mistral._component_builders.mistral_classifier",
                num_classes=1, vocab_size=32001),
        # bitsandbytes' PagedAdamW needs CUDA.
        ["optimizer._component_=torch.optim.AdamW"],
    ),
]


def prompts_file(path: Path) -> Path:
    path.write_text(json.dumps([{"prompt": p} for p in PROMPTS]))
    return path
