"""Atomic step checkpoints: HF round trip, training state, RNG, refusals, crashes, pruning."""

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune import config, training

import torchtune_ppo
from torchtune_ppo.checkpointing import store as ckpt
from torchtune_ppo.checkpointing import training_state

HF = "torchtune.training.FullModelHFCheckpointer"


def _blocks(output_dir: Path):
    """The run's checkpointer config blocks, as in the tiny sentiment config."""
    policy = OmegaConf.create({
        "_component_": HF, "checkpoint_dir": torchtune_ppo.asset_path("tiny_sentiment/policy"),
        "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA2",
        "output_dir": str(output_dir / "policy"),
    })
    value = OmegaConf.create({
        "_component_": HF, "checkpoint_dir": torchtune_ppo.asset_path("tiny_sentiment/reward"),
        "checkpoint_files": ["model.safetensors"], "model_type": "REWARD",
        "output_dir": str(output_dir / "value"),
    })
    return policy, value


def _load(block, **overrides):
    return config.instantiate(block, **overrides).load_checkpoint()[training.MODEL_KEY]


@pytest.fixture(scope="module")
def state_dicts(tmp_path_factory):
    """Shipped tiny policy and reward weights in torchtune format (loaded once)."""
    policy, value = _blocks(tmp_path_factory.mktemp("load"))
    return _load(policy), _load(value)


@pytest.fixture
def run(tmp_path):
    out = tmp_path / "run"
    return out, *_blocks(out)


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _step_dirs(out):
    root = out / ckpt.CHECKPOINTS_DIRNAME
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_save_then_load_round_trip(run, state_dicts):
    out, policy, value = run
    psd, vsd = state_dicts
    param = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.randn(3, 4)
    opt.step()
    g = torch.Generator().manual_seed(7)
    state = {"optimizer": opt.state_dict(), "step": 5, "samples_seen": 80,
             "rng": training_state.capture_rng_state([g])}

    path = ckpt.CheckpointManager(out, policy, value).save(5, psd, vsd, state)
    assert path == out / "checkpoints" / "step_5"
    assert ckpt.latest_checkpoint(out) == path
    assert ckpt.existing_checkpoints(out) == [path]

    # Through torchtune's checkpointer, with the overrides a resuming recipe uses.
    overrides = ckpt.checkpointer_overrides(path)
    assert overrides["policy"]["checkpoint_dir"] == str(path / "policy")
    _assert_same(_load(policy, **overrides["policy"]), psd)
    _assert_same(_load(value, **overrides["value"]), vsd)

    # Plain HF folders: same tensors under the same HF names as the shipped ones, config.json.
    for name, src in (("policy", "tiny_sentiment/policy"), ("value", "tiny_sentiment/reward")):
        src = Path(torchtune_ppo.asset_path(src))
        (shard,) = overrides[name]["checkpoint_files"]
        _assert_same(load_file(path / name / shard), load_file(src / "model.safetensors"))
        assert json.loads((path / name / "config.json").read_text()) == json.loads(
            (src / "config.json").read_text())
        index = json.loads((path / name / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {shard}

    loaded = ckpt.load_training_state(path)
    assert loaded["step"] == 5 and loaded["samples_seen"] == 80
    _assert_same(loaded["optimizer"]["state"][0], opt.state_dict()["state"][0])
    assert loaded["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]

    marker = json.loads((path / ckpt.MARKER_FNAME).read_text())
    assert marker["step"] == 5 and "training_state.pt" in marker["files"]
    # The writer's scratch folders and nothing else of torchtune's are left behind.
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "policy", "training_state.pt", "value"]
    assert _step_dirs(out) == ["step_5"]


def test_rng_capture_restore_reproduces_draws(tmp_path):
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)

    def draws():
        return (torch.rand(4), random.random(), torch.rand(3, generator=g1),
                torch.randint(0, 100, (3,), generator=g2))

    state = training_state.capture_rng_state([g1, g2])
    torch.save(state, tmp_path / "rng.pt")  # through disk, as in training_state.pt
    first = draws()
    training_state.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), [g1, g2])
    second = draws()
    for a, b in zip(first, second):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
    with pytest.raises(ValueError, match="2 generators, 1 given"):
        training_state.restore_rng_state(state, [g1])


