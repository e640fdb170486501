"""Sharded checkpoints on one process: the round trip of weights, optimizer state and fp32
masters, staging for background saves, one save in flight, damaged shards set aside, and
``tune-ppo export`` from both formats (the runs on several processes: e2e/test_sharded_checkpoints.py)."""

import json
import threading
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune import config, training

import torchtune_ppo
from torchtune_ppo.checkpointing import sharded
from torchtune_ppo.checkpointing import store as ckpt
from torchtune_ppo.checkpointing.export import export_checkpoint
from torchtune_ppo.checkpointing.training_state import CheckpointClient
from torchtune_ppo.run.optim import MasterWeights
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy, tiny_reward

HF = "torchtune.training.FullModelHFCheckpointer"


def _blocks():
    return [OmegaConf.create({"_component_": HF, "checkpoint_dir": torchtune_ppo.asset_path(f"tiny_sentiment/{d}"),
                              "checkpoint_files": ["model.safetensors"], "model_type": t, "output_dir": "/unused"})
            for d, t in (("policy", "LLAMA2"), ("reward", "REWARD"))]


class _Skipped:
    def state_dict(self):
        return {"n": 0}

    def load_state_dict(self, s):
        pass


def _models(seed=0):
    torch.manual_seed(seed)
    return {"policy": tiny_policy(), "value": tiny_reward()}


def _trained(models, steps=2, lr=1e-2, masters=False):
    """AdamW over the models (over fp32 masters of their weights with ``masters``), ``steps`` updates."""
    params = [p for m in models.values() for p in m.parameters()]
    master = MasterWeights(params) if masters else None
    opt = torch.optim.AdamW(params if master is None else master.masters, lr=lr)
    for i in range(steps):
        tokens = torch.randint(3, 30, (2, 6), generator=torch.Generator().manual_seed(i))
        loss = sum(m(tokens).float().pow(2).mean() for m in models.values())
        loss.backward()
        if master is not None:
            master.take_grads()
        opt.step()
        opt.zero_grad()
        if master is not None:
            master.write_back()
    return opt, master


def _client(out, models, opt, master=None, **kw):
    manager = ckpt.CheckpointManager(out, *_blocks())
    return CheckpointClient(manager, models, opt, None, _Skipped(), [], master_weights=master,
                            checkpoint_format="sharded", **kw)


def _progress():
    return {"steps_run": 2, "epochs_run": 0, "batches_run_in_epoch": 2}


@pytest.mark.parametrize("masters", [False, True])
def test_weights_optimizer_and_masters_come_back(tmp_path, masters):
    models = _models()
    opt, master = _trained(models, masters=masters)
    client = _client(tmp_path, models, opt, master)
    path = Path(client.save(2, _progress()))
    assert ckpt.is_sharded(path) and (path / "shards/.metadata").is_file()
    assert not (path / "policy").exists()  # nothing gathered, no HF folder
    saved = {f"{name}.{k}": t.clone() for name, m in models.items() for k, t in m.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in sharded.shard_state(models, opt, master and master.masters).items()}
    saved_lr = opt.param_groups[0]["lr"]

    fresh = _models(seed=1)  # other weights, no optimizer state yet
    params = [p for m in fresh.values() for p in m.parameters()]
    fresh_master = MasterWeights(params) if masters else None
    fresh_opt = torch.optim.AdamW(params if fresh_master is None else fresh_master.masters, lr=0.5)
    assert not fresh_opt.state
    client2 = _client(tmp_path / "other", fresh, fresh_opt, fresh_master)
    client2.load(str(path))
    for n, m in fresh.items():
        for k, t in m.state_dict().items():
            assert torch.equal(t, saved[f"{n}.{k}"]), (n, k)
    state = sharded.shard_state(fresh, fresh_opt, fresh_master and fresh_master.masters)
    assert state.keys() == saved_opt.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in state)
    assert (any(k.startswith("master.") for k in state)) == masters
    for k, v in saved_opt.items():
        assert torch.equal(state[k], v), k
    assert fresh_opt.param_groups[0]["lr"] == saved_lr


def test_a_checkpoint_before_any_step_loads_no_optimizer_state(tmp_path):
    models = _models()
    opt = torch.optim.AdamW([p for m in models.values() for p in m.parameters()], lr=1e-2)
    path = _client(tmp_path, models, opt).save(0, {**_progress(), "steps_run": 0})
    fresh = _models(seed=1)
    fresh_opt = torch.optim.AdamW([p for m in fresh.values() for p in m.parameters()], lr=1e-2)
    _client(tmp_path / "other", fresh, fresh_opt).load(path)
    assert not fresh_opt.state  # Adam's first step starts from nothing, as in the saving run


