"""What identifies a run's data (each local file's path, size and sha256, the row count), and
how a resume compares it with what its checkpoint recorded: on hand-made files."""

import hashlib
import json
import logging

import pytest
from omegaconf import OmegaConf

from torchtune_ppo.data.identity import (
    DataChangedError,
    check_resumed_data,
    data_changes,
    data_identity,
    local_data_files,
)
from torchtune_ppo.ppo.value_pretrain import ValuePretraining
from torchtune_ppo.run.progress import Progress

log = logging.getLogger("test_data_identity_unit")


class Rows(list):
    """A dataset of ``len`` rows (the identity reads only its length)."""


def _write(path, records):
    path.write_text(json.dumps(records))
    return path


def _block(*files, **keys):
    return OmegaConf.create({"_component_": "d", "source": "json",
                             "data_files": [str(f) for f in files] if len(files) != 1 else str(files[0]), **keys})


def test_identity_of_local_files_is_path_size_sha256_and_rows(tmp_path):
    a = _write(tmp_path / "a.json", [{"prompt": "x"}, {"prompt": "y"}])
    b = _write(tmp_path / "b.json", [{"prompt": "z"}])
    identity = data_identity(_block(a, b), Rows([0, 1, 2]))
    assert identity["rows"] == 3 and identity["source"] == "json" and identity["split"] == "train"
    assert identity["files"] == [
        {"path": str(p.resolve()), "size": len(p.read_bytes()), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in (a, b)]
    assert identity["fingerprint"] is None
    assert data_changes(identity, data_identity(_block(a, b), Rows([0, 1, 2]))) == []


def test_a_file_larger_than_a_chunk_hashes_as_a_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b'{"prompt": "%d"}\n' * 200_000)  # ~3.4 MB: several 1 MiB chunks
    (entry,) = data_identity(_block(path), Rows([0]))["files"]
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_data_files_as_a_split_mapping_a_glob_and_a_source_folder(tmp_path):
    a = _write(tmp_path / "a.json", [])
    b = _write(tmp_path / "b.json", [])
    assert local_data_files(OmegaConf.create({"data_files": {"train": [str(a)], "test": str(b)}})) == [a, b]
    assert local_data_files(OmegaConf.create({"data_files": str(tmp_path / "*.json")})) == [a, b]
    assert local_data_files(OmegaConf.create({"source": str(tmp_path)})) == [a, b]
    assert local_data_files(OmegaConf.create({"source": "someone/a-hub-dataset"})) == []


def test_an_edited_file_is_named_with_its_rows_size_and_hash(tmp_path):
    path = _write(tmp_path / "prompts.json", [{"prompt": str(i)} for i in range(20)])
    saved = data_identity(_block(path), Rows(range(20)))
    _write(path, [{"prompt": str(i)} for i in range(19)])
    now = data_identity(_block(path), Rows(range(19)))
    (change,) = data_changes(saved, now)
    old, new = saved["files"][0], now["files"][0]
    assert change == (f"{str(path.resolve())!r}: rows 20 -> 19, size {old['size']} -> {new['size']} bytes, "
                      f"sha256 {old['sha256'][:12]}... -> {new['sha256'][:12]}...")


def test_the_same_size_and_rows_with_other_bytes_is_a_change(tmp_path):
    path = _write(tmp_path / "prompts.json", [{"prompt": "good"}])
    saved = data_identity(_block(path), Rows([0]))
    _write(path, [{"prompt": "evil"}])
    (change,) = data_changes(saved, data_identity(_block(path), Rows([0])))
    old, new = saved["files"][0]["sha256"], hashlib.sha256(path.read_bytes()).hexdigest()
    assert change == f"{str(path.resolve())!r}: sha256 {old[:12]}... -> {new[:12]}..."


