"""Llama-3.x, Qwen2.5 and Mistral policies and reward / value models against transformers.

Tiny random models of each family are built with transformers and saved with
``save_pretrained`` (real config.json + safetensors), loaded through torchtune's or our
checkpointer into torchtune builds of the same dims, and compared in fp32 on left-padded
batches: policy logits, reward scores, greedy generation, and checkpoints saved back.
Then each real-model config under recipes/configs/{llama3_2,qwen2_5,mistral} is validated
against stand-ins of its downloads and runs two PPO steps with its models at tiny dims.
transformers is a test-only dependency (the ``dev`` extra).
"""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config, training
from torchtune.training import FullModelHFCheckpointer

from hf_families import EOS_ID, FAMILIES, PAD_ID, Family, left_padded, padding_inputs
from hf_standins import CONFIGS, STANDINS, StandIn, prompts_file
from torchtune_ppo.config import validate_config, validate_with_tokenizer
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.run.logs import read_disk_log
from torchtune_ppo.models import ClassifierHFCheckpointer, value_head_from_policy

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
LENGTHS = [12, 7, 3, 12]  # real prompt lengths; rows are left-padded to WIDTH
WIDTH = 12
GEN_TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family(request, tmp_path_factory):
    """The family, its HF policy and reward model, and the folders they were saved to."""
    fam: Family = request.param
    root = tmp_path_factory.mktemp(fam.name)
    policy, reward = fam.hf_causal(seed=0), fam.hf_classifier(seed=1)
    policy.save_pretrained(root / "policy")
    reward.save_pretrained(root / "reward")
    return fam, policy, reward, root


def _load(checkpointer_cls, folder, model_type, out, **kwargs):
    ckpt = checkpointer_cls(
        checkpoint_dir=str(folder), checkpoint_files=["model.safetensors"], model_type=model_type,
        output_dir=str(out), **kwargs,
    )
    return ckpt, ckpt.load_checkpoint()[training.MODEL_KEY]


def _tt_policy(fam, root, tmp_path):
    ckpt, sd = _load(FullModelHFCheckpointer, root / "policy", fam.model_type, tmp_path / "p")
    model = fam.policy()
    model.load_state_dict(sd)
    return ckpt, model.eval()


def _tt_classifier(fam, folder, tmp_path, **kwargs):
    ckpt, sd = _load(ClassifierHFCheckpointer, folder, fam.model_type, tmp_path / "c", **kwargs)
    model = fam.classifier()
    model.load_state_dict(sd)
    return ckpt, model.eval()


def _inputs():
    tokens = left_padded(LENGTHS, WIDTH)
    not_pad, mask, pos, attention_mask, position_ids = padding_inputs(LENGTHS, WIDTH)
    return tokens, not_pad, mask, pos, attention_mask, position_ids


@torch.no_grad()
def _tt_scores(model, tokens, mask, pos):
    return model(tokens, mask=mask, input_pos=pos)[:, -1, 0]  # [b], left padding: last column


@torch.no_grad()
def _hf_scores(model, tokens, attention_mask, position_ids):
    return model(tokens, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0]


def test_rope_frequencies_match(family, tmp_path):
    """Llama-3 RoPE scaling (factor 32 / 8), Qwen's and Mistral's theta: the same frequencies."""
    fam, policy, _, root = family
    _, model = _tt_policy(fam, root, tmp_path)
    ours = model.layers[0].attn.pos_embeddings.theta
    theirs = policy.model.rotary_emb.inv_freq
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-6, atol=0)


def test_policy_logits_match_on_left_padded_batch(family, tmp_path):
    fam, policy, _, root = family
    _, model = _tt_policy(fam, root, tmp_path)
    tokens, not_pad, mask, pos, attention_mask, position_ids = _inputs()
    with torch.no_grad():
        ours = model(tokens, mask=mask, input_pos=pos)
        theirs = policy(tokens, attention_mask=attention_mask, position_ids=position_ids).logits
    diff = (ours - theirs)[not_pad].abs().max().item()  # padded positions mean nothing
    print(f"{fam.name} policy logits max abs diff {diff:.2e}")
    assert diff < ATOL
    assert theirs[not_pad].abs().max() > 0.1  # the comparison is not between near-zeros


def test_reward_scores_match_on_left_padded_batch(family, tmp_path):
    fam, _, reward, root = family
    _, model = _tt_classifier(fam, root / "reward", tmp_path)
    tokens, _, mask, pos, attention_mask, position_ids = _inputs()
    ours = _tt_scores(model, tokens, mask, pos)
    theirs = _hf_scores(reward, tokens, attention_mask, position_ids)
    diff = (ours - theirs).abs().max().item()
    print(f"{fam.name} reward scores max abs diff {diff:.2e}")
    assert diff < ATOL
    assert theirs.abs().max() > 0.1
    assert isinstance(model.output, torch.nn.Linear) and model.output.weight.shape == (1, 64)
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()


