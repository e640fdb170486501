"""The tiny_arithmetic task: its shipped assets (integrity, torchtune's own loaders take them),
the policy's documented accuracy, the value model's start from the policy, and its config."""

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.models.llama2 import llama2_tokenizer
from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

import torchtune_ppo.tasks.tiny_arithmetic as task
from torchtune_ppo import asset_path
from torchtune_ppo.data.datasets import collate_references, prompt_dataset
from torchtune_ppo.rewards import ExactMatch, FunctionReward

# The asset builder is a build tool in the repository, not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "tasks"))
import build_tiny_arithmetic as build  # noqa: E402

ASSETS = Path(asset_path("tiny_arithmetic"))
MANIFEST = json.loads((ASSETS / "MANIFEST.json").read_text())
CONFIG = Path(__file__).parents[2] / "recipes" / "configs" / "tiny" / "ppo_tiny_arithmetic.yaml"
# Documented in assets/README.md: held-out greedy accuracy of the shipped policy.
GREEDY_RANGE = (0.25, 0.40)


@pytest.fixture(scope="module")
def tokenizer():
    return llama2_tokenizer(str(ASSETS / "tokenizer.model"))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(ASSETS / "policy"), checkpoint_files=["model.safetensors"],
        model_type="LLAMA2", output_dir=str(tmp_path_factory.mktemp("policy_out")),
    )
    model = task.tiny_policy()
    model.load_state_dict(ckpt.load_checkpoint()[MODEL_KEY], strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def splits():
    return build.load_splits(ASSETS)


def test_files_match_manifest():
    expected = {"tokenizer.model", "problems.json", "README.md", "policy/config.json", "policy/model.safetensors"}
    assert set(MANIFEST["files"]) == expected
    for name, sha in MANIFEST["files"].items():
        assert hashlib.sha256((ASSETS / name).read_bytes()).hexdigest() == sha, name
    assert MANIFEST["builder_version"] == build.BUILDER_VERSION
    assert sum((ASSETS / f).stat().st_size for f in expected) < 2_000_000


def test_tokenizer_round_trips_every_problem(tokenizer):
    assert tokenizer.vocab_size == task.VOCAB_SIZE == MANIFEST["tokenizer"]["vocab_size"]
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (task.PAD_ID, task.BOS_ID, task.EOS_ID) == (0, 1, 2)
    for prompt, answer in build.problems():
        p = tokenizer.encode(prompt, add_bos=True, add_eos=False)
        a = tokenizer.encode(answer, add_bos=False, add_eos=True)
        # Continuing a prompt token by token gives the same ids as encoding the whole text.
        assert p + a == tokenizer.encode(prompt + answer, add_bos=True, add_eos=True)
        assert tokenizer.decode(p) == prompt and tokenizer.decode(a) == answer
        assert task.PAD_ID not in p + a
        assert len(p) <= build.MAX_PROMPT_LEN and len(a) <= build.MAX_GENERATED_TOKENS
    assert task.tiny_tokenizer().encode("12+7=") == tokenizer.encode("12+7=")


def test_config_json_matches_module(policy):
    cfg = json.loads((ASSETS / "policy" / "config.json").read_text())
    attn = policy.layers[0].attn
    got = {
        "hidden_size": policy.tok_embeddings.embedding_dim,
        "num_hidden_layers": len(policy.layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "intermediate_size": policy.layers[0].mlp.w1.out_features,
        "vocab_size": policy.tok_embeddings.num_embeddings,
        "max_position_embeddings": policy.max_seq_len,
    }
    assert {k: cfg[k] for k in got} == got
    assert got["vocab_size"] == task.VOCAB_SIZE and cfg["torch_dtype"] == "float32"


def test_checkpointer_save_reproduces_committed_file(tmp_path):
    """Loading and saving through the checkpointer gives back the committed tensors, so the
    q/k permutation and key names agree with torchtune's HF conversion both ways."""
    from safetensors.torch import load_file

    ckpt = FullModelHFCheckpointer(checkpoint_dir=str(ASSETS / "policy"), checkpoint_files=["model.safetensors"],
                                   model_type="LLAMA2", output_dir=str(tmp_path))
    ckpt.save_checkpoint(ckpt.load_checkpoint(), epoch=0)
    saved = load_file(str(tmp_path / "epoch_0" / "model-00001-of-00001.safetensors"))
    committed = load_file(str(ASSETS / "policy" / "model.safetensors"))
    assert saved.keys() == committed.keys()
    assert all(torch.equal(saved[k], committed[k]) for k in committed)


def test_problem_splits(splits):
    assert {k: len(v) for k, v in splits.items()} == {"train": build.NUM_TRAIN, "heldout": build.NUM_HELDOUT}
    assert not {p for p, _ in splits["train"]} & {p for p, _ in splits["heldout"]}
    expected = dict(build.problems())
    assert all(expected[p] == a for p, a in splits["train"] + splits["heldout"])
    # The shipped splits are the builder's: pretraining never saw them.
    rebuilt = build.split_problems(MANIFEST["seed"])
    assert rebuilt["train"] == splits["train"] and rebuilt["heldout"] == splits["heldout"]


def test_heldout_greedy_accuracy_in_documented_range(policy, tokenizer, splits):
    acc, eos_rate, _ = build.accuracy(policy, tokenizer, splits["heldout"])
    assert GREEDY_RANGE[0] <= acc <= GREEDY_RANGE[1], acc
    # The recorded number, up to a few argmax flips on other hardware.
    assert abs(acc - MANIFEST["sanity"]["heldout_greedy_accuracy"]) <= 0.02
    assert eos_rate >= 0.99  # answers end with EOS


def test_greedy_decoding_matches_torchtune_generate(policy, tokenizer, splits):
    """build.complete (no KV cache, padding by mask) agrees with torchtune's cached generate."""
    from torchtune.generation import generate
    from torchtune.modules.common_utils import delete_kv_caches

    prompts = [tokenizer.encode(p, add_bos=True, add_eos=False) for p, _ in splits["heldout"][:16]]
    ours = build.complete(policy, prompts)
    query = build.padded_batch(prompts)
    T = build.MAX_GENERATED_TOKENS
    policy.setup_caches(batch_size=len(prompts), dtype=torch.float32, decoder_max_seq_len=query.shape[1] + T)
    try:
        out, _ = generate(policy, query, max_generated_tokens=T, pad_id=task.PAD_ID, top_k=1,
                          stop_tokens=[task.EOS_ID], rng=torch.Generator().manual_seed(0))
    finally:
        delete_kv_caches(policy)
    for (tokens, ended), row in zip(ours, out[:, query.shape[1]:].tolist()):
        assert ended and row[: len(tokens) + 1] == tokens + [task.EOS_ID]


def test_prompt_dataset_reads_both_splits(tokenizer, splits):
    for field in ("train", "heldout"):
        ds = prompt_dataset(tokenizer, "json", data_files=str(ASSETS / "problems.json"), field=field)
        assert len(ds) == len(splits[field])
        samples = [ds[i] for i in range(0, len(ds), 97)]
        for sample, i in zip(samples, range(0, len(ds), 97)):
            prompt, answer = splits[field][i]
            assert sample["tokens"][0] == task.BOS_ID and task.EOS_ID not in sample["tokens"]
            assert tokenizer.decode(sample["tokens"]) == prompt and sample["reference"] == answer
        assert collate_references(samples[:3]) == [s["reference"] for s in samples[:3]]


def test_value_model_starts_from_the_policy(policy, tmp_path):
    models = pytest.importorskip("torchtune_ppo.models", reason="value-from-policy checkpointer")
    ckpt = models.ClassifierHFCheckpointer(
        checkpoint_dir=str(ASSETS / "policy"), checkpoint_files=["model.safetensors"],
        model_type="LLAMA2", output_dir=str(tmp_path), value_head_init="zeros",
    )
    value = task.tiny_value()
    value.load_state_dict(ckpt.load_checkpoint()[MODEL_KEY], strict=True)
    assert value.output.weight.shape == (1, task.POLICY_DIMS["embed_dim"])
    assert torch.equal(value.tok_embeddings.weight, policy.tok_embeddings.weight)
    with torch.no_grad():
        assert torch.equal(value(torch.tensor([[1, 4, 6, 14, 11, 3]])), torch.zeros(1, 6, 1))


def test_config_builds_the_task(tokenizer, splits):
    """The config's tokenizer, dataset and reward agree with the assets: the reference
    answers score 1 and wrong answers 0 through FunctionReward."""
    cfg = OmegaConf.load(CONFIG)
    cfg.output_dir = "/tmp/unused"
    tok = config.instantiate(cfg.tokenizer)
    ds = config.instantiate(cfg.dataset, tokenizer=tok)
    reward = config.instantiate(cfg.reward)
    assert isinstance(reward, ExactMatch) and len(ds) == build.NUM_TRAIN
    samples = [ds[i] for i in range(8)]
    answers = [tok.encode(s["reference"], add_bos=False, add_eos=False) for s in samples]
    wrong = [tok.encode(str(int(s["reference"]) + 1), add_bos=False, add_eos=False) for s in samples]
    fr = FunctionReward(reward, tok)
    prompts, refs = [s["tokens"] for s in samples], collate_references(samples)
    assert fr(prompts, answers, refs).tolist() == [1.0] * 8
    assert fr(prompts, wrong, refs).tolist() == [0.0] * 8
    assert cfg.max_prompt_len >= MANIFEST["sanity"]["prompt_tokens_max"]
    assert cfg.max_generated_tokens >= MANIFEST["sanity"]["answer_tokens_max"]
    assert list(cfg.stop_token_ids) == [task.EOS_ID]


def test_runtime_package_does_not_import_the_build_tools():
    """Configs import the task package; problem generation, training and export stay out of it."""
    import subprocess

    code = ("import json, sys, torchtune_ppo.tasks.tiny_arithmetic; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('torchtune_ppo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["torchtune_ppo", "torchtune_ppo.tasks", "torchtune_ppo.tasks.tiny_arithmetic"]