def test_a_resumed_runs_random_states_are_put_back_once():
    """``restore_pending_rng`` puts a resume's saved random states back at the first epoch start
    it reaches, and at none after: a later epoch draws on, as the uninterrupted run did."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    client = SimpleNamespace(pending_rng=training_state.capture_rng_state([g]),
                             restore_rng=lambda rng: training_state.restore_rng_state(rng, [g]))
    first = torch.rand(3, generator=g)
    training_state.CheckpointClient.restore_pending_rng(client)  # the resumed epoch's start
    assert torch.equal(torch.rand(3, generator=g), first) and client.pending_rng is None
    second = torch.rand(3, generator=g)
    training_state.CheckpointClient.restore_pending_rng(client)  # the next epoch's: nothing to put back
    assert not torch.equal(torch.rand(3, generator=g), second)

def test_non_finite_weights_write_nothing(run, state_dicts):
    out, policy, value = run
    psd, vsd = state_dicts
    name = "layers.1.attn.q_proj.weight"
    bad = dict(psd)
    bad[name] = psd[name].clone()
    bad[name][0, 0] = float("nan")
    manager = ckpt.CheckpointManager(out, policy, value)
    with pytest.raises(ckpt.NonFiniteWeightsError, match=rf"policy: {name}") as e:
        manager.save(1, bad, vsd, {})
    assert "value" not in str(e.value)
    assert _step_dirs(out) == []

    bad_value = {k: v.clone() for k, v in vsd.items()}
    bad_value["output.weight"][0] = float("inf")
    with pytest.raises(ckpt.NonFiniteWeightsError, match=r"value: output\.weight"):
        manager.save(1, psd, bad_value, {})
    assert _step_dirs(out) == []
    assert ckpt.latest_checkpoint(out) is None


_CRASH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from omegaconf import OmegaConf
    from torchtune import config, training
    from torchtune_ppo.checkpointing import store as ckpt

    out, policy, value = sys.argv[1], *(OmegaConf.create(json.loads(a)) for a in sys.argv[2:4])
    psd = config.instantiate(policy).load_checkpoint()[training.MODEL_KEY]
    vsd = config.instantiate(value).load_checkpoint()[training.MODEL_KEY]
    manager = ckpt.CheckpointManager(out, policy, value)
    manager.save(1, psd, vsd, {"step": 1})
    os.environ["TORCHTUNE_PPO_CRASH_DURING_SAVE"] = "after_policy"
    manager.save(2, psd, vsd, {"step": 2})
    print("not killed")
""")


def test_crash_during_save_leaves_previous_checkpoint(run, state_dicts, caplog):
    out, policy, value = run
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHTUNE_PPO_CRASH_DURING_SAVE", None)
    args = [json.dumps(OmegaConf.to_container(b)) for b in (policy, value)]
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    (tmp,) = [n for n in _step_dirs(out) if n.startswith(".tmp_step_2_")]
    assert (out / "checkpoints" / tmp / "policy").is_dir()
    assert not (out / "checkpoints" / tmp / "value").exists()

    with caplog.at_level(logging.WARNING):
        latest = ckpt.latest_checkpoint(out)
    assert latest == out / "checkpoints" / "step_1"
    assert tmp in caplog.text
    assert ckpt.load_training_state(latest) == {"step": 1}

    # The next completed save removes the dead process's leftover.
    psd, vsd = state_dicts
    ckpt.CheckpointManager(out, policy, value).save(2, psd, vsd, {"step": 2})
    assert _step_dirs(out) == ["step_1", "step_2"]


def test_save_removes_dead_processes_leftovers_only(run, state_dicts):
    # A temporary folder of a live process (another save still writing) must survive a save;
    # the crash test above only ever leaves a dead process's.
    out, policy, value = run
    psd, vsd = state_dicts
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    root = out / "checkpoints"
    live_tmp, dead_tmp = root / f".tmp_step_7_{os.getppid()}", root / f".tmp_step_8_{dead.pid}"
    for tmp in (live_tmp, dead_tmp):
        (tmp / "policy").mkdir(parents=True)
    ckpt.CheckpointManager(out, policy, value).save(1, psd, vsd, {"step": 1})
    assert _step_dirs(out) == [live_tmp.name, "step_1"]
    assert (live_tmp / "policy").is_dir()
    assert ckpt.latest_checkpoint(out) == root / "step_1"