def test_greedy_generation_matches_transformers(family, tmp_path):
    fam, policy, _, root = family
    _, model = _tt_policy(fam, root, tmp_path)
    tokens, _, _, _, attention_mask, _ = _inputs()
    generator = Generator(
        model, batch_size=len(LENGTHS), max_prompt_len=WIDTH, max_generated_tokens=GEN_TOKENS,
        pad_id=PAD_ID, stop_token_ids=[EOS_ID], top_k=1,
    )
    ours = generator.generate(tokens, torch.tensor(LENGTHS)).query_responses
    with torch.no_grad():
        theirs = policy.generate(
            tokens, attention_mask=attention_mask, do_sample=False, max_new_tokens=GEN_TOKENS,
            pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        )
    # transformers stops once every row has ended; the rest of our rows is padding.
    assert (theirs[:, WIDTH:] != PAD_ID).sum() >= 2 * len(LENGTHS)  # tokens were generated
    assert torch.equal(ours[:, : theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1]:] == PAD_ID).all()


def test_saved_policy_loads_in_transformers(family, tmp_path):
    fam, policy, _, root = family
    ckpt, model = _tt_policy(fam, root, tmp_path)
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)
    reloaded = getattr(transformers, fam.causal_cls).from_pretrained(tmp_path / "p" / "epoch_0").eval()
    tokens, not_pad, _, _, attention_mask, position_ids = _inputs()
    with torch.no_grad():
        before = policy(tokens, attention_mask=attention_mask, position_ids=position_ids).logits
        after = reloaded(tokens, attention_mask=attention_mask, position_ids=position_ids).logits
    diff = (before - after)[not_pad].abs().max().item()
    print(f"{fam.name} saved policy, logits in transformers: max abs diff {diff:.2e}")
    assert diff < ATOL


def test_saved_classifier_loads_in_transformers(family, tmp_path):
    fam, _, reward, root = family
    ckpt, model = _tt_classifier(fam, root / "reward", tmp_path)
    with torch.no_grad():
        model.output.weight.add_(0.25)  # a trained head: the saved one must be ours, not the source's
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=3)
    out = tmp_path / "c" / "epoch_3"
    assert "score.weight" in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(reloaded).__name__ == fam.classifier_cls and reloaded.config.num_labels == 1
    tokens, _, mask, pos, attention_mask, position_ids = _inputs()
    diff = (_hf_scores(reloaded, tokens, attention_mask, position_ids) - _tt_scores(model, tokens, mask, pos))
    print(f"{fam.name} saved classifier, scores in transformers: max abs diff {diff.abs().max():.2e}")
    assert diff.abs().max().item() < ATOL


def test_value_model_from_policy_checkpoint(family, tmp_path):
    """A policy checkpoint (tied or not) loads as a classifier: its backbone, a zero head."""
    fam, policy, _, root = family
    with pytest.raises(ValueError, match="value_head_init"):
        _tt_classifier(fam, root / "policy", tmp_path / "no_init")
    ckpt, model = _tt_classifier(fam, root / "policy", tmp_path, value_head_init="zeros")
    tokens, _, mask, pos, attention_mask, position_ids = _inputs()
    assert torch.equal(_tt_scores(model, tokens, mask, pos), torch.zeros(len(LENGTHS)))

    # The backbone is the policy's: with any head, scores are the policy's last hidden states @ head.
    head = torch.randn(1, 64)
    with torch.no_grad():
        model.output.weight.copy_(head)
        hidden = policy.model(tokens, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    diff = (_tt_scores(model, tokens, mask, pos) - hidden[:, -1] @ head[0]).abs().max().item()
    print(f"{fam.name} value model from policy, backbone: max abs diff {diff:.2e}")
    assert diff < ATOL

    # Saved, it is a *ForSequenceClassification checkpoint with this head and no LM head.
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=1)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "c" / "epoch_1").eval()
    assert type(reloaded).__name__ == fam.classifier_cls and reloaded.config.num_labels == 1
    diff = _hf_scores(reloaded, tokens, attention_mask, position_ids) - _tt_scores(model, tokens, mask, pos)
    assert diff.abs().max().item() < ATOL
    # Resuming reads the saved value model with the same settings: its trained head, not zeros.
    resumed = ClassifierHFCheckpointer(
        checkpoint_dir=str(tmp_path / "c" / "epoch_1"), checkpoint_files=["model-00001-of-00001.safetensors"],
        model_type=fam.model_type, output_dir=str(tmp_path / "resumed"), value_head_init="zeros",
    ).load_checkpoint()[training.MODEL_KEY]
    assert torch.equal(resumed["output.weight"], head)


