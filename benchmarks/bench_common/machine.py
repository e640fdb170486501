"""The machine a result was measured on, and whether it was quiet enough for a headline.

Recorded with every result: CPU model and cores, the threads the benchmark itself runs, torch
and torchtune versions, the git commit (``+dirty`` when tracked files differ), load averages
before and after, and, over the measured steps, the CPU time that *other* processes used.

A fair test of "another CPU-bound process ran during the measurement": the 1-minute load
average alone cannot tell, since it lags by a minute (a run's own compile workers still show in
it when the measured steps begin) and counts the benchmark's own threads. So two checks, and a
result is a headline only if both pass:

1. Other processes' CPU use during the measured steps: the busy time of all CPUs
   (``/proc/stat``: user, nice, system, irq, softirq and steal, i.e. a neighbour VM's share
   too) less the CPU time of this process and all its descendants (the row workers, their
   compile workers, ranks), per second of wall time. More than ``FOREIGN_CORES_LIMIT`` (half a
   core) on average fails.
2. The 1-minute load average, sampled after every measured round from the point where the
   warm-up's own load has decayed (60 s, the average's time constant, after the measured steps
   began), against the benchmark's own threads + 0.5. With fewer than 60 s of measured steps
   this check has no sample and only the first decides (the report says so).
"""

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

FOREIGN_CORES_LIMIT = 0.5
LOAD_MARGIN = 0.5
LOAD_SETTLE_S = 60.0


def loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU model name (``lscpu``, else ``/proc/cpuinfo``, else ``platform``)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next(l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def git_commit(root: Path) -> str:
    """``HEAD``'s short hash, ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git metadata)"


def machine_info(root: Path, threads: int) -> Dict[str, Any]:
    """What the result was measured on; ``threads`` is the most CPU threads a row runs at once."""
    import torch

    try:
        import torchtune

        torchtune_version = torchtune.__version__
    except ImportError:
        torchtune_version = None
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
        "torch": torch.__version__, "torchtune": torchtune_version,
        "python": platform.python_version(), "commit": git_commit(root),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _busy_ticks() -> Optional[int]:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal (guest is inside user)
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _tree_ticks(root_pid: int) -> Optional[int]:
    """CPU ticks of ``root_pid`` and its live descendants (with the children each has reaped)."""
    stats = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        rest = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        ppid = int(rest[1])
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
        stats[pid] = (ppid, utime + stime + cutime + cstime)
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo += children.get(pid, [])
    return total


class CpuMeter:
    """Other processes' CPU use, in cores, between ``start()`` and each ``sample()``."""

    def __init__(self, root_pid: Optional[int] = None):
        self.root_pid = root_pid or os.getpid()
        self.tck = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.first = self.last = None

    def _read(self) -> Tuple[float, Optional[int], Optional[int]]:
        return time.perf_counter(), _busy_ticks(), _tree_ticks(self.root_pid)

    def start(self) -> None:
        self.first = self.last = self._read()

    def _between(self, a, b) -> Dict[str, Optional[float]]:
        wall = b[0] - a[0]
        if a[1] is None or a[2] is None or wall <= 0:
            return {"wall_s": wall, "busy_cores": None, "own_cores": None, "foreign_cores": None}
        busy = (b[1] - a[1]) / self.tck / wall
        own = (b[2] - a[2]) / self.tck / wall
        return {"wall_s": wall, "busy_cores": busy, "own_cores": own,
                "foreign_cores": max(0.0, busy - own)}

    def sample(self) -> Dict[str, Any]:
        """Since the last sample: wall time, all CPUs' busy cores, ours, others'; the 1-min load."""
        now = self._read()
        out = self._between(self.last, now)
        self.last = now
        load = loadavg()
        out["load_1min"] = load[0] if load else None
        return out

    def total(self) -> Dict[str, Optional[float]]:
        """The same, from ``start()`` to the last sample."""
        if self.first is None:
            return {"wall_s": 0.0, "busy_cores": None, "own_cores": None, "foreign_cores": None}
        return self._between(self.first, self.last)


def headline_verdict(total: Dict[str, Optional[float]], samples: List[Dict[str, Any]],
                     threads: int) -> Dict[str, Any]:
    """Whether the measured steps ran on a quiet enough machine (see the module docstring).

    Args:
        total (Dict[str, Optional[float]]): ``CpuMeter.total()`` over the measured steps.
        samples (List[Dict[str, Any]]): one ``CpuMeter.sample()`` per measured round, each with
            ``t``, seconds since the measured steps began.
        threads (int): the most CPU threads the benchmark runs at once.

    Returns:
        Dict[str, Any]: ``headline`` (bool), ``reasons`` (why not), ``notes``, and the figures.
    """
    reasons, notes = [], []
    foreign = total.get("foreign_cores")
    if foreign is None:
        reasons.append("other processes' CPU use could not be measured (no /proc)")
    elif foreign > FOREIGN_CORES_LIMIT:
        reasons.append(f"other processes used {foreign:.2f} cores on average during the measured "
                       f"steps (limit {FOREIGN_CORES_LIMIT})")
    per_round = [s["foreign_cores"] for s in samples if s.get("foreign_cores") is not None]
    late = [s["load_1min"] for s in samples if s["t"] >= LOAD_SETTLE_S and s.get("load_1min") is not None]
    load_limit = threads + LOAD_MARGIN
    if late and max(late) > load_limit:
        reasons.append(f"1-min load average reached {max(late):.2f} during the measured steps "
                       f"(limit: {threads} threads of its own + {LOAD_MARGIN})")
    if not late:
        notes.append(f"load-average check not applied: the measured steps lasted less than "
                     f"{LOAD_SETTLE_S:.0f} s, and the load average still held the warm-up")
    return {
        "headline": not reasons, "reasons": reasons, "notes": notes, "threads": threads,
        "foreign_cores_mean": foreign, "foreign_cores_max_round": max(per_round) if per_round else None,
        "own_cores_mean": total.get("own_cores"), "measured_wall_s": total.get("wall_s"),
        "load_limit": load_limit, "load_1min_max_checked": max(late) if late else None,
    }


def verdict_lines(machine: Dict[str, Any], verdict: Dict[str, Any]) -> List[str]:
    """Markdown bullets: the machine, and HEADLINE or NOT A HEADLINE with the reasons."""
    def f(x, fmt=".2f"):
        return "-" if x is None else format(x, fmt)

    lines = [
        f"- machine: {machine['cpu']}, {machine['cores']} cores; CPU threads the benchmark runs at "
        f"once: {machine['threads']}; torch {machine['torch']}, torchtune {machine['torchtune']}, "
        f"Python {machine['python']}; commit {machine['commit']}; {machine['date']}",
        f"- load average (1/5/15 min) before: {machine.get('loadavg_before')}, after: "
        f"{machine.get('loadavg_after')}; other processes' CPU during the measured steps: "
        f"{f(verdict['foreign_cores_mean'])} cores on average, {f(verdict['foreign_cores_max_round'])} "
        f"in the busiest round (ours: {f(verdict['own_cores_mean'])}) over "
        f"{f(verdict['measured_wall_s'], '.0f')} s",
    ]
    if verdict["headline"]:
        lines.append("- **headline**: no other CPU-bound process during the measured steps")
    else:
        lines.append("- **NOT A HEADLINE**: " + "; ".join(verdict["reasons"]))
    lines += [f"- {n}" for n in verdict["notes"]]
    return lines
