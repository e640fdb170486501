"""Watching a run: sampled responses, an end-of-run summary, and a plot of the logged metrics.

    python -m torchtune_ppo.run.watch <output_dir> [--out run.png]

draws reward, KL, response length and step time against the step from the run's DiskLogger
file (``<output_dir>/logs``) into one PNG (matplotlib, ``pip install matplotlib``).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from torchtune_ppo.run.logs import read_disk_log
from torchtune_ppo.rlhf import Trajectory

SAMPLES_FILE = "samples.jsonl"
# (metric key, panel title) of each panel of the plot.
PANELS = (
    ("scores", "reward (mean score)"),
    ("kl", "KL to the reference policy"),
    ("response_lengths", "response length (tokens)"),
    ("time/step", "step time (s)"),
)


def sample_rows(
    trajectory: Trajectory, prompt_lens: torch.Tensor, tokenizer: Any, prompt_len: int, n: int
) -> List[Dict[str, Any]]:
    """The first ``n`` rows of a step as text: prompt, response (up to its stop token), score.

    Args:
        trajectory (Trajectory): the step's scored batch.
        prompt_lens (torch.Tensor): ``[B]`` real tokens of each prompt.
        tokenizer (Any): has ``decode(ids) -> str``.
        prompt_len (int): ``P``.
        n (int): rows to take.

    Returns:
        List[Dict[str, Any]]: ``{"prompt", "response", "score"}`` per row.
    """
    rows = trajectory.query_responses[:n].tolist()
    lens, seq_lens = prompt_lens[:n].tolist(), trajectory.seq_lens[:n].tolist()
    scores = trajectory.scores[:n].tolist()
    return [
        {
            "prompt": tokenizer.decode(row[prompt_len - p : prompt_len]),
            "response": tokenizer.decode(row[prompt_len : prompt_len + s]),
            "score": score,
        }
        for row, p, s, score in zip(rows, lens, seq_lens, scores)
    ]


def log_samples(rows: Sequence[Dict[str, Any]], step: int, log_dir: Optional[str], log) -> None:
    """Prints the samples, appends them to ``<log_dir>/samples.jsonl``, and sends them to
    Weights & Biases as a table when a wandb run is active (torchtune's loggers have no table)."""
    for row in rows:
        log.info(f"step {step} | score {row['score']:+.3f} | {row['prompt']!r} -> {row['response']!r}")
    if log_dir is not None:
        path = Path(log_dir) / SAMPLES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
    wandb = sys.modules.get("wandb")  # only when the run already uses it
    if wandb is not None and getattr(wandb, "run", None) is not None:
        table = wandb.Table(columns=["prompt", "response", "score"],
                            data=[[r["prompt"], r["response"], r["score"]] for r in rows])
        wandb.log({"samples": table}, step=step)


def progress(metrics: Dict[str, float]) -> Dict[str, str]:
    """The progress bar's postfix: mean score, KL and the seconds of each phase group."""
    return {
        "reward": f"{metrics['scores']:.3f}",
        "kl": f"{metrics['kl']:.3f}",
        "gen": f"{metrics['time/generate']:.2f}s",
        "score": f"{metrics.get('time/score', 0.0) + metrics.get('time/reward', 0.0):.2f}s",
        "ppo": f"{metrics.get('time/loss_step', 0.0) + metrics.get('time/optimizer', 0.0):.2f}s",
    }


def run_summary(rows: Sequence[Dict[str, float]], checkpoints: Sequence[Path]) -> str:
    """Steps run, the mean score of the first and last fifth of the steps, where checkpoints are."""
    if not rows:
        return "No step was logged."
    fifth = max(1, len(rows) // 5)
    first = sum(r["scores"] for r in rows[:fifth]) / fifth
    last = sum(r["scores"] for r in rows[-fifth:]) / fifth
    where = ", ".join(str(p) for p in checkpoints) if checkpoints else "none"
    return (f"Run done: {len(rows)} steps logged; mean score {first:.3f} over the first "
            f"{fifth} step(s), {last:.3f} over the last {fifth}. Checkpoints: {where}.")


def plot(log_dir: Path, out: Path) -> Path:
    """One PNG of the :data:`PANELS` metrics against the step, from the newest DiskLogger file."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = read_disk_log(log_dir)
    steps = list(range(1, len(rows) + 1))
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker=".", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("PPO step")
    fig.suptitle(str(log_dir), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a run's reward, KL, response length and step time.")
    parser.add_argument("output_dir", type=Path, help="the run's output_dir (or its logs folder)")
    parser.add_argument("--out", type=Path, default=None, help="default: <output_dir>/run.png")
    args = parser.parse_args(argv)
    log_dir = args.output_dir / "logs" if (args.output_dir / "logs").is_dir() else args.output_dir
    out = plot(log_dir, args.out or args.output_dir / "run.png")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