def test_torchtune_reward_type_reads_llama_style_but_not_qwen2(family, tmp_path):
    """What torchtune alone can do: ``model_type: REWARD`` is right for Llama/Mistral keys;
    Qwen2's conversion has no ``score.weight`` (REWARD would also permute q/k wrongly)."""
    fam, _, _, root = family
    _, ours = _load(ClassifierHFCheckpointer, root / "reward", fam.model_type, tmp_path / "ours")
    if fam.model_type == "QWEN2":
        with pytest.raises(Exception, match="score.weight"):
            _load(FullModelHFCheckpointer, root / "reward", "QWEN2", tmp_path / "tt")
        return
    _, theirs = _load(FullModelHFCheckpointer, root / "reward", "REWARD", tmp_path / "tt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# ---------------------------------------------------------------------------- edge cases


def test_value_head_from_policy_state_dict():
    sd = {"tok_embeddings.weight": torch.randn(10, 8, dtype=torch.bfloat16), "output.weight": torch.randn(10, 8)}
    zeros = value_head_from_policy(sd)
    assert zeros["output.weight"].shape == (1, 8) and zeros["output.weight"].dtype == torch.bfloat16
    assert not zeros["output.weight"].any() and zeros["tok_embeddings.weight"] is sd["tok_embeddings.weight"]
    normal = value_head_from_policy(sd, init="normal")["output.weight"].float()
    assert 0 < normal.abs().max() < 1.0
    with pytest.raises(ValueError, match="init must be one of"):
        value_head_from_policy(sd, init="xavier")


def test_checkpointer_rejects_bad_settings_and_nonzero_bias(tmp_path):
    fam = FAMILIES[0]
    reward = fam.hf_classifier(seed=3)
    reward.save_pretrained(tmp_path / "reward")
    with pytest.raises(ValueError, match="model_type must be the backbone's family"):
        _load(ClassifierHFCheckpointer, tmp_path / "reward", "REWARD", tmp_path / "o1")
    with pytest.raises(ValueError, match="value_head_init must be null or one of"):
        _load(ClassifierHFCheckpointer, tmp_path / "reward", fam.model_type, tmp_path / "o2", value_head_init="ones")

    # A zero score.bias (some trainers write one) is dropped; a non-zero one would be lost: refused.
    from safetensors.torch import load_file, save_file

    path = tmp_path / "reward" / "model.safetensors"
    weights = load_file(path)
    save_file({**weights, "score.bias": torch.zeros(1)}, path)
    _load(ClassifierHFCheckpointer, tmp_path / "reward", fam.model_type, tmp_path / "o3")
    save_file({**weights, "score.bias": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="score.bias is non-zero"):
        _load(ClassifierHFCheckpointer, tmp_path / "reward", fam.model_type, tmp_path / "o4")


# ---------------------------------------------------------------------------- real-model configs

TUNE = [sys.executable, "-m", "torchtune._cli.tune"]
RUN_2_STEPS = [
    "device=cpu", "dtype=fp32", "compile=False", "num_ppo_steps=2", "batch_size=4",
    "forward_batch_size=2", "ppo_batch_size=2", "gradient_accumulation_steps=1",
    "max_generated_tokens=8", "min_response_length=4", "save_every_n_steps=null",
    "log_peak_memory_stats=False",
]


@pytest.fixture(scope="module", params=STANDINS, ids=lambda s: s.config)
def standin(request, tmp_path_factory):
    """A config, its downloads built at tiny dims, and the overrides that point it at them."""
    spec: StandIn = request.param
    root = tmp_path_factory.mktemp(spec.config.replace("/", "_"))
    paths = spec.build(root)
    return spec, [f"{k}={v}" for k, v in paths.items()], root


def test_config_validates_with_its_builders(standin):
    """The config as written (full-size builders, on the meta device) against the stand-in files."""
    spec, paths, _ = standin
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / spec.config), OmegaConf.from_dotlist([*paths, "device=cpu"]))
    optimizer = cfg.optimizer._component_
    if importlib.util.find_spec(optimizer.split(".")[0]) is None:  # bitsandbytes: a GPU config's optimizer
        with pytest.raises(ValueError, match=r"optimizer\._component_.*no module named"):
            validate_config(cfg)  # a run here is refused by the key, before any model loads
        cfg.optimizer._component_ = "torch.optim.AdamW"
    cfg = validate_config(cfg)
    tokenizer = config.instantiate(cfg.tokenizer)
    validate_with_tokenizer(cfg, tokenizer)
    assert tokenizer.encode("the movie was", add_bos=False, add_eos=False)  # the stand-in tokenizes