def test_files_added_and_removed_and_the_rows_of_several_files(tmp_path):
    a = _write(tmp_path / "a.json", [{"prompt": "x"}])
    b = _write(tmp_path / "b.json", [{"prompt": "y"}])
    c = _write(tmp_path / "c.json", [{"prompt": "z"}])
    saved = data_identity(_block(a, b), Rows([0, 1]))
    changes = data_changes(saved, data_identity(_block(a, c), Rows([0, 1, 2])))
    assert changes == [f"{str(c.resolve())!r}: not read by the saved run (a file added)",
                       f"{str(b.resolve())!r}: read by the saved run, not now (a file removed)",
                       "the dataset: rows 2 -> 3"]


def test_data_that_are_not_local_compare_rows_and_fingerprint():
    class Hub:
        _data = type("HF", (), {"_fingerprint": "0123456789abcdef"})()

        def __len__(self):
            return 100

    block = OmegaConf.create({"_component_": "d", "source": "someone/prompts", "split": "train"})
    saved = data_identity(block, Hub())
    assert saved["files"] == [] and saved["fingerprint"] == "0123456789abcdef"
    now = dict(saved, rows=90, fingerprint="fedcba9876543210")
    assert data_changes(saved, now) == [
        "'someone/prompts' split 'train': rows 100 -> 90, datasets fingerprint 0123456789ab... -> fedcba987654..."]


def _identities(tmp_path):
    path = _write(tmp_path / "prompts.json", [{"prompt": "a"}, {"prompt": "b"}])
    saved = data_identity(_block(path), Rows([0, 1]))
    _write(path, [{"prompt": "a"}])
    return path, saved, data_identity(_block(path), Rows([0]))


def test_a_resume_over_changed_data_is_refused_naming_the_file_and_the_way_on(tmp_path):
    path, saved, now = _identities(tmp_path)
    with pytest.raises(DataChangedError) as info:
        check_resumed_data(saved, now, checkpoint="/out/checkpoints/step_2", position="epoch 1, 2 batches in",
                           accept=False, log=log)
    message = str(info.value)
    assert message.startswith("dataset.data_files: the data changed since /out/checkpoints/step_2 was saved:\n"
                              f"  {str(path.resolve())!r}: rows 2 -> 1, size ")
    assert "(epoch 1, 2 batches in)" in message
    assert "set resume_accept_data_change=True" in message and "another output_dir" in message


def test_accepting_the_change_logs_a_warning(tmp_path, caplog):
    path, saved, now = _identities(tmp_path)
    with caplog.at_level(logging.INFO, logger=log.name):
        check_resumed_data(saved, now, checkpoint="ckpt", position="p", accept=True, log=log)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert str(path.resolve()) in record.message and "resume_accept_data_change=True" in record.message


def test_the_same_data_resume_without_a_word(tmp_path, caplog):
    path, saved, _ = _identities(tmp_path)
    with caplog.at_level(logging.INFO, logger=log.name):
        check_resumed_data(saved, saved, checkpoint="ckpt", position="p", accept=False, log=log)
    assert not caplog.records


def test_a_checkpoint_without_an_identity_resumes_with_a_note(tmp_path, caplog):
    _, _, now = _identities(tmp_path)
    with caplog.at_level(logging.INFO, logger=log.name):
        check_resumed_data(None, now, checkpoint="ckpt", position="p", accept=False, log=log)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "records no identity of its data" in record.message


def test_the_progress_state_carries_the_identity(tmp_path):
    _, saved, _ = _identities(tmp_path)
    progress = Progress(num_ppo_steps=2, batches_per_epoch=1, value_pretrain=ValuePretraining(0, None, 5, 1.0),
                        data_identity=saved)
    assert progress.state_dict()["data_identity"] == saved
    plain = Progress(num_ppo_steps=2, batches_per_epoch=1, value_pretrain=ValuePretraining(0, None, 5, 1.0))
    assert "data_identity" not in plain.state_dict()


# ---- the data moved unchanged ---------------------------------------------------------------


