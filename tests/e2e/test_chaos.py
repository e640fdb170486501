"""A tiny run that evaluates as it trains, hit by faults (SIGKILL inside the evaluation after
step 2, SIGKILL inside a save, a reward that raises, its data file edited before a resume, a full
disk, SIGHUP), resumed after each, ends with the metrics, the evaluations and the weights of an
uninterrupted run, and never leaves a half-written or non-finite checkpoint.

``tools/chaos.py`` is the long version (random faults; see its docstring). This one takes
~3 minutes on 2 CPU cores (8 process starts of ~10 s, plus the steps).
"""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_a_run_under_faults_ends_as_the_uninterrupted_run(tmp_path):
    sequence = "sigkill_during_eval,sigkill_during_save,reward_raises,data_edit,full_disk,sighup"
    cmd = [sys.executable, str(ROOT / "tools/chaos.py"), "--steps", "4", "--seed", "0",
           "--sequence", sequence, "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    result = json.loads((tmp_path / "result.json").read_text()) if (tmp_path / "result.json").exists() else None
    assert proc.returncode == 0 and result is not None, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result["problems"] == [] and result["steps"] == 4
    # Every fault was applied (after a run that reaches its end, the rest hit a new run).
    assert result["faults"] == 6, proc.stdout
    # The seed puts the kill inside the second evaluation, after step 2 (the checkpoint of step 2
    # written before it): the resume evaluates step 2 again, and the comparison reads its row.
    assert re.search(r"fault 1: sigkill_during_eval:evaluation 2, batch \d \(after step 2\): rc=-9", proc.stdout), \
        proc.stdout
    assert "evaluated after steps [0, 2, 4]" in proc.stdout, proc.stdout
    assert "data_edit: rc=1" in proc.stdout, proc.stdout  # refused: a checkpoint was there to resume
