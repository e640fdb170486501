"""The books of a run's evaluations: when one is due, every one's metrics, the best, and when to stop.

:class:`EvalRecord` is plain data and rules, no model: the run's :class:`~torchtune_ppo.run.progress.Progress`
holds it, so its state goes into every checkpoint's training state and a resumed run continues
the same count towards an early stop.
"""

import math
from typing import Any, Dict, List, Mapping, Optional

__all__ = ["EvalRecord"]


class EvalRecord:
    """When to evaluate, what every evaluation logged, the best so far and the early-stopping rule.

    An evaluation improves on the best when its ``best_metric`` is finite and strictly better
    (higher with ``best_mode="max"``, lower with ``"min"``) than the best before it; the first
    finite one always does. After ``early_stop_patience`` evaluations in a row that do not, the
    run stops.

    Args:
        every_n_steps (Optional[int]): evaluate after every N steps and after the last; None: never.
        before_training (bool): also evaluate before step 1 (step 0).
        best_metric (str): the metric that decides the best, e.g. ``"val/reward_mean"``.
        best_mode (str): ``"max"`` or ``"min"``.
        early_stop_patience (Optional[int]): evaluations without improvement that stop the run;
            None: never.
    """

    def __init__(self, every_n_steps: Optional[int] = None, before_training: bool = True,
                 best_metric: str = "val/reward_mean", best_mode: str = "max",
                 early_stop_patience: Optional[int] = None) -> None:
        if best_mode not in ("max", "min"):
            raise ValueError(f"eval.best_mode must be 'max' or 'min', got {best_mode!r}.")
        self.every_n_steps, self.before_training = every_n_steps, before_training
        self.best_metric, self.best_mode, self.early_stop_patience = best_metric, best_mode, early_stop_patience
        self.history: List[Dict[str, Any]] = []  # {"step": int, "metrics": {name: value}}, in order
        self.best_step: Optional[int] = None
        self.best_value: Optional[float] = None
        self.since_best = 0  # evaluations since the best (or since the first, while there is none)

    @classmethod
    def from_config(cls, block: Mapping[str, Any]) -> "EvalRecord":
        """From the config's ``eval`` block."""
        return cls(block["every_n_steps"], block["before_training"], block["best_metric"], block["best_mode"],
                   block["early_stop_patience"])

    @property
    def enabled(self) -> bool:
        return self.every_n_steps is not None

    def due(self, step: int, last_step: bool) -> bool:
        """Whether to evaluate now, after ``step`` steps (0: before training); ``last_step``: the
        run has just run its last step."""
        if not self.enabled or (self.history and self.history[-1]["step"] == step):
            return False
        if step == 0:
            return self.before_training
        return step % self.every_n_steps == 0 or last_step

    def add(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Records the evaluation after ``step`` steps; returns whether it is the new best."""
        self.history.append({"step": int(step), "metrics": {k: float(v) for k, v in metrics.items()}})
        value = float(metrics[self.best_metric])
        improved = math.isfinite(value) and (
            self.best_value is None
            or (value > self.best_value if self.best_mode == "max" else value < self.best_value))
        if improved:
            self.best_step, self.best_value, self.since_best = int(step), value, 0
        else:
            self.since_best += 1
        return improved

    @property
    def stopped(self) -> bool:
        """``early_stop_patience`` evaluations in a row have not improved on the best."""
        return self.early_stop_patience is not None and self.since_best >= self.early_stop_patience

    def stop_message(self) -> str:
        """The log line of an early stop, naming the best step and value."""
        last = self.history[-1]["step"]
        return (f"Early stop after step {last}: {self.since_best} evaluations without a better {self.best_metric} "
                f"than {_num(self.best_value)} at step {self.best_step} (eval.early_stop_patience="
                f"{self.early_stop_patience}).")

    def summary(self) -> Optional[str]:
        """The evaluations in one sentence for the end-of-run summary; None when there were none."""
        if not self.history:
            return None
        first, last = self.history[0], self.history[-1]
        name = self.best_metric
        best = ("none finite" if self.best_step is None
                else f"best {_num(self.best_value)} at step {self.best_step}")
        return (f"{len(self.history)} evaluations, {name} {_num(first['metrics'][name])} at step {first['step']}, "
                f"{_num(last['metrics'][name])} at step {last['step']}; {best}")

    def state_dict(self) -> Dict[str, Any]:
        return {"history": [{"step": h["step"], "metrics": dict(h["metrics"])} for h in self.history],
                "best_metric": self.best_metric, "best_mode": self.best_mode,
                "best_step": self.best_step, "best_value": self.best_value, "since_best": self.since_best}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restores the history (None: a checkpoint from a run without evaluations). The best and
        the count since it are worked out again from the history under this run's
        ``best_metric`` and ``best_mode``: the saved ones when those are unchanged."""
        self.history, self.best_step, self.best_value, self.since_best = [], None, None, 0
        for h in (state or {}).get("history", []):
            if self.best_metric in h["metrics"]:
                self.add(h["step"], h["metrics"])
            else:  # a metric the saved run did not log: no evaluation of it counts
                self.history.append({"step": int(h["step"]), "metrics": dict(h["metrics"])})


def _num(value: Optional[float]) -> str:
    return "none" if value is None else f"{value:.4g}"