def test_folder_without_valid_marker_is_skipped(run, state_dicts, caplog):
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    for step in (1, 2, 3):
        manager.save(step, psd, vsd, {"step": step})
    root = out / "checkpoints"
    (root / "step_3" / ckpt.MARKER_FNAME).unlink()
    with open(root / "step_2" / "value" / "model-00001-of-00001.safetensors", "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_checkpoint(out) == root / "step_1"
    assert "step_3: no COMPLETE marker" in caplog.text
    assert "step_2: value/model-00001-of-00001.safetensors has 100 bytes" in caplog.text
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.checkpointer_overrides(root / "step_3")
    assert ckpt.existing_checkpoints(out) == [root / "step_1", root / "step_2", root / "step_3"]

    # Saving over an incomplete step folder sets it aside (renamed, its files kept).
    (root / "step_3" / "note.txt").write_text("kept")
    manager.save(3, psd, vsd, {"step": 3})
    assert ckpt.latest_checkpoint(out) == root / "step_3"
    (aside,) = [n for n in _step_dirs(out) if n.startswith("step_3.damaged-")]
    assert _step_dirs(out) == ["step_1", "step_2", "step_3", aside]
    assert (root / aside / "note.txt").read_text() == "kept"


def test_a_step_folder_whose_marker_names_another_step_is_skipped(run, state_dicts, caplog):
    """A complete step_2 copied (or renamed) to step_5: every file and size matches its marker,
    but the marker says step 2, so step_5 is not a checkpoint of step 5 and the latest is step_2."""
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    for step in (1, 2):
        manager.save(step, psd, vsd, {"step": step})
    root = out / "checkpoints"
    shutil.copytree(root / "step_2", root / "step_5")
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_checkpoint(out) == root / "step_2"
    assert "step_5: COMPLETE marker is for step 2" in caplog.text


def test_same_step_twice_refuses(run, state_dicts):
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    path = manager.save(4, psd, vsd, {"step": 4})
    marker = (path / ckpt.MARKER_FNAME).read_text()
    with pytest.raises(ckpt.CheckpointExistsError, match="step_4"):
        manager.save(4, psd, vsd, {"step": 99})
    assert (path / ckpt.MARKER_FNAME).read_text() == marker
    assert ckpt.load_training_state(path) == {"step": 4}
    assert _step_dirs(out) == ["step_4"]


def test_prune_keeps_last_n_only_after_a_completed_save(run, state_dicts, monkeypatch):
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value, keep_last_n=2)
    for step in (1, 2, 3):
        manager.save(step, psd, vsd, {"step": step})
    assert _step_dirs(out) == ["step_2", "step_3"]

    # A failed save (non-finite weights, or an error while writing) prunes nothing.
    bad = {k: v.clone() for k, v in psd.items()}
    bad["norm.scale"][0] = float("nan")
    with pytest.raises(ckpt.NonFiniteWeightsError):
        manager.save(4, bad, vsd, {})

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        manager.save(4, psd, vsd, {})
    monkeypatch.undo()
    assert _step_dirs(out) == ["step_2", "step_3"]

    manager.save(4, psd, vsd, {"step": 4})
    assert _step_dirs(out) == ["step_3", "step_4"]


def test_steps_are_ordered_as_numbers_past_nine(run, state_dicts):
    # As strings step_10 and step_11 sort before step_9: the newest would be step_9, and
    # pruning would delete step_10 instead of step_9.
    out, policy, value = run
    psd, vsd = state_dicts
    root = out / "checkpoints"
    keep_all = ckpt.CheckpointManager(out, policy, value)
    for step in (9, 10):
        keep_all.save(step, psd, vsd, {"step": step})
    assert ckpt.latest_checkpoint(out) == root / "step_10"
    assert ckpt.checkpoint_to_resume(out, resume=True) == str(root / "step_10")

    ckpt.CheckpointManager(out, policy, value, keep_last_n=2).save(11, psd, vsd, {"step": 11})
    assert _step_dirs(out) == ["step_10", "step_11"]
    assert ckpt.latest_checkpoint(out) == root / "step_11"
    assert ckpt.load_training_state(ckpt.latest_checkpoint(out)) == {"step": 11}