def test_a_checkpoint_of_other_models_is_refused_by_name(tmp_path):
    models = _models()
    opt, _ = _trained(models, steps=1)
    path = _client(tmp_path, models, opt).save(1, _progress())
    small = {"policy": models["policy"]}  # a critic-free run over a checkpoint with a value model
    opt2 = torch.optim.AdamW(small["policy"].parameters())
    with pytest.raises(ValueError, match="trained parameters"):
        _client(tmp_path / "o", small, opt2).load(path)
    # bf16 weights saved without masters, resumed with them: refused (an fp32 checkpoint's
    # weights, as saved on several processes, would fill them)
    bf16 = {n: m.to(torch.bfloat16) for n, m in _models().items()}
    path = _client(tmp_path / "bf16", bf16, torch.optim.AdamW([p for m in bf16.values() for p in m.parameters()])
                   ).save(1, _progress())
    master = MasterWeights([p for m in bf16.values() for p in m.parameters()])
    with pytest.raises(ValueError, match="no fp32 master weights"):
        _client(tmp_path / "p", bf16, torch.optim.AdamW(master.masters), master).load(path)


def test_bf16_masters_move_between_one_process_and_the_fp32_shards_of_several(tmp_path):
    """One process's masters fill fp32 weights (as several processes' shards are), and fp32
    weights (as saved by several processes) fill one process's masters, whose rounding is the
    bf16 weights: no master bit is lost either way."""
    bf16 = {n: m.to(torch.bfloat16) for n, m in _models().items()}
    opt, master = _trained(bf16, masters=True)
    path = _client(tmp_path / "one", bf16, opt, master).save(2, _progress())
    fp32 = _models(seed=1)
    fp32_opt = torch.optim.AdamW([p for m in fp32.values() for p in m.parameters()])
    _client(tmp_path / "x", fp32, fp32_opt).load(path)  # as the fp32 shards of several processes
    fp32_params = [p for m in fp32.values() for p in m.parameters()]
    assert all(torch.equal(p, m) for p, m in zip(fp32_params, master.masters))
    assert any(not torch.equal(m, m.bfloat16().float()) for m in master.masters)  # bits below bf16's
    back_path = _client(tmp_path / "several", fp32, fp32_opt).save(3, _progress())
    again = {n: m.to(torch.bfloat16) for n, m in _models(seed=2).items()}
    params = [p for m in again.values() for p in m.parameters()]
    again_master = MasterWeights(params)
    _client(tmp_path / "y", again, torch.optim.AdamW(again_master.masters), again_master).load(back_path)
    assert all(torch.equal(a, m) for a, m in zip(again_master.masters, master.masters))
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(params, master.masters))


def test_staged_tensors_are_copies_that_later_steps_do_not_change(tmp_path, monkeypatch):
    """A background save writes what the state was at the save, not after the next optimizer
    step changed the tensors in place (the failure of pytorch#144657)."""
    release, started = threading.Event(), threading.Event()
    real_write = sharded._write

    def held_write(tmp, state, group):
        started.set()
        release.wait(30)
        real_write(tmp, state, group)

    monkeypatch.setattr(sharded, "_write", held_write)
    t = torch.arange(6, dtype=torch.float32)
    writer = sharded.ShardWriter(async_save=True)
    done = []
    writer.save(tmp_path / "a", {"w": t}, lambda: done.append(1))
    assert started.wait(30) and not done  # the write waits; the step goes on
    t.add_(100.0)  # the next step changes the tensor in place
    release.set()
    writer.close()
    assert done == [1]
    assert torch.equal(sharded.read_full(tmp_path / "a", "")["w"], torch.arange(6, dtype=torch.float32))


def test_one_save_in_flight_and_its_error_reaches_the_next(tmp_path, monkeypatch):
    order, release = [], threading.Event()

    def write(tmp, state, group):
        order.append(f"start {Path(tmp).name}")
        if Path(tmp).name == "a":
            release.wait(30)
        if Path(tmp).name == "b":
            raise OSError(28, "No space left on device")
        order.append(f"end {Path(tmp).name}")

    monkeypatch.setattr(sharded, "_write", write)
    writer = sharded.ShardWriter(async_save=True)
    writer.save(tmp_path / "a", {"w": torch.ones(2)}, lambda: None)
    threading.Timer(0.2, release.set).start()
    writer.save(tmp_path / "b", {"w": torch.ones(2)}, lambda: None)  # waits for a
    assert order[:2] == ["start a", "end a"]
    with pytest.raises(OSError, match="No space"):
        writer.save(tmp_path / "c", {"w": torch.ones(2)}, lambda: None)  # b's error, raised here
    writer.close()


