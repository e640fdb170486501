"""The PPO step benchmark in quick mode: torchtune's eager row and ours, one warm-up step and
one measured step each, interleaved, on the tiny task's models and (``--cpu-large --quick``)
on the larger random-weight ones.

Timings never decide a test. What is checked is the accounting, which a wrong seam or a wrong
sum would break: every configured step ran and was recorded, each phase was timed and fits
inside its step, the whole run holds every step, the rows took turns, and the speedups printed
are the medians of the per-pair ratios of the steps recorded; the report carries the machine
state and its headline verdict; and, for ``--cpu-large``, that both recipes trained the built
policy with the preset's stop tokens. The driver itself is tested on fake rows in
``tests/unit/test_interleave.py``.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
sys.path.insert(0, str(ROOT / "benchmarks/ppo"))  # the benchmark's package, ppo_bench

from ppo_bench.random_model import CPU_LARGE, num_params  # noqa: E402
from ppo_bench.rows import ROWS  # noqa: E402
from ppo_bench.summary import TIMED_PHASES  # noqa: E402

from bench_common.stats import pair_ratios  # noqa: E402

from torchtune_ppo.config import COMPILE_REGIONS, parse_compile  # noqa: E402


def run_quick(out, *extra):
    """Runs ``bench_ppo.py --quick`` (plus ``extra``); returns the report, its rows and markdown."""
    cmd = [sys.executable, str(ROOT / "benchmarks/ppo/bench_ppo.py"), "--quick", *extra, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in (out / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    report = json.loads((out / "ppo_bench.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("reason"), logs)
    return report, rows, (out / "ppo_bench.md").read_text()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick(tmp_path_factory.mktemp("bench_quick"))


@pytest.fixture(scope="module")
def quick_large(tmp_path_factory):
    return run_quick(tmp_path_factory.mktemp("bench_quick_large"), "--cpu-large")


def test_both_rows_ran_every_configured_step(quick):
    report, rows, _ = quick
    setup = report["setup"]
    assert list(rows) == ["tt_eager", "ours_eager"]
    num_steps = setup["warmup"] + setup["max_steps"]
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


def test_rows_took_turns(quick):
    report, rows, _ = quick
    # One step of each row a round, the order reversed in the next round.
    order = {r: [s["position"] for s in row["steps"]] for r, row in rows.items()}
    assert order == {"tt_eager": [0, 1], "ours_eager": [1, 0]}
    assert [s["round"] for s in rows["ours_eager"]["steps"]] == [0, 1]
    assert report["rounds"] == 2
    # --max-steps 1: one pair, too few for the interval test, and the report says so.
    assert report["stop"].startswith("CAP HIT: --max-steps 1")


def test_printed_speedup_is_the_median_of_per_pair_ratios(quick):
    report, rows, md = quick
    tt, ours = rows["tt_eager"], rows["ours_eager"]
    warmup = report["setup"]["warmup"]
    ratios = pair_ratios(tt["steps"], ours["steps"], "step_s", warmup)
    assert len(ratios) == 1
    assert ours["speedup_vs_row1"] == pytest.approx(statistics.median(ratios), rel=1e-12)
    assert ours["ratios_vs_row1"]["step_s"]["n"] == 1

    main_table = next(t for t in md.split("\n\n") if t.startswith("| # | row | step (s) |"))
    table = [line.strip("|").split("|") for line in main_table.splitlines()]
    head, body = [c.strip() for c in table[0]], table[2:]
    assert len(body) == len(rows)
    cells = [dict(zip(head, (c.strip() for c in line))) for line in body]
    assert cells[0]["row"] == tt["label"] and cells[1]["row"] == ours["label"]
    for line in cells:
        assert float(line["whole run (s)"]) > 0
    assert cells[0]["vs row 1"] == "1.00x"
    assert cells[1]["vs row 1"] == f"{ours['speedup_vs_row1']:.2f}x"
    # With one pair the median of per-pair ratios is the ratio of the two steps printed:
    # step times print to 3 decimals, speedups to 2.
    a, b = float(cells[0]["step (s)"]), float(cells[1]["step (s)"])
    lo, hi = (a - 5e-4) / (b + 5e-4), (a + 5e-4) / (b - 5e-4)
    assert lo - 5e-3 <= ours["speedup_vs_row1"] <= hi + 5e-3, (a, b, ours["speedup_vs_row1"])
    ratio_table = next(t for t in md.split("\n\n") if t.startswith("| # | row | pairs |"))
    assert f"| 2 | {ours['label']} | 1 | {ours['speedup_vs_row1']:.2f}x [" in ratio_table


def test_report_carries_the_machine_state(quick):
    report, _, md = quick
    machine, verdict = report["machine"], report["verdict"]
    for key in ("cpu", "cores", "threads", "torch", "torchtune", "commit", "loadavg_before", "loadavg_after"):
        assert machine[key] is not None, key
    assert isinstance(verdict["headline"], bool)
    assert ("**headline**" in md) == verdict["headline"]
    assert ("**NOT A HEADLINE**" in md) != verdict["headline"]
    assert report["machine_per_round"] and "foreign_cores" in report["machine_per_round"][0]


def test_token_counts_are_reported(quick):
    report, rows, md = quick
    t = report["setup"]["max_generated_tokens"]
    for name, row in rows.items():
        for step in row["steps"]:
            assert 1 <= step["response_len"] <= step["longest_response"] <= t, (name, step)
    # A padded or packed loss step runs on at least one slot per real token. torchtune's pads
    # every row to P' + T; ours logs its own ratio (none from a recipe without the metric).
    assert all(s["slots_per_token"] >= 1 for s in rows["tt_eager"]["steps"])
    assert all(s["slots_per_token"] is None or s["slots_per_token"] >= 1
               for s in rows["ours_eager"]["steps"])
    assert "| response len (longest) | loss slots/token | peak mem (MiB) |" in md


def test_cpu_large_trains_the_built_models_with_its_stop_tokens(quick_large):
    report, rows, md = quick_large
    setup = report["setup"]
    assert list(rows) == ["tt_eager", "ours_eager"]
    assert setup["stop_token_ids"] == list(CPU_LARGE.stop_token_ids)
    assert setup["max_generated_tokens"] == 16 and setup["warmup"] + setup["max_steps"] == 2
    assert "8-layer CPU model" in setup["model"] and "8-layer CPU model" in md
    for name, row in rows.items():
        # Both recipes loaded the random-weight checkpoint the benchmark wrote, not the tiny
        # task's 4-layer policy.
        assert row["policy_params"] == num_params(CPU_LARGE.policy), name
        assert [s["step"] for s in row["steps"]] == [1, 2], name
        assert all(1 <= s["response_len"] <= 16 for s in row["steps"]), name
        assert row["peak_memory_mib"] > 0 and row["recompiles"] == 0


def test_our_rows_name_every_compile_region():
    ours = {name: row for name, row in ROWS.items() if row.recipe == "ours"}
    assert ours
    for name, row in ours.items():
        block = row.overrides["compile"]
        assert set(COMPILE_REGIONS) <= set(block), name
        parse_compile(block)  # raises on a partial or invalid block
