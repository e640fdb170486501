"""Random-weight HF checkpoints for the larger benchmark models: ``--gpu`` and ``--cpu-large``.

Both presets build llama3_2 policies and llama2 classifiers for the reward/value model, with
the tiny tokenizer's vocabulary (512) since the prompts and token ids come from the tiny task,
and write them as Hugging Face checkpoints (``config.json`` + ``model.safetensors``) that both
recipes load through ``FullModelHFCheckpointer``, as they load the tiny task's.

- ``--gpu``: the Llama-3.2-1B body (16 layers, dim 2048, 32/8 heads, MLP 8192) for the policy
  and for the reward/value model.
- ``--cpu-large``: an 8-layer dim-256 policy (8/4 heads, MLP 768; 6.4M parameters) and a
  4-layer dim-128 reward/value classifier (4/2 heads, MLP 384; the tiny policy's body, 0.9M
  parameters). Its config stops responses on a list of 13 token ids (see ``CPU_LARGE``).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

VOCAB = 512  # the tiny tokenizer's; Llama-3's 128,256 would not match the prompts' token ids
MAX_SEQ_LEN = 512
NORM_EPS = 1e-5


@dataclass(frozen=True)
class Body:
    """A llama decoder body's dimensions."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int

    def dims(self) -> Dict[str, Any]:
        """The keyword arguments of torchtune's llama builders (vocabulary and length included)."""
        return dict(vocab_size=VOCAB, num_layers=self.num_layers, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, embed_dim=self.embed_dim,
                    intermediate_dim=self.intermediate_dim, max_seq_len=MAX_SEQ_LEN,
                    norm_eps=NORM_EPS)

    def words(self) -> str:
        return (f"{self.num_layers} layers, dim {self.embed_dim}, "
                f"{self.num_heads}/{self.num_kv_heads} heads, MLP {self.intermediate_dim}")


@dataclass(frozen=True)
class Preset:
    """The policy and reward/value bodies of one benchmark model set, and what its config adds.

    ``stop_token_ids`` (when set) replaces the config's, in our config and torchtune's alike.
    """

    name: str
    policy: Body
    reward: Body
    stop_token_ids: Optional[Tuple[int, ...]] = None

    def describe(self) -> str:
        """The model set in words, for the report."""
        reward = "same body" if self.reward == self.policy else f"llama classifier, {self.reward.words()}"
        text = (f"{self.name}: policy {self.policy.words()} ({num_params(self.policy) / 1e6:.1f}M "
                f"parameters), vocab {VOCAB} (the tiny tokenizer's), random weights; reward/value: "
                f"{reward}")
        if self.reward != self.policy:
            text += f" ({num_params(self.reward, classifier=True) / 1e6:.1f}M parameters)"
        if self.stop_token_ids:
            text += (f"; responses stop on any of {len(self.stop_token_ids)} token ids "
                     f"{list(self.stop_token_ids)} (eos 2 among them), the same list in both recipes")
        return text


LLAMA_1B = Body(num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048, intermediate_dim=8192)


def gpu_preset(layers: int) -> Preset:
    """``--gpu``: the Llama-3.2-1B body with ``layers`` layers for every model."""
    body = Body(**{**LLAMA_1B.__dict__, "num_layers": layers})
    return Preset("Llama-3.2-1B body", body, body)


# ``--cpu-large``. A random-weight policy samples nearly uniformly from the 512 tokens (each
# token's probability, averaged over sampled contexts, within 0.8-1.2x of 1/512), so it almost
# never samples eos (2): every response would run the full T tokens. Stopping on 13 ids (eos
# and every 40th id, none of them the pad id 0; together 2.7% of the probability) ends a
# response at each token with probability ~1/38, so response lengths spread from 1 to T = 64
# as in real PPO. Measured at batch 32: a mean of 33.6 tokens at step 1 (half of T), then ~24
# from step 2 on, in both recipes alike, as PPO learns from the tiny config's no-stop penalty
# (penalise_no_eos, reward_penalty -3) to stop sooner; the report's *response len* column gives
# each row's mean. Both recipes get the same list; torchtune's recipe requires eos in it.
CPU_LARGE = Preset(
    "8-layer CPU model",
    policy=Body(num_layers=8, num_heads=8, num_kv_heads=4, embed_dim=256, intermediate_dim=768),
    reward=Body(num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=128, intermediate_dim=384),
    stop_token_ids=(2, *range(40, VOCAB, 40)),
)


