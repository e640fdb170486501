"""The interleaved benchmark driver, on fake rows with scripted step times (no PPO, no torch).

Checked: the rows take turns one step at a time with the order reversed every round; warm-up
rounds stay out of the ratios; the ratio reported is the median of per-pair ratios (which
differs from the ratio of medians on the data here), with the order-statistics interval; the
run stops at the target width or says it hit the cap; the worker protocol carries steps and
the whole-run time through real processes; the headline rule reads the machine figures.
"""

import statistics
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks/ppo"))

from bench_common.interleave import RowFailed, round_order, run_interleaved  # noqa: E402
from bench_common.machine import headline_verdict  # noqa: E402
from bench_common.protocol import WorkerRow  # noqa: E402
from bench_common.stats import median_interval, pair_ratios, summarize_ratios  # noqa: E402


class FakeRow:
    """Returns the scripted step times in turn and logs each call in ``calls``."""

    def __init__(self, name, times, calls, fail_at=None):
        self.name, self.times, self.calls, self.fail_at = name, list(times), calls, fail_at

    def step(self, timeout=None):
        i = sum(1 for c in self.calls if c == self.name)
        self.calls.append(self.name)
        if i == self.fail_at:
            raise RowFailed("error", "scripted failure")
        return {"step_s": self.times[i], "generate": self.times[i] / 2}


def first(steps):
    return next(iter(steps))


def quiet(_line):
    pass


def test_rows_alternate_one_step_at_a_time_and_reverse_each_round():
    calls = []
    rows = {n: FakeRow(n, [1.0] * 10, calls) for n in "AB"}
    run_interleaved(rows, warmup=1, max_steps=4, min_steps=99, reference=first, log=quiet)
    assert calls == list("ABBAABBAAB")
    calls.clear()
    rows = {n: FakeRow(n, [1.0] * 10, calls) for n in "ABC"}
    run = run_interleaved(rows, warmup=0, max_steps=3, min_steps=99, reference=first, log=quiet)
    assert calls == list("ABCCBAABC")
    assert round_order(["A", "B", "C"], 1) == ["C", "B", "A"]
    # Each step knows its round and its place in it.
    assert [(s["round"], s["position"]) for s in run.steps["C"]] == [(0, 2), (1, 0), (2, 2)]


def test_ratio_is_the_median_of_per_pair_ratios_not_the_ratio_of_medians():
    # Round 0 is warm-up (a compile: 50 s); it must not enter the ratios.
    a = [50.0, 1.0, 2.0, 3.0, 10.0, 4.0]
    b = [1.0, 2.0, 1.5, 2.0, 4.0, 8.0]
    calls = []
    rows = {"A": FakeRow("A", a, calls), "B": FakeRow("B", b, calls)}
    run = run_interleaved(rows, warmup=1, max_steps=5, min_steps=99, reference=first, log=quiet)
    ratios = pair_ratios(run.steps["A"], run.steps["B"], "step_s", first_round=1)
    assert ratios == pytest.approx([0.5, 4 / 3, 1.5, 2.5, 0.5])
    s = summarize_ratios(ratios)
    assert s["median"] == pytest.approx(4 / 3)
    assert statistics.median(a[1:]) / statistics.median(b[1:]) == pytest.approx(1.5)  # not this
    assert (s["min"], s["max"], s["n"]) == (0.5, 2.5, 5)
    # Five pairs: min-max is the widest interval there is, covering 1 - 2/32 of the time.
    assert (s["low"], s["high"]) == (0.5, 2.5) and s["coverage"] == pytest.approx(1 - 2 / 32)
    assert run.stop == "max steps"


def test_order_statistics_interval_of_the_median():
    xs = list(range(1, 11))  # n = 10: [x_2, x_9] covers 1 - 2 * 11/1024; [x_3, x_8] too little
    assert median_interval(xs) == (2, 9, pytest.approx(1 - 22 / 1024))
    assert median_interval([3, 1, 2, 6, 5, 4]) == (1, 6, pytest.approx(1 - 2 / 64))
    lo, hi, cov = median_interval([1.0])
    assert (lo, hi, cov) == (1.0, 1.0, 0.0)


