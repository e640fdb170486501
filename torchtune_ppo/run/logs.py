"""Reading back the metrics a run wrote with torchtune's ``DiskLogger``."""

from pathlib import Path
from typing import Dict, List, Union


def read_disk_log(log_dir: Union[str, Path]) -> List[Dict[str, float]]:
    """One ``{metric: value}`` dict per logged step, in order, from the newest ``log_*.txt``."""
    files = sorted(Path(log_dir).glob("log_*.txt"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no DiskLogger file (log_*.txt) in {str(log_dir)!r}.")
    rows = []
    for line in files[-1].read_text().splitlines():
        if line.startswith("Step "):
            payload = line.split(" | ", 1)[1]
            rows.append({k: float(v) for k, v in (item.split(":", 1) for item in payload.split())})
    return rows
