"""A resume over a data file edited since the checkpoint was saved stops before training, naming
the file and what changed; ``resume_accept_data_change=True`` continues over it with a warning.
Through ``tune run``: a 2-step run of the tiny task on a copy of its prompts, saved, the copy
edited, then resumed."""

import json
import os
import shlex
import subprocess

import pytest

import torchtune_ppo
from torchtune_ppo.checkpointing import store

from conftest import ROOT, SMALL, TINY_CONFIG, TUNE

TIMEOUT = 900


def _tune(out, prompts, *overrides, rc=0):
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(TINY_CONFIG), f"output_dir={out}", *SMALL,
           f"dataset.data_files={prompts}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=TIMEOUT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == rc, f"{shlex.join(cmd)}\nrc={proc.returncode}\n{output[-6000:]}"
    return output


def _steps(out):
    return sorted(int(p.name[5:]) for p in (out / store.CHECKPOINTS_DIRNAME).glob("step_*"))


def test_an_edited_data_file_stops_the_resume_unless_accepted(tmp_path):
    with open(torchtune_ppo.asset_path("tiny_sentiment/prompts.json")) as f:
        records = json.load(f)[:20]  # 2 batches of 8 per epoch
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(records))
    out = tmp_path / "run"
    _tune(out, prompts, "num_ppo_steps=2")
    assert _steps(out) == [2]
    (saved,) = store.load_training_state(out / store.CHECKPOINTS_DIRNAME / "step_2")["data_identity"]["files"]
    assert saved["path"] == str(prompts.resolve()) and saved["size"] == prompts.stat().st_size

    prompts.write_text(json.dumps(records[:19]))  # one prompt less: still 2 batches of 8
    refused = _tune(out, prompts, "num_ppo_steps=3", "resume_from_checkpoint=True", rc=1)
    assert "dataset.data_files: the data changed since" in refused
    assert f"{str(prompts.resolve())!r}: rows 20 -> 19, size {saved['size']} -> {prompts.stat().st_size} bytes" in refused
    assert "resume_accept_data_change=True" in refused
    assert "Step 3" not in refused and _steps(out) == [2]  # stopped before training

    accepted = _tune(out, prompts, "num_ppo_steps=3", "resume_from_checkpoint=True", "resume_accept_data_change=True")
    assert "Continuing over the changed data, as resume_accept_data_change=True asks." in accepted
    assert _steps(out) == [2, 3]
    (now,) = store.load_training_state(out / store.CHECKPOINTS_DIRNAME / "step_3")["data_identity"]["files"]
    assert now["size"] == prompts.stat().st_size and now["sha256"] != saved["sha256"]