def test_a_damaged_shard_or_missing_metadata_is_set_aside(tmp_path, caplog):
    models = _models()
    opt, _ = _trained(models, steps=1)
    client = _client(tmp_path, models, opt)
    client.save(1, _progress())
    newest = Path(client.save(2, _progress()))
    shard = newest / "shards/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ckpt.latest_checkpoint(tmp_path, verify=True, set_aside_damaged=True).name == "step_1"
    assert "shards/__0_0.distcp is damaged" in caplog.text
    assert not newest.exists() and list(tmp_path.glob("checkpoints/step_2.damaged-*"))
    (tmp_path / "checkpoints/step_1/shards/.metadata").unlink()
    assert ckpt.latest_checkpoint(tmp_path) is None  # incomplete: never read


def test_async_save_needs_the_sharded_format(tmp_path):
    models = _models()
    opt = torch.optim.AdamW(models["policy"].parameters())
    manager = ckpt.CheckpointManager(tmp_path, *_blocks())
    with pytest.raises(ValueError, match="async_save with sharded only"):
        CheckpointClient(manager, models, opt, None, _Skipped(), [], async_save=True)


def _hf(folder: Path):
    return load_file(next(folder.glob("model-*.safetensors")))


def test_export_writes_the_trained_weights_from_either_format(tmp_path):
    """The sharded checkpoint's export holds the trained weights in HF names, as the full
    format's own policy folder does for the same weights; both load in torchtune's checkpointer."""
    models = _models()
    opt, _ = _trained(models)
    bare = Path(_client(tmp_path / "bare", models, opt).save(2, _progress()))
    with pytest.raises(FileNotFoundError, match="config.yaml"):  # the run's checkpointers are unknown
        export_checkpoint(bare, tmp_path / "x")
    run_cfg = OmegaConf.create({"checkpointer": _blocks()[0], "value_checkpointer": _blocks()[1],
                                "policy_model": {"_component_": "torchtune_ppo.tasks.tiny_sentiment.tiny_policy"},
                                "reward_and_value_model": {"_component_": "torchtune_ppo.tasks.tiny_sentiment.tiny_reward"}})
    path = Path(_client(tmp_path / "s", models, opt, run_config=run_cfg).save(2, _progress()))
    ckpt.CheckpointManager(tmp_path / "f", *_blocks()).save(
        2, models["policy"].state_dict(), models["value"].state_dict(), {"steps_run": 2}, run_config=run_cfg)
    a = export_checkpoint(path, tmp_path / "from_sharded")
    b = export_checkpoint(tmp_path / "f", tmp_path / "from_full")  # an output_dir: its newest
    for name in ("policy", "value"):
        x, y = _hf(a[name]), _hf(b[name])
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        block = OmegaConf.merge(_blocks()[name == "value"], {"checkpoint_dir": str(a[name]),
                                                             "checkpoint_files": [next(a[name].glob("model-*")).name]})
        loaded = config.instantiate(block).load_checkpoint()[training.MODEL_KEY]
        for k, t in models[name].state_dict().items():
            assert torch.equal(loaded[k], t), (name, k)
    with pytest.raises(FileExistsError, match="already holds files"):
        export_checkpoint(path, tmp_path / "from_sharded")


def test_a_sharded_marker_without_metadata_and_shards_is_incomplete(tmp_path):
    """A marker that says sharded but lists no shards/.metadata or no shard file (written before
    the shards were complete) makes no checkpoint, even with every listed file present."""
    models = _models()
    opt, _ = _trained(models, steps=1)
    path = Path(_client(tmp_path, models, opt).save(1, _progress()))
    marker = ckpt._read_marker(path)
    for drop in ("shards/.metadata", "shards/__0_0.distcp"):
        edited = {**marker, "files": {k: v for k, v in marker["files"].items() if k != drop},
                  "sha256": {k: v for k, v in marker["sha256"].items() if k != drop}}
        (path / ckpt.MARKER_FNAME).write_text(json.dumps(edited))
        assert ckpt._invalid_reason(path) is not None and ckpt.latest_checkpoint(tmp_path) is None, drop


def test_a_background_save_writes_the_training_state_of_its_step(tmp_path, monkeypatch):
    """The training state a background save writes is the one of its step, though the run's
    records (the evaluations' history) grow while the write waits."""
    release = threading.Event()
    real_write = sharded._write

    def held_write(tmp, state, group):
        release.wait(30)
        real_write(tmp, state, group)

    monkeypatch.setattr(sharded, "_write", held_write)
    models = _models()
    opt, _ = _trained(models, steps=1)
    client = _client(tmp_path, models, opt, async_save=True)
    progress = {**_progress(), "evaluation": {"history": [{"step": 2, "score": 0.5}]}}
    path = client.save(2, progress)
    progress["evaluation"]["history"].append({"step": 3, "score": 0.7})  # the next step's evaluation
    release.set()
    client.close()
    assert ckpt.load_training_state(path)["evaluation"] == {"history": [{"step": 2, "score": 0.5}]}
