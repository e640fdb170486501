"""Reading back the metrics a run wrote with torchtune's ``DiskLogger``.

A run logs one row per step, and one more row per evaluation (its ``val/`` metrics, at the
step it was taken, 0 before training): :func:`read_disk_log` returns the steps' rows,
:func:`read_eval_log` the evaluations'.
"""

from pathlib import Path
from typing import Dict, List, Tuple, Union


def _rows(log_dir: Union[str, Path]) -> List[Tuple[int, Dict[str, float]]]:
    """``(step, {metric: value})`` of every row of the newest ``log_*.txt``, in order."""
    files = sorted(Path(log_dir).glob("log_*.txt"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no DiskLogger file (log_*.txt) in {str(log_dir)!r}.")
    rows = []
    for line in files[-1].read_text().splitlines():
        if line.startswith("Step "):
            head, payload = line.split(" | ", 1)
            rows.append((int(head.split()[1]), {k: float(v) for k, v in (item.split(":", 1) for item in payload.split())}))
    return rows


def _is_eval(row: Dict[str, float]) -> bool:
    return any(k.startswith("val/") for k in row)


def read_disk_log(log_dir: Union[str, Path]) -> List[Dict[str, float]]:
    """One ``{metric: value}`` dict per logged step, in order, from the newest ``log_*.txt``
    (the evaluations' rows left out)."""
    return [row for _, row in _rows(log_dir) if not _is_eval(row)]


def read_eval_log(log_dir: Union[str, Path]) -> List[Tuple[int, Dict[str, float]]]:
    """``(step, {metric: value})`` of each evaluation, in order, from the newest ``log_*.txt``."""
    return [(step, row) for step, row in _rows(log_dir) if _is_eval(row)]
