"""Value pretraining (VC-PPO, https://arxiv.org/abs/2503.01491; VAPO, https://arxiv.org/abs/2504.05118):
before PPO's first step, the value model trains alone on rollouts of the frozen starting policy
until its loss settles.

A pretraining step is a PPO step with the policy left out: rollout, advantages with the critic's
returns from GAE at ``value_pretrain.lmbda`` (1.0: Monte-Carlo returns, as VC-PPO), the update
with the policy's gradients dropped. It draws its batch from the data like any step, but is not
counted in ``num_ppo_steps`` and does not step the LR scheduler or adapt the KL coefficient.

The stopping rule (:func:`settled`), with ``L_1 .. L_k`` the value losses of the pretraining
steps so far (a step whose every update was skipped records none), ``w = window`` and the
moving average ``M_j = mean(L_{j-w+1} .. L_j)``: pretraining ends after a step when it has run
``max_steps`` steps, or when ``tolerance`` is set, ``k >= 2w`` and
``|M_k - M_{k-w}| / |M_{k-w}| < tolerance`` (the mean of the last ``w`` losses moved by less
than ``tolerance``, relatively, from the mean of the ``w`` before them).
"""

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence


def relative_change(losses: Sequence[float], window: int) -> Optional[float]:
    """``|M_k - M_{k-w}| / |M_{k-w}|`` of the recorded ``losses`` (see the module's docstring);
    None before ``2 * window`` losses. ``inf`` when ``M_{k-w}`` is 0 and ``M_k`` is not; NaN when
    both are 0."""
    if len(losses) < 2 * window:
        return None
    now = sum(losses[-window:]) / window
    before = sum(losses[-2 * window : -window]) / window
    if before == 0:
        return float("nan") if now == 0 else float("inf")
    return abs(now - before) / abs(before)


def settled(losses: Sequence[float], window: int, tolerance: Optional[float]) -> bool:
    """Whether the value loss has settled: :func:`relative_change` below ``tolerance``; never with
    ``tolerance`` None or fewer than ``2 * window`` losses (nor when ``M_{k-w}`` is 0)."""
    change = None if tolerance is None else relative_change(losses, window)
    return change is not None and change < tolerance


class ValuePretraining:
    """Where value pretraining stands: steps run, the recorded value losses, whether it is over.

    Args:
        max_steps (int): pretraining steps at most; 0: off (``done`` from the start).
        tolerance (Optional[float]): the stopping rule's relative change; None: run ``max_steps``.
        window (int): ``w``, losses per moving average.
        lmbda (float): GAE lambda of the critic's returns during pretraining.
    """

    def __init__(self, max_steps: int, tolerance: Optional[float], window: int, lmbda: float) -> None:
        self.max_steps, self.tolerance, self.window, self.lmbda = max_steps, tolerance, window, lmbda
        self.steps_run = 0
        self.losses: List[float] = []
        self.done = max_steps == 0

    @classmethod
    def from_config(cls, block: Mapping[str, Any]) -> "ValuePretraining":
        """From the checked ``value_pretrain`` config block."""
        tolerance = block["tolerance"]
        return cls(int(block["max_steps"]), None if tolerance is None else float(tolerance),
                   int(block["window"]), float(block["lmbda"]))

    @property
    def active(self) -> bool:
        """The next step is a pretraining step."""
        return not self.done

    def record(self, value_loss: float) -> None:
        """Counts one pretraining step and its logged value loss (not recorded when not finite:
        every update of the step was skipped), then applies the stopping rule."""
        self.steps_run += 1
        if math.isfinite(value_loss):
            self.losses.append(float(value_loss))
        self._apply_rule()

    def _apply_rule(self) -> None:
        self.done = self.done or self.steps_run >= self.max_steps or settled(self.losses, self.window, self.tolerance)

    def metrics(self) -> Dict[str, float]:
        """The logged pretraining metrics of the step just recorded: ``value_pretrain`` (1 during
        pretraining), ``value_pretrain/loss_avg`` (``M_k``) and ``value_pretrain/rel_change``
        (the rule's relative change; NaN until ``2 * window`` losses)."""
        change = relative_change(self.losses, self.window)
        recent = self.losses[-self.window:]
        return {
            "value_pretrain": 1.0,
            "value_pretrain/loss_avg": sum(recent) / len(recent) if len(recent) == self.window else float("nan"),
            "value_pretrain/rel_change": float("nan") if change is None else change,
        }

    def state_dict(self) -> Dict[str, Any]:
        """Plain data for the checkpoint's training state: the whole loss record, so that the
        rule reads the same losses after a resume."""
        return {"steps_run": self.steps_run, "losses": list(self.losses), "done": self.done}

    def load_state_dict(self, state: Optional[Mapping[str, Any]], ppo_steps_run: int) -> None:
        """Restores a saved state; None (a checkpoint from before value pretraining existed): done
        when PPO has begun. The rule is applied again with this run's settings: a lowered
        ``max_steps`` or a looser ``tolerance`` ends pretraining now."""
        if state is None:
            state = {"steps_run": 0, "losses": [], "done": ppo_steps_run > 0}
        self.steps_run, self.losses = int(state["steps_run"]), [float(x) for x in state["losses"]]
        self.done = bool(state["done"]) or ppo_steps_run > 0
        if not self.done:
            self._apply_rule()