def _run_overrides(spec: StandIn, paths, root, out):
    prompts = prompts_file(root / "prompts.json")
    return [
        f"output_dir={out}", *paths, *spec.tiny_models, *spec.extra, *RUN_2_STEPS,
        "dataset.source=json", f"dataset.data_files={prompts}",
    ]


def _check_run(out):
    rows = read_disk_log(out / "logs")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    value = out / "checkpoints" / "step_2" / "value"
    saved = json.loads((value / "config.json").read_text())
    assert saved["architectures"][0].endswith("ForSequenceClassification")
    assert saved["id2label"] == {"0": "LABEL_0"}


@pytest.mark.slow
def test_config_runs_two_steps(standin, tmp_path):
    """Two PPO steps of the config with its models at tiny dims; in-process, as recipe_main does."""
    import ppo_full_finetune

    spec, paths, root = standin
    out = tmp_path / "run"
    overrides = _run_overrides(spec, paths, root, out)
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / spec.config), OmegaConf.from_dotlist(overrides))
    cfg = validate_config(cfg)
    recipe = ppo_full_finetune.PPOFullFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()
    _check_run(out)


@pytest.mark.slow
def test_config_runs_through_tune_run(tmp_path_factory, tmp_path):
    """The command a config's header gives, with path and size overrides (one config: the
    others differ only in what the in-process runs cover)."""
    spec = next(s for s in STANDINS if s.config == "qwen2_5/0.5B_ppo.yaml")
    root = tmp_path_factory.mktemp("tune_run")
    paths = [f"{k}={v}" for k, v in spec.build(root).items()]
    out = tmp_path / "run"
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(CONFIGS / spec.config),
           *_run_overrides(spec, paths, root, out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    _check_run(out)


@pytest.mark.slow
def test_torchtunes_own_ppo_config_runs(tmp_path_factory, tmp_path, caplog):
    """torchtune 0.6.1's mistral/7B_full_ppo_low_memory.yaml, with only model paths, tokenizer,
    device and data changed (models at tiny dims, AdamW for bitsandbytes' PagedAdamW): it
    trains on as many prompts as torchtune's recipe would, and says nothing but notes."""
    import logging

    from pathlib import Path

    import torchtune

    import ppo_full_finetune

    theirs = Path(torchtune.__file__).parents[1] / "recipes/configs/mistral/7B_full_ppo_low_memory.yaml"
    spec = next(s for s in STANDINS if s.config == "mistral/7B_ppo_low_memory.yaml")
    root = tmp_path_factory.mktemp("torchtune_mistral")
    paths = [f"{k}={v}" for k, v in spec.build(root).items()]
    prompts = prompts_file(root / "prompts.json")
    changed = [*paths, *spec.tiny_models, *spec.extra, "device=cpu", "dataset.source=json",
               f"dataset.data_files={prompts}", f"output_dir={tmp_path / 'run'}"]
    as_given = validate_config(OmegaConf.merge(OmegaConf.load(theirs), OmegaConf.from_dotlist(changed)))
    assert as_given.num_ppo_steps == 10000 // 128  # torchtune: num_steps // batch_size

    # The same config run for two steps of 4 prompts (num_steps still counts prompts).
    small = ["batch_size=4", "forward_batch_size=2", "ppo_batch_size=2", "num_steps=8",
             "dtype=fp32", "compile=False", "max_generated_tokens=8", "min_response_length=4"]
    from torchtune_ppo.config import notes

    notes.NOTED.clear()  # notes are said once per process; earlier tests may have said them
    with caplog.at_level(logging.INFO):
        cfg = validate_config(OmegaConf.merge(OmegaConf.load(theirs), OmegaConf.from_dotlist(changed + small)))
        recipe = ppo_full_finetune.PPOFullFinetuneRecipe(cfg=cfg)
        recipe.setup(cfg=cfg)
        recipe.train()
        recipe.cleanup()
    assert cfg.num_ppo_steps == 2
    ours = [r for r in caplog.records if r.name.startswith("torchtune") and r.pathname.find("torchtune_ppo") >= 0
            or r.pathname.endswith("ppo_full_finetune.py")]
    assert not [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
    notes = [r.getMessage() for r in ours if r.getMessage().startswith("Note:")]
    assert any("num_steps=8 counts prompts" in n for n in notes)
    assert any("enable_kv_cache" in n for n in notes)
    rows = read_disk_log(tmp_path / "run" / "logs")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