def test_files_moved_unchanged_are_the_same_data(tmp_path):
    from torchtune_ppo.data.identity import moved_files

    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    a = _write(tmp_path / "old/a.json", [{"prompt": "x"}])
    b = _write(tmp_path / "old/b.json", [{"prompt": "y"}, {"prompt": "z"}])
    saved = data_identity(_block(a, b), Rows([0, 1, 2]))
    moved = [(tmp_path / "new" / p.name) for p in (a, b)]
    for old, new in zip((a, b), moved):
        old.rename(new)
    assert data_changes(saved, data_identity(_block(*moved), Rows([0, 1, 2]))) == []
    assert moved_files(saved, _block(*moved)) == [(str(a.resolve()), str(moved[0].resolve())),
                                                  (str(b.resolve()), str(moved[1].resolve()))]
    # other bytes at the new path are not the saved data
    _write(moved[1], [{"prompt": "y"}, {"prompt": "Z"}])
    assert moved_files(saved, _block(*moved)) is None
    assert data_changes(saved, data_identity(_block(*moved), Rows([0, 1, 2]))) != []


def _saved_run(tmp_path, data_files, identity):
    """A checkpoint folder as a run saves it: its config and a training state with the data identity."""
    import torch

    from torchtune_ppo.checkpointing import resume_config as rc

    folder = tmp_path / "run/checkpoints/step_2"
    folder.mkdir(parents=True)
    config = {"batch_size": 8, "seed": 0, "output_dir": str(tmp_path / "run"),
              "dataset": {"_component_": "d", "source": "json", "data_files": data_files}}
    (folder / rc.CONFIG_FNAME).write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    torch.save({"data_identity": identity}, folder / rc.TRAINING_STATE_FNAME)
    return folder, config


def test_a_resume_over_the_data_moved_unchanged_is_taken_with_a_note(tmp_path, caplog):
    from torchtune_ppo.checkpointing import resume_config as rc

    path = _write(tmp_path / "prompts.json", [{"prompt": str(i)} for i in range(4)])
    folder, config = _saved_run(tmp_path, str(path), data_identity(_block(path), Rows(range(4))))
    moved = tmp_path / "elsewhere.json"
    path.rename(moved)
    new = {**config, "resume_from_checkpoint": True, "dataset": {**config["dataset"], "data_files": str(moved)}}
    with caplog.at_level(logging.INFO):
        assert rc.check_resume_config(folder, new) == []
    assert "at a new path (the same size and sha256" in caplog.text
    assert f"{path.resolve()} -> {moved.resolve()}" in caplog.text


def test_a_resume_over_other_data_at_a_new_path_is_refused_naming_no_path_that_is_gone(tmp_path):
    from torchtune_ppo.checkpointing import resume_config as rc

    path = _write(tmp_path / "prompts.json", [{"prompt": str(i)} for i in range(4)])
    identity = data_identity(_block(path), Rows(range(4)))
    folder, config = _saved_run(tmp_path, str(path), identity)
    moved = tmp_path / "elsewhere.json"
    path.rename(moved)
    _write(moved, [{"prompt": str(i)} for i in range(3)])  # and edited
    new = {**config, "batch_size": 4, "dataset": {**config["dataset"], "data_files": str(moved)}}
    with pytest.raises(rc.ResumeConfigError) as info:
        rc.check_resume_config(folder, new)
    message = str(info.value)
    assert f"  dataset.data_files: saved {str(path)!r}, now {str(moved)!r}" in message
    assert f"The saved data path {str(path)!r} no longer exists" in message
    assert f"prompts.json: {identity['files'][0]['size']} bytes, sha256 {identity['files'][0]['sha256'][:12]}..." in message
    # the way on names what can be given: the other key's saved value, not the path that is gone
    assert "batch_size=8" in message and f"dataset.data_files={path}" not in message
    # the saved path still there: it is the way on
    _write(path, json.loads(moved.read_text()))
    with pytest.raises(rc.ResumeConfigError) as info:
        rc.check_resume_config(folder, new)
    assert f"dataset.data_files={path}" in str(info.value) and "no longer exists" not in str(info.value)