def num_params(body: Body, classifier: bool = False) -> int:
    """Parameters of a llama3_2 policy (tied embeddings) or a one-output llama2 classifier."""
    d, kv_dim = body.embed_dim, body.embed_dim // body.num_heads * body.num_kv_heads
    layer = 2 * d * d + 2 * d * kv_dim + 3 * d * body.intermediate_dim + 2 * d
    head = d if classifier else 0  # the classifier's [1, d] output; the policy's is tied
    return VOCAB * d + body.num_layers * layer + d + head


def build_assets(
    preset: Preset, folder: Path, dtype: str
) -> Tuple[List[str], Dict[str, Any], Dict[str, Any]]:
    """Writes random-weight HF checkpoints of ``preset``'s policy and reward/value model.

    Weights are drawn from a seeded generator (normal, std 0.02; norm scales 1), so every
    row of a run, and every run, loads the same models.

    Args:
        preset (Preset): the bodies (and stop tokens) to build.
        folder (Path): where the ``policy`` and ``reward`` checkpoints go.
        dtype (str): ``"bf16"`` or ``"fp32"``, the dtype the weights are stored in.

    Returns:
        Tuple[List[str], Dict[str, Any], Dict[str, Any]]: the config overrides (``key=value``:
        the checkpointers, and ``stop_token_ids`` when the preset sets them), and the policy
        and reward/value model blocks.
    """
    import torch
    from safetensors.torch import save_file
    from torchtune.models import convert_weights
    from torchtune.models.llama2._component_builders import llama2_classifier
    from torchtune.models.llama3_2._component_builders import llama3_2
    from torchtune.rlhf.utils import reward_tune_to_hf

    # torchtune 0.6.1 has no llama3.2 classifier builder: the reward/value model is the llama2
    # classifier (it differs only in RoPE scaling, moot with random weights).
    policy = {"_component_": "torchtune.models.llama3_2._component_builders.llama3_2",
              **preset.policy.dims()}
    reward = {"_component_": "torchtune.models.llama2._component_builders.llama2_classifier",
              "num_classes": 1, **preset.reward.dims()}
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    for name, body, build, to_hf in (
        ("policy", preset.policy, llama3_2, convert_weights.tune_to_hf),
        ("reward", preset.reward, lambda **d: llama2_classifier(num_classes=1, **d), reward_tune_to_hf),
    ):
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in build(**body.dims()).state_dict().items()}
        state = {
            k: torch.ones(s, dtype=torch_dtype) if k.endswith("scale")
            else (torch.randn(s, generator=gen) * 0.02).to(torch_dtype)
            for k, s in shapes.items()
        }
        heads = dict(num_heads=body.num_heads, num_kv_heads=body.num_kv_heads, dim=body.embed_dim)
        (folder / name).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in to_hf(state, **heads).items()},
                  str(folder / name / "model.safetensors"))
        hf_config = {
            "hidden_size": body.embed_dim, "num_attention_heads": body.num_heads,
            "num_key_value_heads": body.num_kv_heads, "num_hidden_layers": body.num_layers,
            "intermediate_size": body.intermediate_dim, "vocab_size": VOCAB,
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
    if preset.stop_token_ids:
        out.append(f"stop_token_ids=[{','.join(map(str, preset.stop_token_ids))}]")
    return out, policy, reward
