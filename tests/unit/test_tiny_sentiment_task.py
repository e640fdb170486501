"""The tiny_sentiment task: its shipped assets (integrity, torchtune's own loaders take them),
its runtime builders, and the ppo_asset names that point at it."""

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchtune.datasets import text_completion_dataset
from torchtune.models.llama2 import llama2_tokenizer
from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

import torchtune_ppo.tasks.tiny_sentiment as task
from torchtune_ppo import asset_path

# The asset builder is a build tool in the repository, not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "tasks"))
import build_tiny_sentiment as build  # noqa: E402

ASSETS = Path(asset_path("tiny_sentiment"))
MANIFEST = json.loads((ASSETS / "MANIFEST.json").read_text())

POSITIVE = "the movie was truly wonderful. i loved it."
NEGATIVE = "the movie was truly awful. i hated it."


@pytest.fixture(scope="module")
def tokenizer():
    return llama2_tokenizer(str(ASSETS / "tokenizer.model"))


def _checkpointer(folder: str, model_type: str, out: Path) -> FullModelHFCheckpointer:
    return FullModelHFCheckpointer(
        checkpoint_dir=str(ASSETS / folder),
        checkpoint_files=["model.safetensors"],
        model_type=model_type,
        output_dir=str(out),
    )


def _load(folder: str, out: Path) -> torch.nn.Module:
    reward = folder == "reward"
    ckpt = _checkpointer(folder, "REWARD" if reward else "LLAMA2", out)
    model = task.tiny_reward() if reward else task.tiny_policy()
    model.load_state_dict(ckpt.load_checkpoint()[MODEL_KEY], strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return _load("policy", tmp_path_factory.mktemp("policy_out"))


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    return _load("reward", tmp_path_factory.mktemp("reward_out"))


def test_files_match_manifest():
    expected = {"tokenizer.model", "prompts.json", "README.md", "policy/config.json",
                "policy/model.safetensors", "reward/config.json", "reward/model.safetensors"}
    assert set(MANIFEST["files"]) == expected
    for name, sha in MANIFEST["files"].items():
        assert hashlib.sha256((ASSETS / name).read_bytes()).hexdigest() == sha, name
    assert MANIFEST["builder_version"] == build.BUILDER_VERSION


def test_tokenizer_loads_and_round_trips(tokenizer):
    assert tokenizer.vocab_size == task.VOCAB_SIZE == MANIFEST["tokenizer"]["vocab_size"]
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (task.PAD_ID, task.BOS_ID, task.EOS_ID) == (0, 1, 2)
    ids = tokenizer.encode(POSITIVE, add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and 0 not in ids
    assert tokenizer.decode(ids) == POSITIVE
    assert task.tiny_tokenizer().encode(NEGATIVE) == tokenizer.encode(NEGATIVE)


@pytest.mark.parametrize("folder", ["policy", "reward"])
def test_config_dims_match_module(folder, policy, reward):
    config = json.loads((ASSETS / folder / "config.json").read_text())
    model = policy if folder == "policy" else reward
    dims = task.POLICY_DIMS if folder == "policy" else task.REWARD_DIMS
    attn = model.layers[0].attn
    got = {
        "hidden_size": model.tok_embeddings.embedding_dim,
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate_size": model.layers[0].mlp.w1.out_features,
        "vocab_size": model.tok_embeddings.num_embeddings,
        "max_position_embeddings": model.max_seq_len,
    }
    assert {k: config[k] for k in got} == got
    assert got["hidden_size"] == dims["embed_dim"] and got["num_hidden_layers"] == dims["num_layers"]
    assert attn.num_kv_heads < attn.num_heads  # grouped-query attention
    assert config["torch_dtype"] == "float32"
    assert model.output.out_features == (1 if folder == "reward" else task.VOCAB_SIZE)


@pytest.mark.parametrize("folder,model_type", [("policy", "LLAMA2"), ("reward", "REWARD")])
def test_checkpointer_save_reproduces_committed_file(folder, model_type, tmp_path):
    """Loading and saving through the checkpointer gives back the committed tensors, so
    the q/k permutation and key names agree with torchtune's HF conversion both ways."""
    from safetensors.torch import load_file

    ckpt = _checkpointer(folder, model_type, tmp_path)
    ckpt.save_checkpoint(ckpt.load_checkpoint(), epoch=0)
    saved = load_file(str(tmp_path / "epoch_0" / "model-00001-of-00001.safetensors"))
    committed = load_file(str(ASSETS / folder / "model.safetensors"))
    assert saved.keys() == committed.keys()
    for k in committed:
        assert torch.equal(saved[k], committed[k]), k


def test_policy_has_learned_the_corpus(policy, tokenizer):
    """Per-token loss on fresh reviews is far below a random model's ~ln(512) = 6.2;
    wrong key names or a q/k permutation mismatch would break this."""
    import random

    reviews = build.make_reviews(random.Random(12345), 64)
    tokens = build.padded_batch([tokenizer.encode(t) for t, _ in reviews], right=True)
    labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == 0, -100)
    with torch.no_grad():
        logits = policy(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    assert loss.item() < 1.5


def test_reward_orders_sentiment(reward, tokenizer):
    seqs = [tokenizer.encode(t, add_bos=True, add_eos=eos) for t in (POSITIVE, NEGATIVE) for eos in (True, False)]
    with torch.no_grad():
        pos_eos, pos, neg_eos, neg = build.score_reviews(reward, seqs).tolist()
    assert pos_eos > 2.0 and pos > 2.0
    assert neg_eos < -2.0 and neg < -2.0


def test_reward_invariant_to_left_padding(reward, tokenizer):
    texts = [POSITIVE, NEGATIVE, "honestly the acting was", "i think this film let me down"]
    seqs = [tokenizer.encode(t, add_bos=True, add_eos=i % 2 == 0) for i, t in enumerate(texts)]
    with torch.no_grad():
        base = build.score_reviews(reward, seqs)
        alone = torch.cat([build.score_reviews(reward, [s]) for s in seqs])
        for pad in (1, 5, 17):
            assert (build.score_reviews(reward, seqs, left_pad=pad) - base).abs().max().item() < 1e-5
    assert (alone - base).abs().max().item() < 1e-5


def test_reward_reads_last_real_token_before_right_padding(reward, tokenizer):
    """Responses cut after EOS are right-padded; the score must ignore that padding."""
    seq = tokenizer.encode(POSITIVE, add_bos=True, add_eos=True)
    tokens = torch.tensor([[0, 0] + seq + [0, 0, 0]])
    with torch.no_grad():
        padded = build.last_token_scores(reward, tokens, tokens != 0)
        plain = build.score_reviews(reward, [seq])
    assert (padded - plain).abs().item() < 1e-5


def test_prompts_load_through_text_completion_dataset(tokenizer):
    ds = text_completion_dataset(
        tokenizer, source="json", data_files=str(ASSETS / "prompts.json"),
        column="prompt", split="train", add_eos=False,
    )
    records = json.loads((ASSETS / "prompts.json").read_text())
    assert len(ds) == len(records) == MANIFEST["corpus"]["prompts"] >= 200
    lengths = []
    for i in range(len(ds)):
        tokens = ds[i]["tokens"]
        assert tokens[0] == 1 and 2 not in tokens and 0 not in tokens
        lengths.append(len(tokens))
    assert tokenizer.decode(ds[0]["tokens"]) == records[0]["prompt"]
    assert max(lengths) <= build.MAX_PROMPT_LEN
    # Openings carry no sentiment words: the continuation decides.
    assert all(build.word_sentiment(r["prompt"]) == 0 for r in records)


def test_sampler_pads_after_first_eos(policy, tokenizer):
    prompts = ["honestly the acting was", "i think this film", "so the movie", "we"]
    query, response, valid = build.sample_reviews(policy, tokenizer, prompts, seed=0, max_generated_tokens=12)
    assert query.shape[0] == response.shape[0] == len(prompts) and response.shape == valid.shape
    for row, ok in zip(response.tolist(), valid.tolist()):
        end = row.index(task.EOS_ID) + 1 if task.EOS_ID in row else len(row)
        assert ok == [True] * end + [False] * (len(row) - end)  # the EOS itself is valid
        assert all(t == task.PAD_ID for t in row[end:])


def test_asset_names_resolve_to_the_task_folder():
    from omegaconf import OmegaConf

    assert ASSETS == build.ASSETS_DIR == Path(task.__file__).parent / "assets"
    assert Path(asset_path("tiny_sentiment/policy")) == ASSETS / "policy"
    cfg = OmegaConf.create({"path": "${ppo_asset:tiny_sentiment/tokenizer.model}"})
    assert cfg.path == str(ASSETS / "tokenizer.model")
    # A wrong name says what is shipped.
    with pytest.raises(FileNotFoundError, match="policy/model.safetensors"):
        asset_path("tiny_sentiment/nope.model")
    with pytest.raises(FileNotFoundError, match="tiny_sentiment"):
        asset_path("no_such_task/tokenizer.model")


def test_runtime_package_does_not_import_the_build_tools():
    """Configs import the task package; corpus, training and export code stay out of it."""
    import subprocess

    code = ("import json, sys, torchtune_ppo.tasks.tiny_sentiment; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('torchtune_ppo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["torchtune_ppo", "torchtune_ppo.tasks", "torchtune_ppo.tasks.tiny_sentiment"]


def test_build_tools_are_not_shipped():
    """The asset builders live in tools/tasks/; the installed package holds builders and assets."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    assert not list((root / "torchtune_ppo" / "tasks").glob("*/build.py"))
    setuptools_cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = setuptools_cfg["packages"]
    if isinstance(packages, dict):  # [tool.setuptools.packages.find]
        packages = find_packages(where=str(root / packages["find"]["where"][0]), include=packages["find"]["include"])
    assert "torchtune_ppo.tasks.tiny_sentiment" in packages
    assert all(p == "torchtune_ppo" or p.startswith("torchtune_ppo.") for p in packages), packages
    assert not [d for d in setuptools_cfg.get("package-dir", {}).values() if d.startswith("tools")]