def test_stops_once_every_interval_is_narrow():
    calls = []
    # B is exactly twice as fast in every pair, whatever the machine does to both.
    load = [1.0, 3.0, 1.5, 2.5, 1.0, 4.0, 2.0, 1.2, 3.3, 1.1] * 3
    rows = {"A": FakeRow("A", [2 * x for x in load], calls), "B": FakeRow("B", load, calls)}
    run = run_interleaved(rows, warmup=2, max_steps=20, min_steps=6, target_width=0.05,
                          reference=first, log=quiet)
    assert run.stop == "target width" and run.measured == 6 and run.rounds == 8
    assert run.widths == {"B": pytest.approx(0.0)}
    assert "stopped after 6 measured pairs" in run.describe_stop(0.05, 20)


def test_says_when_the_cap_was_hit():
    calls = []
    a = [1.0, 1.3, 0.8, 1.2, 0.9, 1.4, 0.7, 1.1, 1.0, 1.25] * 2
    rows = {"A": FakeRow("A", a, calls), "B": FakeRow("B", [1.0] * 20, calls)}
    run = run_interleaved(rows, warmup=1, max_steps=8, min_steps=6, target_width=0.05,
                          reference=first, log=quiet)
    assert run.stop == "max steps" and run.measured == 8
    assert run.describe_stop(0.05, 8).startswith("CAP HIT: --max-steps 8")


def test_a_failed_row_leaves_the_schedule():
    calls = []
    rows = {n: FakeRow(n, [1.0] * 10, calls, fail_at=2 if n == "B" else None) for n in "ABC"}
    run = run_interleaved(rows, warmup=0, max_steps=4, min_steps=99, reference=first, log=quiet)
    assert run.failed == {"B": {"status": "error", "reason": "scripted failure"}}
    assert calls == list("ABC" "CBA" "ABC" "CA")  # B fails in round 2; A and C go on
    assert len(run.steps["A"]) == 4 and len(run.steps["B"]) == 2


def test_time_budget_stops_the_run():
    now = [0.0]

    class Slow(FakeRow):
        def step(self, timeout=None):
            now[0] += 10.0
            return super().step(timeout)

    calls = []
    rows = {n: Slow(n, [1.0] * 10, calls) for n in "AB"}
    run = run_interleaved(rows, warmup=0, max_steps=9, reference=first, budget_s=35.0,
                          clock=lambda: now[0], log=quiet)
    assert run.stop == "time budget" and run.rounds == 2


# A worker process speaking the protocol, with scripted step times and a noisy stdout.
FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from bench_common.protocol import serve

    class Row:
        info = {"threads": 1}

        def run(self, on_step):
            print("a row may print; it goes to its log")
            for i, t in enumerate(json.loads(sys.argv[2])):
                on_step({"step": i + 1, "step_s": t, "generate": t / 2})

        def finish(self):
            return {"policy_params": 7}

    serve(Row)
