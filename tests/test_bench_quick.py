"""The PPO step benchmark in quick mode: torchtune's eager row and ours, one warm-up step and
one measured step each.

Timings never decide a test. What is checked is the accounting, which a wrong seam or a wrong
sum would break: every configured step ran and was recorded, each phase was timed and fits
inside its step, the whole run holds every step, and the speedups printed are the ratios of
the medians printed.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark's package, ppo_bench

from ppo_bench.rows import ROWS  # noqa: E402
from ppo_bench.summary import TIMED_PHASES  # noqa: E402

from torchtune_ppo.config import COMPILE_REGIONS, parse_compile  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_quick")
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_ppo.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in (out / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    report = json.loads((out / "ppo_bench.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("reason"), logs)
    return report, rows, (out / "ppo_bench.md").read_text()


def test_both_rows_ran_every_configured_step(quick):
    report, rows, _ = quick
    setup = report["setup"]
    assert list(rows) == ["tt_eager", "ours_eager"]
    num_steps = setup["warmup"] + setup["steps"]
    assert num_steps == 2
    for name, row in rows.items():
        assert [s["step"] for s in row["steps"]] == list(range(1, num_steps + 1)), name
        assert row["num_steps"] == num_steps
        # Eager rows compile nothing, in the first step or after.
        assert [s["graphs"] for s in row["steps"]] == [0] * num_steps, name
        assert row["recompiles"] == 0
    # Ours pads every batch to max_prompt_len; torchtune to the batch's longest prompt.
    assert {s["prompt_len"] for s in rows["ours_eager"]["steps"]} == {setup["max_prompt_len"]}
    assert all(0 < s["prompt_len"] <= setup["max_prompt_len"] for s in rows["tt_eager"]["steps"])


def test_phases_are_timed_and_fit_inside_their_step(quick):
    _, rows, _ = quick
    for name, row in rows.items():
        for step in row["steps"]:
            phases = {p: step[p] for p in TIMED_PHASES}
            # Every phase runs in an eager step (score too: no compile.rollout here), so a
            # zero means a seam that stopped timing it.
            assert all(t > 0 for t in phases.values()), (name, phases)
            assert sum(phases.values()) <= step["step_s"], (name, phases, step["step_s"])
            assert step["other"] == pytest.approx(step["step_s"] - sum(phases.values()))
        warmup = len(row["steps"]) - 1
        measured = row["steps"][warmup:]
        assert row["step_s"] == statistics.median(s["step_s"] for s in measured)
        assert row["first_step_s"] == row["steps"][0]["step_s"]


def test_whole_run_holds_every_step(quick):
    _, rows, _ = quick
    for name, row in rows.items():
        assert row["whole_run_s"] >= sum(s["step_s"] for s in row["steps"]), name


def test_printed_speedup_is_the_ratio_of_printed_medians(quick):
    _, rows, md = quick
    tt, ours = rows["tt_eager"], rows["ours_eager"]
    assert ours["speedup_vs_row1"] == pytest.approx(tt["step_s"] / ours["step_s"], rel=1e-12)

    table = [line.strip("|").split("|") for line in md.splitlines() if line.startswith("|")]
    head, body = [c.strip() for c in table[0]], table[2:]
    assert len(body) == len(rows)
    cells = [dict(zip(head, (c.strip() for c in line))) for line in body]
    assert cells[0]["row"] == tt["label"] and cells[1]["row"] == ours["label"]
    a, b = float(cells[0]["step (s)"]), float(cells[1]["step (s)"])
    for line in cells:
        assert float(line["whole run (s)"]) > 0
    printed = float(cells[1]["vs row 1"].rstrip("x"))
    # Step times print to 3 decimals, speedups to 2: the bounds of the ratio of the true
    # values behind the printed ones, widened by the speedup's own rounding.
    lo, hi = (a - 5e-4) / (b + 5e-4), (a + 5e-4) / (b - 5e-4)
    assert lo - 5e-3 <= printed <= hi + 5e-3, (a, b, printed)
    assert cells[0]["vs row 1"] == "1.00x"


def test_our_rows_name_every_compile_region():
    ours = {name: row for name, row in ROWS.items() if row.recipe == "ours"}
    assert ours
    for name, row in ours.items():
        block = row.overrides["compile"]
        assert set(COMPILE_REGIONS) <= set(block), name
        parse_compile(block)  # raises on a partial or invalid block
