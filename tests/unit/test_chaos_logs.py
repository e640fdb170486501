"""How ``tools/chaos.py`` reads a faulted run's logs: the rows of the steps and of the
evaluations apart (an evaluation's ``val/`` row, logged at the step it followed, never stands for
that step's metrics), the last row of each over the attempts, and a row one process logged twice."""

import os
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import chaos  # noqa: E402


def _write(logs, name: str, lines, mtime: int) -> None:
    path = logs / name
    path.write_text("".join(f"{line}\n" for line in lines))
    os.utime(path, (mtime, mtime))


def test_steps_and_evaluations_are_read_apart_the_last_row_of_each_winning(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # The first process: the evaluation before training, steps 1-2, killed in the evaluation after step 2.
    _write(logs, "log_1.txt", ["Step 0 | val/reward_mean:0.5 time/eval:0.1", "Step 1 | loss:1.0 kl:0.1",
                               "Step 2 | loss:2.0 kl:0.2"], 100)
    # The resumed one: the evaluation after step 2 again, then step 3.
    _write(logs, "log_2.txt", ["Step 2 | val/reward_mean:0.75 time/eval:0.2", "Step 3 | loss:3.0 kl:0.3"], 200)
    steps, evals = chaos.logged_metrics(tmp_path)
    assert steps == {1: {"loss": "1.0", "kl": "0.1"}, 2: {"loss": "2.0", "kl": "0.2"}, 3: {"loss": "3.0", "kl": "0.3"}}
    assert evals == {0: {"val/reward_mean": "0.5", "time/eval": "0.1"},
                     2: {"val/reward_mean": "0.75", "time/eval": "0.2"}}
    assert chaos.logged_twice(tmp_path) == []  # step 2 and its evaluation, each once a process


def test_a_row_one_process_logs_twice_is_found(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    _write(logs, "log_1.txt", ["Step 1 | loss:1.0", "Step 2 | loss:2.0", "Step 2 | val/reward_mean:0.5",
                               "Step 2 | val/reward_mean:0.5"], 100)
    _write(logs, "log_2.txt", ["Step 1 | loss:1.0", "Step 1 | loss:1.0"], 200)
    assert chaos.logged_twice(tmp_path) == [f"{tmp_path}: process 1 logged the evaluation after step 2 twice",
                                            f"{tmp_path}: process 2 logged step 1 twice"]
