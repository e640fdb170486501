"""bf16 with master weights on 2 CPU processes (torchrun, gloo, FSDP2): the trained models' fp32
shards are the masters, gathered in bf16 to compute, gradients reduced in fp32. Against 1
process with ``MasterWeights`` and against fp32, on test_distributed's settings (greedy, one
minibatch of the whole batch, 3 steps), every step saved sharded so that the fp32 weights can
be read back."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config, training

import torchtune_ppo
from torchtune_ppo.checkpointing import sharded

from test_sharded_checkpoints import _run

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
MODELS = {"policy": ("policy", "LLAMA2"), "value": ("reward", "REWARD")}


def _start(name):
    folder, model_type = MODELS[name]
    block = OmegaConf.create({"_component_": "torchtune.training.FullModelHFCheckpointer",
                              "checkpoint_dir": torchtune_ppo.asset_path(f"tiny_sentiment/{folder}"),
                              "checkpoint_files": ["model.safetensors"], "model_type": model_type,
                              "output_dir": "/unused"})
    return {k: v.float() for k, v in config.instantiate(block).load_checkpoint()[training.MODEL_KEY].items()}


def _weights(out: Path, name: str, prefix: str = "model"):
    """The fp32 weights of ``name`` after step 3 (``master``: one process's masters)."""
    return sharded.read_full(out / "checkpoints/step_3", f"{prefix}.{name}.")


def test_only_bf16_masters_on_several_processes_keep_fp32_shards(monkeypatch):
    from torchtune_ppo import distributed
    from torchtune_ppo.models.build import sharded_masters

    masters = OmegaConf.create({"master_weights": True})
    assert not sharded_masters(masters, torch.bfloat16)  # one process: MasterWeights
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert sharded_masters(masters, torch.bfloat16)
    assert not sharded_masters(masters, torch.float32)
    assert not sharded_masters(OmegaConf.create({"master_weights": False}), torch.bfloat16)


SHARD_CHECK = '''
import sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torchtune_ppo import distributed
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = tiny_policy()
distributed.shard(model, compute_dtype=torch.bfloat16)
# FSDP2 keeps its policy on each module's state (no public getter in torch 2.13)
policies = {(m._get_fsdp_state()._mp_policy.param_dtype, m._get_fsdp_state()._mp_policy.reduce_dtype)
            for m in model.modules() if isinstance(m, FSDPModule)}
print(sorted(str(d) for pair in policies for d in pair), sorted({str(p.dtype) for p in model.parameters()}))
dist.destroy_process_group()
'''


def test_the_shards_compute_in_bf16_and_reduce_gradients_in_fp32(tmp_path):
    """Every FSDP2 group of a model sharded for bf16 masters gathers bf16 and reduces gradients
    in fp32 (a bf16 reduction rounds each sum to 8 bits before the fp32 master takes it), and
    the parameters stay fp32; on a one-process group, in a process of its own."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SHARD_CHECK, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "['torch.bfloat16', 'torch.float32'] ['torch.float32']"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bf16_distributed")
    out = {name: base / name for name in ("fp32", "one", "two")}
    _run(out["fp32"], 1)
    _run(out["one"], 1, "dtype=bf16", "master_rounding=nearest")  # as FSDP2 casts the shards
    rows = _run(out["two"], 2, "dtype=bf16")
    return out, rows


def test_the_fp32_shards_are_the_masters_and_as_close_to_fp32_as_one_process(runs):
    """After 3 steps the 2-process run's fp32 weights are no further from the fp32 run's than the
    1-process masters are, measured as the mean gap over the mean move of the fp32 run (measured
    2026-12-07 with ``pytest -s`` on this file: 0.06 and 0.10 against 0.24 and 0.54 for the policy and the value model: the
    gradients of 2 processes are reduced in fp32, one process's are bf16 before their masters
    take them). The bf16 weights trained directly
    (the 2-process run with master_weights=False, measured once by hand) were 0.49 and 0.79 away."""
    out, rows = runs
    assert len(rows) == 3 and rows[2]["kl"] != 0
    for name in MODELS:
        start, fp32 = _start(name), _weights(out["fp32"], name)
        two, one = _weights(out["two"], name), _weights(out["one"], name, "master")
        assert all(t.dtype == torch.float32 for t in two.values())
        move = torch.cat([(fp32[k] - start[k]).flatten() for k in fp32]).abs().mean()

        def gap(a):
            return (torch.cat([(a[k] - fp32[k]).flatten() for k in fp32]).abs().mean() / move).item()
        print(f"{name}: gap to fp32 over fp32's move, 2 processes {gap(two):.3f}, 1 process {gap(one):.3f}")
        assert gap(two) <= gap(one), (name, gap(two), gap(one))


def test_updates_below_a_bf16_spacing_are_kept(tmp_path):
    """At lr 1e-5 the fp32 shards move (measured 94% of the policy's weights, 78% of the value
    model's) where rounded to bf16 only 21% and 15% would: the rest would be lost by AdamW on
    bf16 weights."""
    out = tmp_path / "small"
    _run(out, 2, "dtype=bf16", "optimizer.lr=1e-5")
    for name, least in (("policy", 0.8), ("value", 0.6)):
        start, trained = _start(name), _weights(out, name)
        moved = torch.cat([(trained[k] != start[k]).flatten() for k in start]).float().mean().item()
        moved_bf16 = torch.cat([(trained[k].bfloat16() != start[k].bfloat16()).flatten()
                                for k in start]).float().mean().item()
        print(f"{name}: {moved:.1%} of the fp32 weights moved, {moved_bf16:.1%} of their bf16 roundings")
        assert moved > least and moved_bf16 < moved / 2, (name, moved, moved_bf16)


def test_a_lora_run_with_one_shared_base_trains_its_fp32_adapters(tmp_path):
    """The LoRA config on 2 processes in bf16: the policy and the value model (base included:
    FSDP2 keeps one dtype a group) are fp32 shards computed in bf16, and the reward model, the
    value model's base with its adapters off and the checkpoint's head, computes in bf16 too."""
    from test_lora_runs import LORA

    out = tmp_path / "lora"
    rows = _run(out, 2, "dtype=bf16", config=LORA)
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    for name in MODELS:
        weights = _weights(out, name)
        adapters = {k: v for k, v in weights.items() if "lora_b" in k}
        assert adapters and all(t.dtype == torch.float32 for t in weights.values())
        assert max(t.abs().max().item() for t in adapters.values()) > 0  # lora_b starts at 0: trained
