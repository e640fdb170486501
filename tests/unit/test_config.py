"""A bad config stops in validation, before any weights are read, with a message naming the key."""

import dataclasses
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.config import (
    SCHEMA,
    CompileConfig,
    check_cli_overrides,
    check_compile_mode,
    check_device,
    check_sampling,
    instantiate_dataset,
    markdown_table,
    parse_compile,
    validate_config,
    validate_dataset,
    validate_with_tokenizer,
)

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"


def _cfg(**overrides):
    cfg = OmegaConf.load(CONFIG)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def test_shipped_config_is_valid():
    cfg = validate_config(_cfg())
    assert cfg.batch_size == 32 and cfg.ppo_epochs == 2


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"forward_batch_size": 12}, r"batch_size \(32\) must be divisible by forward_batch_size \(12\)"),
        ({"ppo_batch_size": 10}, r"batch_size \(32\) must be divisible by ppo_batch_size \(10\)"),
        (
            {"gradient_accumulation_steps": 3},
            r"ppo_batch_size \(16\) must be divisible by gradient_accumulation_steps \(3\)",
        ),
        ({"max_generated_tokens": 500}, r"max_prompt_len \+ max_generated_tokens .*exceeds policy_model's max_seq_len"),
        ({"stop_token_ids": "[]"}, r"stop_token_ids must be a non-empty list"),
        ({"stop_token_ids": "null"}, r"stop_token_ids must be a non-empty list"),
        ({"batch_size": 0}, r"batch_size must be a positive integer, got 0"),
        ({"temperature": 0}, r"temperature must be a number > 0"),
        ({"top_p": 1.5}, r"top_p must be null or a number in \(0, 1\]"),
        ({"long_prompts": "drop"}, r"long_prompts must be one of \['truncate', 'error'\]"),
        ({"compile.generate": True, "compile.decode": True}, r"compile: unknown key\(s\) \['decode'\]; valid keys are \['generate', 'trajectory', 'loss_step', 'rollout', 'optimizer', 'layers', 'mode'\]"),
        ({"btach_size": 4}, r"unknown config key\(s\) \['btach_size'\]"),
    ],
)
def test_bad_values_name_the_key(overrides, pattern):
    cfg = _cfg(**{k: v for k, v in overrides.items() if not k.startswith("compile.")})
    if any(k.startswith("compile.") for k in overrides):
        cfg.compile = {k.split(".", 1)[1]: v for k, v in overrides.items()}
    with pytest.raises(ValueError, match=pattern):
        validate_config(cfg)


def test_missing_checkpoint_file_names_checkpointer_and_path(tmp_path):
    cfg = _cfg()
    cfg.value_checkpointer.checkpoint_files = ["missing.safetensors"]
    with pytest.raises(FileNotFoundError, match=r"value_checkpointer: checkpoint file .*missing.safetensors"):
        validate_config(cfg)


def test_missing_required_key():
    cfg = _cfg()
    del cfg["stop_token_ids"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['stop_token_ids'\]"):
        validate_config(cfg)


def test_compile_bare_bool_and_mapping():
    assert parse_compile(True) == CompileConfig(True, True, True, optimizer=True, layers=True)
    assert parse_compile(False) == CompileConfig(False, False, False)
    full = dict(generate=False, trajectory=False, loss_step=True, rollout=False)
    # the optimizer step, when not named, follows the loss step
    assert parse_compile(full) == CompileConfig(False, False, True, optimizer=True)
    assert parse_compile({**full, "optimizer": False}) == CompileConfig(False, False, True)
    assert parse_compile({**full, "loss_step": False, "optimizer": True}).optimizer
    with pytest.raises(ValueError, match=r"compile.optimizer must be true or false"):
        parse_compile({**full, "optimizer": "on"})
    assert parse_compile({**full, "mode": "reduce-overhead"}).mode == "reduce-overhead"
    with pytest.raises(ValueError, match=r"compile.mode must be one of"):
        parse_compile({**full, "mode": "fast"})
    with pytest.raises(ValueError, match=r"compile.trajectory must be true or false"):
        parse_compile({**full, "trajectory": "yes"})


# --- compile overrides ---------------------------------------------------------------------


def test_partial_compile_block_from_the_command_line_is_refused():
    # `compile=True compile.generate=False` over a YAML with a bare bool: OmegaConf keeps only
    # {generate: False}, which must not silently mean "only generation named, the rest off".
    cfg = _cfg()
    cfg.compile = True
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["compile=True", "compile.generate=False"]))
    assert OmegaConf.to_container(cfg.compile) == {"generate": False}
    with pytest.raises(ValueError) as info:
        validate_config(cfg)
    message = str(info.value)
    assert "compile: the block {generate: False}" in message
    assert "['trajectory', 'loss_step', 'rollout']" in message
    assert "compile={generate: False, trajectory: True, loss_step: True, rollout: False}" in message
    assert "compile=True|False" in message