def test_prune_keeps_the_checkpoint_a_run_resumed_from(run, state_dicts):
    out, policy, value = run
    psd, vsd = state_dicts
    first = ckpt.CheckpointManager(out, policy, value).save(1, psd, vsd, {"step": 1})
    overrides = ckpt.checkpointer_overrides(first)
    resumed = ckpt.CheckpointManager(
        out, OmegaConf.merge(policy, overrides["policy"]), OmegaConf.merge(value, overrides["value"]),
        keep_last_n=1,
    )
    for step in (2, 3):
        resumed.save(step, psd, vsd, {"step": step})
    # step_1 still feeds config.json to every save; step_2 was pruned.
    assert _step_dirs(out) == ["step_1", "step_3"]
    assert (out / "checkpoints" / "step_3" / "policy" / "config.json").is_file()


def test_existing_checkpoints_sees_the_old_layout(tmp_path):
    out = tmp_path / "run"
    (out / "policy").mkdir(parents=True)  # torchtune's checkpointer creates its output_dir
    (out / "checkpoints" / ".tmp_step_1_123").mkdir(parents=True)
    assert ckpt.existing_checkpoints(out) == []
    (out / "policy" / "epoch_3").mkdir()
    (out / "value" / "epoch_3").mkdir(parents=True)
    assert ckpt.existing_checkpoints(out) == [out / "policy" / "epoch_3", out / "value" / "epoch_3"]


def test_only_hf_checkpointers_and_positive_keep_last_n(run):
    out, policy, value = run
    meta = OmegaConf.merge(policy, {"_component_": "torchtune.training.FullModelMetaCheckpointer"})
    with pytest.raises(TypeError, match="FullModelHFCheckpointer"):
        ckpt.CheckpointManager(out, meta, value)
    with pytest.raises(ValueError, match="keep_last_n"):
        ckpt.CheckpointManager(out, policy, value, keep_last_n=0)
    missing = OmegaConf.merge(policy, {"checkpoint_files": ["nope.safetensors"]})
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        ckpt.CheckpointManager(out, missing, value)
    assert not out.exists()  # validation writes nothing


# ----------------------------------------------------------------------------- integrity


