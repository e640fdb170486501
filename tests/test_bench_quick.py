"""The PPO step benchmark runs end to end in quick mode (two rows, two tiny steps).

Only the shape of the report is checked: timings never decide a test.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
NUMBERS = (
    "step_s", "generate", "score", "advantages", "loss_step", "optimizer", "other",
    "trajectory_tok_s", "ppo_tok_s", "first_step_s", "compile_s", "peak_memory_mib",
    "speedup_vs_row1", "speedup_vs_fastest_torchtune",
)


def test_bench_quick(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_ppo.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"

    report = json.loads((tmp_path / "ppo_bench.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["tt_eager", "ours_eager"]
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("reason"), logs)
        for key in NUMBERS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (name, key, row[key])
        assert row["step_s"] > 0 and row["generate"] > 0
        assert isinstance(row["recompiles"], int) and row["recompiles"] >= 0
        assert len(row["steps"]) == 2  # one warm-up + one measured step
    assert rows["tt_eager"]["speedup_vs_row1"] == 1.0

    md = (tmp_path / "ppo_bench.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, rule, one line per row
    assert "torchtune, eager, no KV cache" in table[2] and "ours, eager" in table[3]