def test_bool_and_dotted_compile_on_one_command_line_is_refused():
    # Over the tiny YAML's full block the merge is complete, so only the command line shows it.
    check_cli_overrides(["--config", "x.yaml", "compile=True", "num_ppo_steps=3"])
    check_cli_overrides(["compile.generate=False", "compile.trajectory=True"])
    with pytest.raises(ValueError) as info:
        check_cli_overrides(["--config", "x.yaml", "compile=True", "compile.generate=False"])
    assert "compile=True and compile.generate=False on one command line" in str(info.value)
    assert (
        "compile.generate=False compile.trajectory=True compile.loss_step=True "
        "compile.rollout=False" in str(info.value)
    )


# --- numbers and ranges --------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        ("kl_coeff", "'0.1x'", r"kl_coeff must be a number >= 0, got '0.1x' \(a string\)"),
        ("kl_coeff", -0.1, r"kl_coeff must be a number >= 0, got -0.1"),
        ("clip_grad_norm", True, r"clip_grad_norm must be null or a number > 0, got True \(a bool\)"),
        ("clip_grad_norm", 0, r"clip_grad_norm must be null or a number > 0, got 0"),
        ("reward_penalty", "low", r"reward_penalty must be a number .*got 'low'"),
        ("temperature", "hot", r"temperature must be a number > 0.*got 'hot'"),
        ("temperature", True, r"temperature must be a number > 0.*got True \(a bool\)"),
        ("gamma", 1.5, r"gamma must be a number in \[0, 1\], got 1.5"),
        ("gamma", ".nan", r"gamma must be a number in \[0, 1\], got nan"),
        ("lmbda", -0.1, r"lmbda must be a number in \[0, 1\], got -0.1"),
        ("loss.epsilon", 0, r"loss.epsilon must be a number > 0 .*got 0"),
        ("loss.epsilon", "'0.1x'", r"loss.epsilon must be a number > 0 .*got '0.1x' \(a string\)"),
        ("loss.value_clip_range", -1, r"loss.value_clip_range must be a number > 0, got -1"),
        # 0 is no off switch: the clipped value is the old one, so the value model cannot learn.
        (
            "loss.value_clip_range", 0,
            r"loss.value_clip_range must be a number > 0, got 0\. Each new value is clipped to "
            r"within value_clip_range of its old value: with 0 the value model can never improve "
            r"on its old values, .*1e6",
        ),
        ("loss.value_coeff", -0.5, r"loss.value_coeff must be a number >= 0, got -0.5"),
        ("min_response_length", 25, r"min_response_length \(25\) must not exceed max_generated_tokens \(24\)"),
        ("top_k", True, r"top_k must be null or an integer >= 1, got True \(a bool\)"),
        ("shuffle", "'False'", r"shuffle must be true or false, got 'False' \(a string\)"),
    ],
)
def test_numbers_must_be_numbers_in_range(key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_config(_cfg(**{key: value}))


@pytest.mark.parametrize(
    "key, accepted, refused",
    [
        ("loss.epsilon", [0.001, 1.0], [0, -0.1]),
        ("loss.value_clip_range", [0.001, 1e6], [0, 0.0, -1, math.inf]),
        ("loss.value_coeff", [0, 10.0], [-0.001]),
        ("kl_coeff", [0, 1.0], [-0.001]),
        ("gamma", [0, 1], [-0.001, 1.001]),
        ("lmbda", [0, 1], [-0.001, 1.001]),
        ("clip_grad_norm", [None, 0.001], [0, -1.0, math.inf]),
        ("temperature", [0.001], [0, -1.0, math.inf]),
        ("top_p", [0.001, 1], [0, 1.001]),
        ("top_k", [None, 1], [0]),
        ("reward_penalty", [-3.0, 0, 1.0], [math.nan, -math.inf]),
        ("seed", [None, 0, -1], [1.5]),
        ("min_response_length", [None, 1, 24], [0, 25]),
        ("max_prompt_len", [1, 12], [0]),
        ("ppo_epochs", [1], [0]),
        ("max_consecutive_skipped_steps", [1], [0]),
        ("cpu_threads", ["auto", 1], [0, "Auto"]),
    ],
)
def test_range_checks_hold_at_both_boundaries(key, accepted, refused):
    for value in accepted:
        cfg = _cfg()
        OmegaConf.update(cfg, key, value)
        validate_config(cfg)
    for value in refused:
        cfg = _cfg()
        OmegaConf.update(cfg, key, value)
        with pytest.raises(ValueError, match=rf"^{re.escape(key)} (\(\d+\) )?must "):
            validate_config(cfg)


def test_ints_are_fine_for_floats_and_null_clip_grad_norm():
    cfg = validate_config(_cfg(gamma=1, lmbda=0, kl_coeff=0, clip_grad_norm="null", temperature=2))
    assert cfg.gamma == 1 and cfg.clip_grad_norm is None
    assert validate_config(_cfg(min_response_length=24)).min_response_length == 24


def test_loss_component_block_is_checked_without_instantiating_and_keeps_its_defaults():
    cfg = _cfg()
    cfg.loss = {"_component_": "torchtune.rlhf.loss.PPOLoss", "value_coeff": 0.5}
    loss = validate_config(cfg).loss
    # torchtune's PPOLoss defaults epsilon to 0.1: a torchtune config leaving it out means 0.1.
    assert (loss.epsilon, loss.value_clip_range, loss.value_coeff) == (0.1, 0.2, 0.5)
    cfg.loss = {"_component_": "torchtune.rlhf.loss.PPOLoss", "epsilon": -0.2}
    with pytest.raises(ValueError, match=r"loss.epsilon must be a number > 0 .*got -0.2"):
        validate_config(cfg)
    cfg.loss = {"_component_": "torchtune.rlhf.loss.PPOLoss", "epsilom": 0.2}
    pattern = r"loss: unknown key\(s\) \['epsilom'\] for torchtune.rlhf.loss.PPOLoss"
    with pytest.raises(ValueError, match=pattern):
        validate_config(cfg)
    cfg.loss = {"epsilom": 0.2}
    with pytest.raises(ValueError, match=r"loss: unknown key\(s\) \['epsilom'\]; valid keys are"):
        validate_config(cfg)


# --- one definition of the sampling and compile-mode checks --------------------------------


def test_sampling_and_compile_mode_checks_take_a_prefix():
    check_sampling(0.7, 50, 0.9)
    check_sampling(1, None, 1)
    with pytest.raises(ValueError, match=r"^Generator: temperature must be a number > 0 .*got 0\.$"):
        check_sampling(0, None, None, prefix="Generator: ")
    with pytest.raises(ValueError, match=r"^top_k must be null or an integer >= 1, got 0\.$"):
        check_sampling(1.0, 0, None)
    pattern = r"^sampling.top_p must be null or a number in \(0, 1\], got 0\.0\.$"
    with pytest.raises(ValueError, match=pattern):
        check_sampling(1.0, None, 0.0, prefix="sampling.")
    check_compile_mode("reduce-overhead")
    pattern = r"^Generator: compile_mode must be one of \['default', .*got 'fast'"
    with pytest.raises(ValueError, match=pattern):
        check_compile_mode("fast", key="Generator: compile_mode")


# --- device --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda_is_refused(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=rf"device is '{device}' but this machine has no cuda device"):
        validate_config(_cfg(device=device))


def test_cuda_index_beyond_the_visible_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    with pytest.raises(ValueError, match=r"device is 'cuda:2' but only 2 cuda device\(s\) are visible"):
        check_device("cuda:2")


def test_unavailable_mps_and_unknown_devices_are_refused(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device is 'mps' but this machine has no mps device"):
        validate_config(_cfg(device="mps"))
    for bad in ("gpu", "meta", "cuda:x"):
        with pytest.raises(ValueError, match=rf"device must be one of cpu, cuda, cuda:N, .*got '{bad}'"):
            check_device(bad)
    check_device("cpu")
    check_device(None)


# --- stop tokens ---------------------------------------------------------------------------


def test_stop_token_outside_the_policy_vocabulary_is_refused():
    # The tiny policy has 512 embeddings, read from a build on the meta device.
    validate_config(_cfg(stop_token_ids="[2,511]"))
    pattern = r"stop_token_ids \[512\] are outside policy_model's vocabulary \[0, 512\)"
    with pytest.raises(ValueError, match=pattern):
        validate_config(_cfg(stop_token_ids="[2,512]"))


def test_stop_token_equal_to_pad_id_is_refused():
    cfg = validate_config(_cfg())
    tokenizer = _tokenizer()
    validate_with_tokenizer(cfg, tokenizer)  # eos 2, pad 0
    cfg.stop_token_ids = [2, tokenizer.pad_id]
    with pytest.raises(ValueError, match=r"stop_token_ids \[2, 0\] contains 0, the tokenizer's pad_id"):
        validate_with_tokenizer(cfg, tokenizer)
    with pytest.raises(ValueError, match=r"has no integer pad_id"):
        validate_with_tokenizer(cfg, SimpleNamespace(pad_id=None))


# --- dataset -------------------------------------------------------------------------------


def _prompts(*lengths):
    return [{"tokens": list(range(1, n + 1))} for n in lengths]


def test_long_prompts_error_names_count_indices_limit_and_fix():
    cfg = validate_config(_cfg(batch_size=4, forward_batch_size=4, ppo_batch_size=4, long_prompts="error"))
    data = _prompts(3, 13, 12, 20, 1, 14, 15, 16, 17, 18)
    with pytest.raises(ValueError) as info:
        validate_dataset(data, cfg)
    message = str(info.value)
    assert "7 of 10 prompts are longer than max_prompt_len=12" in message
    assert "#1 (13 tokens), #3 (20 tokens), #5 (14 tokens), #6 (15 tokens), #7 (16 tokens), ..." in message
    assert "Raise max_prompt_len to 20" in message and "long_prompts=truncate" in message
    cfg.long_prompts = "truncate"
    assert validate_dataset(data, cfg) == 7
    assert validate_dataset(_prompts(*[12] * 4), cfg) == 0


def test_empty_prompt_and_small_dataset_are_refused():
    cfg = validate_config(_cfg(batch_size=4, forward_batch_size=4, ppo_batch_size=4))
    with pytest.raises(ValueError, match=r"dataset: prompt 2 has 0 tokens"):
        validate_dataset(_prompts(3, 4, 0, 5), cfg)
    with pytest.raises(ValueError, match=r"dataset has 3 prompts, fewer than batch_size \(4\)"):
        validate_dataset(_prompts(3, 4, 5), cfg)


def test_shipped_dataset_loads_and_fits(tmp_path):
    cfg = validate_config(_cfg())
    cfg.dataset.cache_dir = str(tmp_path / "hf")
    dataset = instantiate_dataset(cfg.dataset, _tokenizer())
    assert validate_dataset(dataset, cfg) == 0


@pytest.mark.parametrize(
    "name, text, position",
    [
        ("broken.json", '[\n{"prompt": "a"},\n{"prompt": "b",\n{"prompt": "c"}\n]\n', "line 4, column 1"),
        ("broken.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n', "line 2, column 15"),
    ],
)
def test_malformed_data_file_names_the_file_and_position(tmp_path, name, text, position):
    path = tmp_path / name
    path.write_text(text)
    cfg = _cfg()
    cfg.dataset.data_files = str(path)
    cfg.dataset.cache_dir = str(tmp_path / "hf")
    with pytest.raises(ValueError) as info:
        instantiate_dataset(cfg.dataset, _tokenizer())
    message = str(info.value)
    assert f"dataset.data_files: {str(path)!r} is not valid JSON: {position}" in message


def test_missing_column_names_it_and_lists_the_columns(tmp_path):
    cfg = _cfg()
    cfg.dataset.column = "text"
    cfg.dataset.cache_dir = str(tmp_path / "hf")
    pattern = r"dataset.column: 'text' is not a column of the data; its columns are \['prompt'\]"
    with pytest.raises(ValueError, match=pattern):
        instantiate_dataset(cfg.dataset, _tokenizer())
    del cfg.dataset["column"]  # text_completion_dataset's default is "text" as well
    with pytest.raises(ValueError, match=r"dataset.column \(default\): 'text' is not a column"):
        instantiate_dataset(cfg.dataset, _tokenizer())


# --- new keys ------------------------------------------------------------------------------


def test_new_keys_have_defaults_and_are_checked():
    base = _cfg()
    for key in ("max_consecutive_skipped_steps", "keep_last_n_checkpoints"):
        del base[key]  # the shipped config sets them
    cfg = validate_config(base)
    assert cfg.max_consecutive_skipped_steps == 3 and cfg.keep_last_n_checkpoints is None
    cfg = validate_config(_cfg(keep_last_n_checkpoints=2, save_every_n_steps=5))
    assert cfg.keep_last_n_checkpoints == 2 and cfg.save_every_n_steps == 5
    for key, value, valid in [
        ("max_consecutive_skipped_steps", 0, "a positive integer, got 0"),
        ("max_consecutive_skipped_steps", "null", "a positive integer, got None"),
        ("keep_last_n_checkpoints", 0, "null or a positive integer, got 0"),
        ("keep_last_n_checkpoints", True, r"null or a positive integer, got True \(a bool\)"),
        ("save_every_n_steps", -1, "null or a positive integer, got -1"),
    ]:
        with pytest.raises(ValueError, match=rf"^{key} must be {valid}\.$"):
            validate_config(_cfg(**{key: value}))


def _tokenizer():
    return tt_config.instantiate(_cfg().tokenizer)


# --- the schema: one declaration per key, read by validation, defaults and docs/config.md ---


def test_docs_config_keys_table_is_the_schema_table():
    page = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("|")]
    assert rows == markdown_table().splitlines(), (
        "docs/config.md's table differs from the schema; replace it with the output of "
        "`python -c 'from torchtune_ppo.config import markdown_table; print(markdown_table())'`"
    )


def test_every_key_is_checked_against_its_kind():
    for key in SCHEMA:
        cfg = _cfg()
        cfg[key.name] = "nope"
        if key.name in ("output_dir", "compile_cache"):  # any string is a path
            validate_config(cfg)
            continue
        message = rf"^{key.name} must be {re.escape(key.kind.valid)}, got 'nope' \(a string\)\."
        with pytest.raises(ValueError, match=message):
            validate_config(cfg)


def test_left_out_keys_take_the_schema_defaults():
    cfg = _cfg()
    # reward_checkpointer stays: without it the config has no reward; value_checkpointer and
    # reward_and_value_model too: the default advantage_estimator (gae) trains a value model;
    # ref_policy_checkpointer too: only a LoRA policy may leave it out.
    kept = ("reward_checkpointer", "value_checkpointer", "reward_and_value_model", "ref_policy_checkpointer")
    optional = [k for k in SCHEMA if not k.required and k.name not in kept]
    for key in optional:
        cfg.pop(key.name, None)
    filled = validate_config(cfg)
    for key in optional:
        value = filled[key.name]
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        # the compile block is read once, into the mapping of every region
        default = dataclasses.asdict(parse_compile(key.default)) if key.name == "compile" else key.default
        assert value == default, key.name


# --- torchtune's PPO config keys --------------------------------------------------------------


def test_num_steps_counts_prompts_as_in_torchtune(caplog):
    base = _cfg(batch_size=32)
    del base["num_ppo_steps"]
    base.num_steps = 1000
    cfg = validate_config(base)
    assert cfg.num_ppo_steps == 31 and "num_steps" not in cfg  # 1000 // 32, as torchtune runs
    with pytest.raises(ValueError, match="num_steps counts prompts, as in torchtune's recipe: "
                                         "num_steps=16 is fewer than batch_size=32"):
        validate_config(OmegaConf.merge(base, {"num_steps": 16}))
    with pytest.raises(ValueError, match="are both set; give one"):
        validate_config(OmegaConf.merge(base, {"num_ppo_steps": 3}))
    del base["num_steps"]
    with pytest.raises(ValueError, match="missing num_ppo_steps"):
        validate_config(base)


def test_torchtune_only_keys_are_mapped_or_checked():
    cfg = validate_config(_cfg(enable_kv_cache=False, whiten_rewards=True, save_every_n_epochs=2))
    assert "enable_kv_cache" not in cfg and cfg.whiten_rewards and cfg.save_every_n_epochs == 2
    assert cfg.max_prompt_len == 12
    assert validate_config(_cfg(max_prompt_len="null")).max_prompt_len is None  # longest prompt
    with pytest.raises(ValueError, match="optimizer_in_bwd=True .* gradient_accumulation_steps=1"):
        validate_config(_cfg(optimizer_in_bwd=True, gradient_accumulation_steps=2, clip_grad_norm="null"))
    with pytest.raises(ValueError, match="optimizer_in_bwd=True .* clip_grad_norm=null"):
        validate_config(_cfg(optimizer_in_bwd=True))
    with pytest.raises(ValueError, match="whiten_rewards must be true or false"):
        validate_config(_cfg(whiten_rewards="sometimes"))


def test_shard_frozen_models_is_an_optional_bool():
    assert validate_config(_cfg()).shard_frozen_models is False  # default: whole on every rank
    assert validate_config(_cfg(shard_frozen_models=True)).shard_frozen_models is True
    with pytest.raises(ValueError, match="shard_frozen_models must be true or false, got 'always'"):
        validate_config(_cfg(shard_frozen_models="always"))


def test_cpu_threads_auto_leaves_the_cores_other_processes_keep_busy(monkeypatch, caplog):
    import os

    from torchtune_ppo.config import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # a 4-core machine
    seen = []

    def busy(n):
        return lambda cores: seen.append(list(cores)) or n

    with caplog.at_level(logging.INFO):
        assert cpu_threads("auto", busy=busy(0.2)) == 4  # quiet: every core
    assert seen == [[0, 1, 2, 3]]  # asked about this process's own cores
    assert "cpu_threads=auto: 4 thread(s) on 4 cores (other processes kept 0.2 of them busy" in caplog.text
    assert cpu_threads("auto", busy=busy(0.6)) == 3  # one busy process keeps its core
    assert cpu_threads("auto", busy=busy(2.4)) == 2
    assert cpu_threads("auto", busy=busy(9.0)) == 1  # never fewer than one
    assert cpu_threads("auto", busy=busy(None)) == 4  # unreadable (not Linux): every core, as torch does
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes of one run share the free cores
    assert cpu_threads("auto", busy=busy(0.0)) == 2 and cpu_threads("auto", busy=busy(1.0)) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads("auto", busy=busy(0.0)) == 3 and cpu_threads(2) == 2  # the environment wins over auto only
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert cpu_threads("auto", busy=busy(0.0)) == 1 and cpu_threads(2) == 1  # one core: one thread, a larger setting capped
    with pytest.raises(ValueError, match="cpu_threads must be 'auto' or a positive integer, got 0"):
        validate_config(_cfg(cpu_threads=0))


def test_busy_cores_reads_each_cores_busy_share_from_proc_stat(tmp_path, monkeypatch):
    """The busy share of a core is everything but idle and iowait; steal counts as busy."""
    from torchtune_ppo.config import machine

    stat = tmp_path / "stat"
    #            user nice system idle iowait irq softirq steal
    first = ("cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0\ncpu1 0 0 0 200 0 0 0 0\n"
             "cpu2 0 0 0 100 0 0 0 0\nintr 1 2\n")
    later = ("cpu  0 0 0 0 0 0 0 0\ncpu0 150 10 20 110 10 0 0 0\ncpu1 0 0 0 300 0 0 0 0\n"
             "cpu2 0 0 0 150 0 0 0 50\nintr 1 2\n")
    monkeypatch.setattr(machine.time, "sleep", lambda s: stat.write_text(later))

    def busy(cores):
        stat.write_text(first)
        return machine.busy_cores(cores, stat=str(stat))

    # cpu0: 80 busy of 100 ticks; cpu1: idle; cpu2: 50 stolen of 100
    assert busy([0, 1]) == pytest.approx(0.8)
    assert busy([0, 1, 2]) == pytest.approx(1.3)
    assert busy([0, 7]) is None  # a core the file does not list
    assert machine.busy_cores([0], stat=str(tmp_path / "missing")) is None
    stat.write_text("cpu0 a b c d e\n")
    assert machine.busy_cores([0], stat=str(stat)) is None


def test_bf16_master_weights_only_where_they_are_kept():
    """Without optimizer_in_bwd bf16 keeps fp32 masters, on one process and on several (there the
    trained models' fp32 FSDP2 shards are the masters); with optimizer_in_bwd (as in torchtune's
    own bf16 configs) the bf16 weights are trained directly."""
    from torchtune_ppo.config import check_world_size

    assert validate_config(_cfg(dtype="bf16")).master_weights is True
    bwd = validate_config(_cfg(dtype="bf16", optimizer_in_bwd=True, gradient_accumulation_steps=1,
                               clip_grad_norm="null"))
    assert bwd.master_weights is False
    two = validate_config(_cfg(dtype="bf16"))
    check_world_size(two, 2)
    assert two.master_weights is True
    fp32 = validate_config(_cfg())
    check_world_size(fp32, 2)
    assert fp32.master_weights is True  # no effect in fp32, left as given


@pytest.mark.parametrize("overrides, world, pattern", [
    # each rank's minibatch rows, not the global ones, are split into micro-batches
    (dict(ppo_batch_size=8, gradient_accumulation_steps=8), 2,
     r"ppo_batch_size=8 over 2 processes gives 4 rows per rank, not a multiple of gradient_accumulation_steps=8"),
    (dict(batch_size=12, forward_batch_size=12, ppo_batch_size=12, gradient_accumulation_steps=2), 4,
     r"ppo_batch_size=12 over 4 processes gives 3 rows per rank"),
    (dict(batch_size=9, forward_batch_size=9, ppo_batch_size=9, gradient_accumulation_steps=1), 2,
     r"batch_size=9 is the global number of prompts per step, split over 2 processes"),
])
def test_batches_that_do_not_split_over_the_processes_are_refused(overrides, world, pattern):
    from torchtune_ppo.config import check_world_size

    cfg = validate_config(_cfg(**overrides))  # fine on one process
    with pytest.raises(ValueError, match=pattern):
        check_world_size(cfg, world)
    ok = validate_config(_cfg(ppo_batch_size=8, gradient_accumulation_steps=4))
    check_world_size(ok, 2)  # 4 rows a rank in 4 micro-batches


def test_reward_null_on_tunes_command_line_means_no_reward_function(caplog):
    """``reward=null`` on tune's command line sets ``reward._component_`` (torchtune's shorthand for
    a block's component; ``~reward`` cannot remove a block with one): with a reward model given
    as well, the function reward is read as off and noted, not refused as a second reward."""
    from argparse import Namespace

    from torchtune.config._utils import _merge_yaml_and_cli_args

    arithmetic = CONFIG.parent / "ppo_tiny_arithmetic.yaml"
    yaml = OmegaConf.to_container(OmegaConf.load(arithmetic), resolve=False)
    model = ["reward_checkpointer._component_=torchtune_ppo.models.ClassifierHFCheckpointer",
             "reward_checkpointer.checkpoint_dir=${ppo_asset:tiny_arithmetic/policy}",
             "reward_checkpointer.checkpoint_files=[model.safetensors]", "reward_checkpointer.model_type=LLAMA2",
             "reward_checkpointer.output_dir=/tmp/reward", "dataset.reference_column=null"]
    cfg = _merge_yaml_and_cli_args(Namespace(**yaml), ["reward=null", *model])
    assert cfg.reward._component_ is None and cfg.reward.extract == "last_number"  # what tune hands the recipe
    with caplog.at_level(logging.INFO):
        out = validate_config(cfg, check_machine=False)
    assert out.reward is None and out.reward_checkpointer.model_type == "LLAMA2"
    assert "reward._component_ is null: read as `reward: null`" in caplog.text
    # without a reward model, no reward at all is refused by name
    no_model = _merge_yaml_and_cli_args(Namespace(**yaml), ["reward=null"])
    with pytest.raises(ValueError, match="config has no reward"):
        validate_config(no_model, check_machine=False)