def _overwrite(path, offset=4096, size=4096):
    """Damage ``size`` bytes of a file in place: same size, different bytes."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(size)
        f.seek(offset)
        f.write(bytes((b + 1) % 256 for b in old))


@pytest.mark.parametrize("damaged", ["policy/model-00001-of-00001.safetensors", "training_state.pt"])
def test_damaged_file_of_the_same_size_is_named_and_skipped(run, state_dicts, caplog, damaged):
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    state = {"step": 0, "optimizer": {"m": torch.randn(4096)}}
    for step in (1, 2):
        manager.save(step, psd, vsd, state)
    root = out / "checkpoints"
    marker = json.loads((root / "step_2" / ckpt.MARKER_FNAME).read_text())
    assert set(marker["sha256"]) == set(marker["files"])
    assert marker["sha256"][damaged] == ckpt.sha256_of(root / "step_2" / damaged)
    size = (root / "step_2" / damaged).stat().st_size
    _overwrite(root / "step_2" / damaged)
    assert (root / "step_2" / damaged).stat().st_size == size

    assert ckpt.latest_checkpoint(out) == root / "step_2"  # sizes only: cheap discovery
    with caplog.at_level(logging.WARNING):
        assert ckpt.checkpoint_to_resume(out, True) == str(root / "step_1")
    assert f"Skipping damaged checkpoint {root / 'step_2'}: {damaged} is damaged: its sha256 differs" in caplog.text


def test_training_state_never_loads_code_and_the_error_does_not_advise_it(tmp_path):
    folder = tmp_path / "step_1"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"x": Evil()}, folder / ckpt.TRAINING_STATE_FNAME)
    (folder / "policy").mkdir()
    (folder / ckpt.MARKER_FNAME).write_text(json.dumps(
        {"step": 1, "files": {}, "checkpoint_files": {"policy": ["a"], "value": ["b"]}}))
    with pytest.raises(ckpt.DamagedCheckpointError) as err:
        ckpt.load_training_state(folder)
    message = str(err.value)
    assert str(folder / ckpt.TRAINING_STATE_FNAME) in message and "not plain data" in message
    assert "weights_only" not in message


def test_loaded_weights_are_checked_finite(state_dicts):
    psd, _ = state_dicts
    bad = {k: v.clone() for k, v in psd.items()}
    bad["norm.scale"][0] = float("inf")
    ckpt.check_loaded_finite(psd, "checkpointer")
    with pytest.raises(ckpt.NonFiniteWeightsError, match="checkpointer: the loaded weights hold NaN/Inf: norm.scale"):
        ckpt.check_loaded_finite(bad, "checkpointer")


# ----------------------------------------------------------------------------- I/O errors


def test_full_disk_names_the_path_and_the_os_error_and_keeps_earlier_checkpoints(run, state_dicts, monkeypatch):
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    manager.save(1, psd, vsd, {"step": 1})
    monkeypatch.setenv("TORCHTUNE_PPO_FULL_DISK_DURING_SAVE", "1")
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        manager.save(2, psd, vsd, {"step": 2})
    message = str(err.value)
    assert "No space left on device (errno 28: ENOSPC)" in message
    assert str(out / "checkpoints" / "step_2") in message and "training_state.pt" in message
    assert "earlier checkpoints are kept (step_1)" in message
    assert _step_dirs(out) == ["step_1"]  # the partial folder is gone
    monkeypatch.delenv("TORCHTUNE_PPO_FULL_DISK_DURING_SAVE")
    assert ckpt.latest_checkpoint(out, verify=True) == out / "checkpoints" / "step_1"


def test_a_full_disk_reported_without_errno_is_still_named(run, state_dicts, monkeypatch):
    # What torch.save(obj, path) says on a full disk; the free space tells what happened.
    out, policy, value = run
    psd, vsd = state_dicts

    def torch_save(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt.torch, "save", torch_save)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil_usage(0))
    with pytest.raises(ckpt.CheckpointWriteError, match=r"No space left on device \(RuntimeError: \[enforce"):
        ckpt.CheckpointManager(out, policy, value).save(1, psd, vsd, {"step": 1})
    assert _step_dirs(out) == []


def shutil_usage(free):
    import collections

    return collections.namedtuple("usage", "total used free")(1 << 30, (1 << 30) - free, free)


def test_unwritable_output_dir_is_named_with_the_os_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        ckpt.check_writable(tmp_path / "a_file" / "run")
    assert f"output_dir '{tmp_path / 'a_file' / 'run'}' is not writable: Not a directory" in str(err.value)
    ckpt.check_writable(tmp_path / "new" / "run")
    assert list((tmp_path / "new" / "run").iterdir()) == []


def test_the_adaptive_kl_coefficient_is_saved_and_restored(tmp_path):
    """The controller's coefficient goes into training_state.pt and comes back on load;
    a checkpoint without it (older runs) leaves the config's coefficient."""
    from torchtune_ppo.checkpointing import CheckpointClient
    from torchtune_ppo.ppo.kl import KLController
    from torchtune_ppo.run.guards import SkippedSteps

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class Manager:  # the store's part is tested above: keep the state the client hands over
        root = tmp_path

        def save(self, step, policy, value, state, run_config=None):
            self.state = state

    kl = KLController(0.05, target=0.1, horizon=100)
    kl.update(1.0, n=10)  # KL far above target: +20% * 10 / 100
    assert kl.value == pytest.approx(0.05 * 1.02)
    manager = Manager()
    client = CheckpointClient(manager, {"policy": model, "value": model}, optimizer, None, SkippedSteps(3),
                              [torch.Generator()], kl_controller=kl)
    client.save(1, {"steps_run": 1, "epochs_run": 0, "batches_run_in_epoch": 1})
    assert manager.state["kl_controller"] == {"value": pytest.approx(0.051)}
    restored = KLController(0.05, target=0.1, horizon=100)
    restored.load_state_dict(manager.state["kl_controller"])
    assert restored.value == kl.value


# ----------------------------------------------------------------------------- damaged, edited, locked


