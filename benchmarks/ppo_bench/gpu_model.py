"""``--gpu``: random-weight HF checkpoints with the Llama-3.2-1B body and the tiny vocabulary."""

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

# Llama-3.2-1B body. The vocabulary is the tiny tokenizer's (512), not Llama-3's 128,256:
# token ids must index the embedding, and the prompts come from the tiny task.
LLAMA_1B = dict(num_heads=32, num_kv_heads=8, embed_dim=2048, intermediate_dim=8192, norm_eps=1e-5)
GPU_VOCAB = 512
GPU_MAX_SEQ_LEN = 512


def describe(layers: int) -> str:
    """The ``--gpu`` model in words, for the report."""
    return (f"Llama-3.2-1B body ({layers} layers, dim 2048, 32/8 heads, MLP 8192), "
            f"vocab {GPU_VOCAB} (the tiny tokenizer's), random weights; reward/value: same body")


def build_gpu_assets(
    args: argparse.Namespace, folder: Path
) -> Tuple[List[str], Dict[str, Any], Dict[str, Any]]:
    """Writes random-weight HF checkpoints with a Llama-3.2-1B body under ``folder``.

    Args:
        args (argparse.Namespace): the parsed command line (``layers``, ``dtype``).
        folder (Path): where the ``policy`` and ``reward`` checkpoints go.

    Returns:
        Tuple[List[str], Dict[str, Any], Dict[str, Any]]: the checkpointer overrides
        (``key=value``), and the policy and reward/value model blocks.
    """
    import torch
    from safetensors.torch import save_file
    from torchtune.models import convert_weights
    from torchtune.models.llama2._component_builders import llama2_classifier
    from torchtune.models.llama3_2._component_builders import llama3_2
    from torchtune.rlhf.utils import reward_tune_to_hf

    dims = dict(LLAMA_1B, vocab_size=GPU_VOCAB, num_layers=args.layers, max_seq_len=GPU_MAX_SEQ_LEN)
    # torchtune 0.6.1 has no llama3.2 classifier builder: the reward/value model is the llama2
    # classifier with the same body (it differs only in RoPE scaling, moot with random weights).
    policy = {"_component_": "torchtune.models.llama3_2._component_builders.llama3_2", **dims}
    reward = {"_component_": "torchtune.models.llama2._component_builders.llama2_classifier",
              "num_classes": 1, **dims}
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    heads = dict(num_heads=LLAMA_1B["num_heads"], num_kv_heads=LLAMA_1B["num_kv_heads"],
                 dim=LLAMA_1B["embed_dim"])
    for name, build, to_hf in (
        ("policy", llama3_2, convert_weights.tune_to_hf),
        ("reward", lambda **d: llama2_classifier(num_classes=1, **d), reward_tune_to_hf),
    ):
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in build(**dims).state_dict().items()}
        state = {
            k: torch.ones(s, dtype=dtype) if k.endswith("scale")
            else (torch.randn(s, generator=gen) * 0.02).to(dtype)
            for k, s in shapes.items()
        }
        (folder / name).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in to_hf(state, **heads).items()},
                  str(folder / name / "model.safetensors"))
        hf_config = {
            "hidden_size": LLAMA_1B["embed_dim"], "num_attention_heads": LLAMA_1B["num_heads"],
            "num_key_value_heads": LLAMA_1B["num_kv_heads"], "num_hidden_layers": args.layers,
            "intermediate_size": LLAMA_1B["intermediate_dim"], "vocab_size": GPU_VOCAB,
            "tie_word_embeddings": name == "policy",
        }
        (folder / name / "config.json").write_text(json.dumps(hf_config))
    model_type = {"checkpointer": "LLAMA3_2", "ref_policy_checkpointer": "LLAMA3_2",
                  "value_checkpointer": "REWARD", "reward_checkpointer": "REWARD"}
    out = []
    for key, kind in model_type.items():
        sub = "policy" if kind == "LLAMA3_2" else "reward"
        out += [f"{key}.checkpoint_dir={folder / sub}", f"{key}.model_type={kind}",
                f"{key}.checkpoint_files=[model.safetensors]"]
    return out, policy, reward