""")


def fake_worker(tmp_path, name, times):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    import json
    import os

    cmd = [sys.executable, str(script), str(ROOT / "benchmarks"), json.dumps(times)]
    return WorkerRow(name, [(cmd, dict(os.environ))], tmp_path)


def test_workers_over_the_protocol_give_the_median_of_per_pair_ratios(tmp_path):
    from ppo_bench.running import fastest_torchtune
    from ppo_bench.summary import add_ratios, summarize

    tt = [9.0, 1.0, 2.0, 3.0, 10.0, 4.0]
    ours = [5.0, 2.0, 1.5, 2.0, 4.0, 8.0]
    rows = {"tt_kv": fake_worker(tmp_path, "tt_kv", tt), "ours_all": fake_worker(tmp_path, "ours_all", ours)}
    for w in rows.values():
        w.start()
        assert w.ready(timeout=60)["threads"] == 1
    run = run_interleaved(rows, warmup=1, max_steps=5, min_steps=99,
                          reference=lambda steps: fastest_torchtune(steps, 1), log=quiet)
    done = {n: w.stop()[0] for n, w in rows.items()}
    assert {n: d["steps_run"] for n, d in done.items()} == {"tt_kv": 6, "ours_all": 6}
    # The whole run is the row's own time: its steps' times, not the other row's turns.
    assert all(0 <= d["whole_run_s"] < 30 for d in done.values())
    assert "a row may print" in (tmp_path / "tt_kv.log").read_text()
    summaries = []
    for name, steps in run.steps.items():
        for s in steps:  # what summarize needs of a real step
            s.update(score=0.0, advantages=0.0, loss_step=0.1, optimizer=0.1, prompt_len=1,
                     recompiles=0, graphs=0, response_len=1.0)
        summaries.append(summarize(name, name, {"status": "ok", "steps": steps, **done[name],
                                                "peak_memory_mib": 1, "peak_memory_kind": "-"},
                                   warmup=1, batch_size=1, gen_tokens=1, ppo_epochs=1))
    assert add_ratios(summaries, warmup=1) == "tt_kv"
    ours_row = summaries[1]
    assert ours_row["speedup_vs_fastest_torchtune"] == pytest.approx(4 / 3)  # median of 0.5, 4/3, 1.5, 2.5, 0.5
    assert ours_row["step_s"] == statistics.median(ours[1:])
    assert ours_row["ratios_vs_fastest_torchtune"]["generate"]["median"] == pytest.approx(4 / 3)


def test_a_worker_that_dies_is_reported(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys; print('boom', file=sys.stderr); sys.exit(3)\n")
    import os

    w = WorkerRow("dead", [([sys.executable, str(script)], dict(os.environ))], tmp_path)
    w.start()
    with pytest.raises(RowFailed, match="exit 3: boom"):
        w.ready(timeout=60)


def test_headline_rule():
    quiet_total = {"wall_s": 100.0, "busy_cores": 1.1, "own_cores": 1.0, "foreign_cores": 0.1}
    samples = [{"t": t, "foreign_cores": 0.1, "load_1min": 1.2} for t in (10.0, 70.0, 100.0)]
    v = headline_verdict(quiet_total, samples, threads=1)
    assert v["headline"] and v["load_1min_max_checked"] == 1.2
    busy = dict(quiet_total, foreign_cores=0.9)
    assert not headline_verdict(busy, samples, threads=1)["headline"]
    # Load above threads + 0.5 after the first minute fails; before it, the warm-up's own
    # compile load may still be in the average, and is not held against the run.
    loaded = [dict(s, load_1min=2.0) for s in samples]
    assert not headline_verdict(quiet_total, loaded, threads=1)["headline"]
    early = [dict(samples[0], load_1min=3.0)]
    v = headline_verdict(quiet_total, early, threads=1)
    assert v["headline"] and "not applied" in v["notes"][0]


class CompilingRow(FakeRow):
    """A fake row whose steps report a running count of compiled graphs."""

    def __init__(self, name, times, graphs, calls):
        super().__init__(name, times, calls)
        self.graphs = list(graphs)

    def step(self, timeout=None):
        i = sum(1 for c in self.calls if c == self.name)
        return {**super().step(timeout), "graphs": self.graphs[i]}


def test_warm_up_goes_on_while_a_row_compiles_up_to_the_settle_cap():
    calls = []
    # B compiles in rounds 0, 1 and 3 (its count of graphs grows), then no more.
    rows = {"A": CompilingRow("A", [1.0] * 12, [3] * 12, calls),
            "B": CompilingRow("B", [2.0] * 12, [5, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7], calls)}
    run = run_interleaved(rows, warmup=2, max_steps=3, settle=10, min_steps=99, reference=first, log=quiet)
    # Rounds 0-1 planned; B compiled in round 1 -> round 2 added; not in round 2 -> measuring
    # starts at round 3 (B's compile in round 3 is measured: the settle test only looks back
    # at the last warm-up round).
    assert run.warmup == 3 and run.settling == []
    assert [s["warmup"] for s in run.steps["B"]] == [True, True, True, False, False, False]
    assert run.rounds == 6 and run.measured == 3
    # The cap: B compiles every step; at most 2 rounds are added.
    calls.clear()
    rows = {"A": CompilingRow("A", [1.0] * 12, [3] * 12, calls),
            "B": CompilingRow("B", [2.0] * 12, list(range(1, 13)), calls)}
    run = run_interleaved(rows, warmup=1, max_steps=2, settle=2, min_steps=99, reference=first, log=quiet)
    assert run.warmup == 3 and run.settling == ["B"] and run.measured == 2
    # settle=0 keeps the planned warm-up whatever compiles.
    calls.clear()
    rows = {"A": CompilingRow("A", [1.0] * 12, [3] * 12, calls),
            "B": CompilingRow("B", [2.0] * 12, list(range(1, 13)), calls)}
    run = run_interleaved(rows, warmup=1, max_steps=2, min_steps=99, reference=first, log=quiet)
    assert run.warmup == 1 and run.measured == 2