def _damage_middle(path, size=4000):
    """Overwrite ``size`` bytes in the middle of a file: same size, other bytes."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        old = f.read(size)
        f.seek(path.stat().st_size // 2)
        f.write(bytes((b + 1) % 256 for b in old))


def _edit_marker_sha(folder, rel):
    marker = json.loads((folder / ckpt.MARKER_FNAME).read_text())
    marker["sha256"][rel] = "0" * 64
    (folder / ckpt.MARKER_FNAME).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", ["weights", "training_state", "marker_sha", "config_yaml", "truncated"])
def test_resume_sets_damaged_newer_folders_aside_and_the_run_can_save_them_again(run, state_dicts, caplog, damage):
    # A resume skipped a damaged step_4 but left it in place: the run then reached step 4 again
    # and refused to overwrite it, and the printed resume command repeated the loop.
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    for step in (2, 4):
        manager.save(step, psd, vsd, {"step": step}, run_config={"seed": 1})
    root = out / ckpt.CHECKPOINTS_DIRNAME
    step4 = root / "step_4"
    if damage == "weights":
        _damage_middle(step4 / "policy" / "model-00001-of-00001.safetensors")
    elif damage == "training_state":
        _damage_middle(step4 / ckpt.TRAINING_STATE_FNAME, size=64)
    elif damage == "marker_sha":
        _edit_marker_sha(step4, "value/model-00001-of-00001.safetensors")
    elif damage == "config_yaml":
        (step4 / ckpt.CONFIG_FNAME).write_text("seed: 2\n")
    else:
        with open(step4 / "value" / "model-00001-of-00001.safetensors", "r+b") as f:
            f.truncate(100)
    before = {str(p.relative_to(step4)): p.read_bytes() for p in step4.rglob("*") if p.is_file()}

    with caplog.at_level(logging.WARNING):
        assert ckpt.checkpoint_to_resume(out, True) == str(root / "step_2")
    (aside,) = [n for n in _step_dirs(out) if n.startswith("step_4.")]
    assert aside.startswith("step_4.damaged-") and _step_dirs(out) == ["step_2", aside]
    # Set aside whole: every byte still there, under the new name.
    assert {str(p.relative_to(root / aside)): p.read_bytes()
            for p in (root / aside).rglob("*") if p.is_file()} == before
    assert f"Set aside checkpoint {step4} as {aside}" in caplog.text
    assert ckpt.existing_checkpoints(out)[-1] == root / aside  # a fresh run still refuses the folder
    # The resumed run saves step 4 again.
    manager.save(4, psd, vsd, {"step": 4})
    assert ckpt.latest_checkpoint(out, verify=True) == step4
    ckpt.release_output_dir(out)


def test_only_folders_newer_than_the_resume_point_are_set_aside(run, state_dicts):
    out, policy, value = run
    psd, vsd = state_dicts
    manager = ckpt.CheckpointManager(out, policy, value)
    for step in (1, 2, 3):
        manager.save(step, psd, vsd, {"step": step})
    root = out / ckpt.CHECKPOINTS_DIRNAME
    (root / "step_1" / ckpt.MARKER_FNAME).unlink()  # older than step 3: nobody will save it again
    assert ckpt.checkpoint_to_resume(out, True) == str(root / "step_3")
    assert _step_dirs(out) == ["step_1", "step_2", "step_3"]
    ckpt.release_output_dir(out)


@pytest.mark.parametrize("edit", ["edited", "removed"])
def test_editing_metadata_a_resume_does_not_read_keeps_the_checkpoint(tmp_path, caplog, edit):
    # Adding base_model_name_or_path to adapter_config.json (for PEFT) used to fail the checksum
    # and cost the whole checkpoint.
    block = OmegaConf.create({
        "_component_": HF, "checkpoint_dir": torchtune_ppo.asset_path("tiny_sentiment/policy"),
        "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA2", "output_dir": str(tmp_path / "x"),
    })
    adapter = ({"layers.0.attn.q_proj.lora_a.weight": torch.ones(2, 4)},
               {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}, {})
    manager = ckpt.CheckpointManager(tmp_path / "run", block, None)
    path = manager.save(1, None, None, {"step": 1}, adapters={"policy": adapter})
    name = "adapter_config.json"
    target = path / "policy" / name
    if edit == "edited":
        cfg = json.loads(target.read_text())
        cfg["base_model_name_or_path"] = "some/base-model"
        target.write_text(json.dumps(cfg))
    else:
        target.unlink()
    with caplog.at_level(logging.WARNING):
        assert ckpt.checkpoint_to_resume(tmp_path / "run", True) == str(path)
    (change,) = ckpt.edited_files(path)
    assert change.startswith(f"policy/{name}: ") and (("bytes, other contents" in change) == (edit == "edited"))
    assert f"policy/{name}" in caplog.text and "A resume does not read this file" in caplog.text
    assert not list((tmp_path / "run" / ckpt.CHECKPOINTS_DIRNAME).glob("*.damaged-*"))
    assert ckpt.load_adapters(path, "policy").keys() == adapter[0].keys()
    # The weights a resume reads are still checked: damaged adapters are damage.
    _damage_middle(path / "policy" / "adapter_model.pt", size=16)
    assert ckpt.latest_checkpoint(tmp_path / "run", verify=True) is None
    ckpt.release_output_dir(tmp_path / "run")


def test_a_checkpoint_holds_no_copy_of_its_source_folders_manifest(tmp_path, state_dicts):
    # A source folder's manifest.json (tools/prepare_smollm2.py) lists checksums of its own files;
    # the writer used to copy it into every checkpoint, where it described files not there.
    src = tmp_path / "src"
    shutil.copytree(torchtune_ppo.asset_path("tiny_sentiment/policy"), src)
    (src / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": "ab" * 32}}))
    policy, value = _blocks(tmp_path / "run")
    policy.checkpoint_dir = str(src)
    psd, vsd = state_dicts
    path = ckpt.CheckpointManager(tmp_path / "run", policy, value).save(1, psd, vsd, {"step": 1})
    assert (path / "policy" / "config.json").is_file()  # other files of the source are copied
    assert not (path / "policy" / "manifest.json").exists()
    assert "policy/manifest.json" not in json.loads((path / ckpt.MARKER_FNAME).read_text())["files"]


def test_a_second_run_in_the_same_output_dir_is_refused_while_the_first_holds_it(tmp_path, monkeypatch):
    import fcntl

    out = tmp_path / "run"
    ckpt.checkpoint_to_resume(out, False)  # takes the lock, as a fresh run's preflight does
    ckpt.lock_output_dir(out)  # again in the same process: a no-op
    lock = out / ckpt.LOCK_FNAME
    # Another run opens the lock file anew (a new open file description, as another process's).
    with open(lock, "a+") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holding = dict(ckpt._held_locks)
    monkeypatch.setattr(ckpt, "_held_locks", {})  # as a process that does not hold it
    with pytest.raises(RuntimeError) as err:
        ckpt.lock_output_dir(out)
    assert f"output_dir {str(out)!r} is in use by another run (pid {os.getpid()} on" in str(err.value)
    monkeypatch.setattr(ckpt, "_held_locks", holding)
    ckpt.release_output_dir(out)
    with open(lock, "a+") as other:  # let go: another run may take it
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
    # A refused fresh run leaves a folder with checkpoints untouched: no lock file written.
    refused = tmp_path / "refused"
    (refused / ckpt.CHECKPOINTS_DIRNAME / "step_1").mkdir(parents=True)
    with pytest.raises(FileExistsError):
        ckpt.checkpoint_to_resume(refused, False)
    assert not (refused / ckpt.LOCK_FNAME).exists()


def test_the_accuracy_script_reads_the_prompt_settings_of_the_run_that_saved_the_policy(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "chat_arithmetic_accuracy", Path(__file__).resolve().parents[2] / "benchmarks/tasks/chat_arithmetic_accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    step = tmp_path / "checkpoints" / "step_8"
    (step / "policy").mkdir(parents=True)
    assert script.run_config(step / "policy", None) == script.CONFIG  # no saved config: the shipped one
    (step / "config.yaml").write_text("dataset: {response_prefix: 'A:'}\n")
    assert script.run_config(step / "policy", None) == step / "config.yaml"
    assert script.run_config(step / "policy", "mine.yaml") == Path("mine.yaml")
