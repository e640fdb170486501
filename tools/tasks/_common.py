"""What the embedded tasks' builders share: determinism, SentencePiece training, padding and
masks, the pretraining step, Hugging Face export and load, MANIFEST.json and the build|check
command line.

Build tools, not runtime: the installed package holds only ``torchtune_ppo/tasks/<task>/``
(builders and assets); these files stay in the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torchtune.modules import TransformerDecoder

NUM_THREADS = 1  # fixed: float reductions depend on the thread count (and 1 is fastest for
# these tiny matmuls on a busy machine: no OpenMP barriers)
PAD_ID = 0  # both tasks pad with the SentencePiece unk id, as torchtune's Llama2Tokenizer does


def deterministic(num_threads: int = NUM_THREADS) -> None:
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int, **options: Any) -> bytes:
    """SentencePiece BPE model bytes; single-threaded and unshuffled, so deterministic.

    Llama-2 ids (unk 0, bos 1, eos 2, no pad piece) and identity normalization (lowercase
    ASCII text; keeps the file small); ``options`` add or override trainer settings.
    """
    import sentencepiece as spm

    buf = io.BytesIO()
    settings = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        normalization_rule_name="identity",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, **{**settings, **options})
    return buf.getvalue()


# --------------------------------------------------------------------------- batches and training


def padded_batch(seqs: Sequence[Sequence[int]], left_pad: int = 0, right: bool = False,
                 pad_id: int = PAD_ID) -> torch.Tensor:
    """[B, L] tensor: each sequence padded with ``pad_id`` (on the left unless ``right``),
    plus ``left_pad`` extra pad columns on the left."""
    width = max(len(s) for s in seqs)
    rows = []
    for s in seqs:
        pad = [pad_id] * (width - len(s))
        rows.append([pad_id] * left_pad + (list(s) + pad if right else pad + list(s)))
    return torch.tensor(rows, dtype=torch.long)


def masks_from_valid(valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal mask [B, L, L] and position ids [B, L] from a [B, L] bool mask of real
    tokens, counted from the first real token: the recipe's convention for left padding."""
    from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask

    return get_causal_mask_from_padding_mask(valid), get_position_ids_from_padding_mask(valid)


def next_token_loss(model: TransformerDecoder, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model(tokens[:, :-1])`` against ``labels`` [B, L-1] (-100: ignored)."""
    logits = model(tokens[:, :-1])  # [B, L-1, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def optimizer_step(opt: torch.optim.Optimizer, model: torch.nn.Module, loss: torch.Tensor, lr: float) -> None:
    """One AdamW step at ``lr`` with the gradient norm clipped to 1."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


# --------------------------------------------------------------------------- HF storage


def hf_config(dims: Dict, *, norm_eps: float, rope_base: float, bos_id: int, eos_id: int, pad_id: int,
              reward: bool = False) -> Dict:
    """Llama-style HF config.json of a policy, or of a one-label classifier when ``reward``."""
    config = {
        "architectures": ["LlamaForSequenceClassification" if reward else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims["embed_dim"],
        "intermediate_size": dims["intermediate_dim"],
        "num_hidden_layers": dims["num_layers"],
        "num_attention_heads": dims["num_heads"],
        "num_key_value_heads": dims["num_kv_heads"],
        "head_dim": dims["embed_dim"] // dims["num_heads"],
        "vocab_size": dims["vocab_size"],
        "max_position_embeddings": dims["max_seq_len"],
        "rms_norm_eps": norm_eps,
        "rope_theta": rope_base,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    if reward:
        config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return config


def save_hf(model: TransformerDecoder, folder: Path, config: Dict, reward: bool = False) -> None:
    """Write ``config.json`` + ``model.safetensors`` in HF key naming (q/k rows permuted to
    HF's rotary layout by torchtune's own converters, which the checkpointer inverts)."""
    from safetensors.torch import save_file
    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.rlhf.utils import reward_tune_to_hf

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    kw = dict(num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
              dim=config["hidden_size"])
    hf = reward_tune_to_hf(sd, **kw) if reward else tune_to_hf(sd, **kw)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_hf(folder: Path, model: TransformerDecoder, model_type: str) -> TransformerDecoder:
    """``model`` (freshly built) loaded from a folder through torchtune's
    FullModelHFCheckpointer with ``model_type`` (strict keys), in eval mode."""
    from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = FullModelHFCheckpointer(checkpoint_dir=str(folder), checkpoint_files=["model.safetensors"],
                                       model_type=model_type, output_dir=tmp)
        sd = ckpt.load_checkpoint()[MODEL_KEY]
    model.load_state_dict(sd, strict=True)
    return model.eval()


@torch.no_grad()
def check_round_trip(name: str, model: TransformerDecoder, loaded: TransformerDecoder,
                     tokens: torch.Tensor, **kwargs: Any) -> None:
    """Raise unless ``loaded`` (through the checkpointer) gives exactly ``model``'s outputs."""
    a, b = model(tokens, **kwargs), loaded(tokens, **kwargs)
    if not torch.equal(a, b):
        raise RuntimeError(f"{name}: checkpoint round trip differs by {(a - b).abs().max()}")


# --------------------------------------------------------------------------- MANIFEST and CLI


def write_manifest(out: Path, manifest: Dict) -> Dict:
    """Write ``out/MANIFEST.json``: ``manifest`` plus the sha256 of every other file in ``out``."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    manifest = {**manifest, "files": {str(p.relative_to(out)): sha256(p) for p in files}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check(folder: Path, evaluate: Callable[..., Dict], **evaluate_kwargs: Any) -> int:
    """Compare the files of ``folder`` with its MANIFEST.json and print its sanity numbers
    next to the recorded ones; 1 when a file differs."""
    deterministic()
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    bad = [f for f, h in manifest["files"].items() if sha256(folder / f) != h]
    print(f"files: {len(manifest['files'])} listed, {len(bad)} differ from MANIFEST {bad or ''}")
    sanity = evaluate(folder, seed=manifest["seed"], **evaluate_kwargs)
    for k, v in sanity.items():
        ref = manifest["sanity"].get(k)
        print(f"  {k}: {v}" + ("" if ref == v else f"   (MANIFEST: {ref})"))
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]], *, doc: str, task: str, assets_dir: Path,
         build: Callable[..., Dict], evaluate: Callable[..., Dict],
         check_options: Optional[Dict[str, Dict]] = None) -> int:
    """``build [--seed N] [--out DIR]`` or ``check [--dir DIR] [check_options]`` for one task.

    ``check_options`` maps flags to ``argparse`` settings; their ``dest`` are passed to
    ``evaluate`` as keywords.
    """
    parser = argparse.ArgumentParser(prog=f"python tools/tasks/build_{task}.py",
                                     description=doc.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help=f"rebuild the {task} assets")
    p_build.add_argument("--seed", type=int, default=0)
    p_build.add_argument("--out", type=Path, default=None, help="default: the package assets folder")
    p_check = sub.add_parser("check", help="compare built assets with MANIFEST.json, print their numbers")
    p_check.add_argument("--dir", type=Path, default=None, help="default: the package assets folder")
    extra = [p_check.add_argument(flag, **kw).dest for flag, kw in (check_options or {}).items()]
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build(args.out or assets_dir, seed=args.seed)
        return 0
    return check(args.dir or assets_dir, evaluate, **{k: getattr(args, k) for k in extra})
