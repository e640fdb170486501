"""Watching a run: sampled responses, an end-of-run summary, and a plot of the logged metrics.

    python -m torchtune_ppo.run.watch <output_dir> [--out run.png]

draws reward, KL, response length and step time against the step from the run's DiskLogger
file (``<output_dir>/logs``) into one PNG (matplotlib, ``pip install matplotlib``), with the
held-out evaluations' ``val/`` metrics in a panel of their own when the run logged any.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from torchtune_ppo.checkpointing.store import existing_checkpoints
from torchtune_ppo.run.logs import read_disk_log, read_eval_log
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
    """The first ``n`` rows of a step as text: prompt, response (up to its stop token; a multi-turn
    episode whole, its observations included), score.

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
    seq_lens = trajectory.seq_lens[:n]
    if trajectory.observation_masks is not None:  # an episode: up to its last token, observations included
        valid = ~trajectory.response_padding_masks[:n]
        seq_lens = (valid * torch.arange(1, valid.shape[1] + 1, device=valid.device)).amax(-1)
    lens, seq_lens = prompt_lens[:n].tolist(), seq_lens.tolist()
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


class SampleLog:
    """Every ``every`` steps, the first ``n`` rows of the step through :func:`log_samples` (rank 0 only).

    Args:
        every (Optional[int]): steps between two logs (``log_samples_every_n_steps``); None: never.
        tokenizer (Any): decodes the rows.
        prompt_len (int): ``P``.
        log_dir (Optional[str]): where ``samples.jsonl`` goes.
        log: the run's logger.
        rank_zero (bool): this process logs.
        n (int): rows per log.
    """

    def __init__(self, every: Optional[int], tokenizer: Any, prompt_len: int, log_dir: Optional[str], log,
                 rank_zero: bool = True, n: int = 4) -> None:
        self.every, self.tokenizer, self.prompt_len, self.log_dir = every, tokenizer, prompt_len, log_dir
        self.log, self.rank_zero, self.n = log, rank_zero, n

    def __call__(self, trajectory: Trajectory, prompt_lens: torch.Tensor, step: int) -> None:
        if self.rank_zero and self.every and step % self.every == 0:
            rows = sample_rows(trajectory, prompt_lens, self.tokenizer, self.prompt_len, n=self.n)
            log_samples(rows, step, self.log_dir, self.log)


def progress(metrics: Dict[str, float]) -> Dict[str, str]:
    """The progress bar's postfix: mean score, KL and the seconds of each phase group."""
    return {
        "reward": f"{metrics['scores']:.3f}",
        "kl": f"{metrics['kl']:.3f}",
        "gen": f"{metrics['time/generate']:.2f}s",
        "score": f"{metrics.get('time/score', 0.0) + metrics.get('time/reward', 0.0):.2f}s",
        "ppo": f"{metrics.get('time/loss_step', 0.0) + metrics.get('time/optimizer', 0.0):.2f}s",
    }


def run_summary(rows: Sequence[Dict[str, float]], checkpoints: Union[str, Path, Sequence[Path]],
                evaluation: Optional[Any] = None, nothing_to_train: Optional[str] = None) -> str:
    """Steps run, the mean score of the first and last fifth of the steps, where checkpoints are,
    and the held-out evaluations with the best checkpoint.

    Args:
        rows (Sequence[Dict[str, float]]): each PPO step's ``{"scores": ...}``.
        checkpoints (Union[str, Path, Sequence[Path]]): the checkpoint folders, or the run's
            ``output_dir`` to list them from.
        evaluation (Optional[Any]): the run's :class:`~torchtune_ppo.eval.record.EvalRecord`.
        nothing_to_train (Optional[str]): why a resumed run had no step left to run
            (:meth:`~torchtune_ppo.run.progress.Progress.nothing_to_train`), said when no step ran.
    """
    if isinstance(checkpoints, (str, Path)):
        checkpoints = existing_checkpoints(checkpoints)
    where = ", ".join(str(p) for p in checkpoints) if checkpoints else "none"
    held_out = evaluation.summary() if evaluation is not None else None
    if held_out is not None and evaluation.best_step:
        best = [p for p in checkpoints if Path(p).name == f"step_{evaluation.best_step}"]
        held_out += f" (checkpoint {best[0] if best else 'not kept'})"
    elif held_out is not None and evaluation.best_step == 0:
        held_out += " (the starting weights)"
    held_out = f" Held-out: {held_out}." if held_out else ""
    if not rows:
        return f"{nothing_to_train or 'No step was logged.'}{held_out}"
    fifth = max(1, len(rows) // 5)
    first = sum(r["scores"] for r in rows[:fifth]) / fifth
    last = sum(r["scores"] for r in rows[-fifth:]) / fifth
    return (f"Run done: {len(rows)} steps logged; mean score {first:.3f} over the first "
            f"{fifth} step(s), {last:.3f} over the last {fifth}. Checkpoints: {where}.{held_out}")


def plot(log_dir: Path, out: Path) -> Path:
    """One PNG of the :data:`PANELS` metrics against the step, from the newest DiskLogger file."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows, evals = read_disk_log(log_dir), read_eval_log(log_dir)
    steps = list(range(1, len(rows) + 1))
    columns = 3 if evals else 2
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 6.5), sharex=True)
    for ax, (key, title) in zip([*axes[0][:2], *axes[1][:2]], PANELS):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker=".", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    if evals:  # the held-out scores, and the length of the held-out responses
        val_steps = [step for step, _ in evals]
        keys = sorted({k for _, m in evals for k in m if k.startswith("val/")})  # val/... or val/<set>/...
        for key in keys:
            ax = axes[1][2] if key.endswith("/response_length") else axes[0][2]
            ax.plot(val_steps, [m.get(key, float("nan")) for _, m in evals], marker="o", label=key)
        axes[0][2].legend(fontsize=8)
        axes[0][2].set_title("held-out evaluation", fontsize=10)
        if len([k for k in keys if k.endswith("/response_length")]) > 1:
            axes[1][2].legend(fontsize=8)
        axes[1][2].set_title("held-out response length (tokens)", fontsize=10)
        for ax in axes[:, 2]:
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
