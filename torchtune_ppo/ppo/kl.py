"""The KL penalty's coefficient in the reward: fixed, or adaptive towards a target KL. The
per-token estimators are :mod:`torchtune_ppo.rlhf.kl`'s."""

from typing import Any, Dict, Optional


class KLController:
    """The KL penalty coefficient ``value``: fixed, or adapted towards ``target`` after each step.

    The adaptive rule is Ziegler et al.'s (https://arxiv.org/abs/1909.08593, section 2.2):
    ``beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)``, with ``KL`` the
    step's mean per-sequence KL over the global batch and ``n`` its batch size.

    Args:
        kl_coeff (float): the initial (or fixed) coefficient.
        target (Optional[float]): the target KL; None keeps ``kl_coeff`` fixed.
        horizon (float): the horizon of the adaptation, in sequences.
    """

    def __init__(self, kl_coeff: float, target: Optional[float] = None, horizon: float = 10000) -> None:
        self.value = float(kl_coeff)
        self.target, self.horizon = target, float(horizon)

    def update(self, kl: float, n: int) -> float:
        """After a step whose mean per-sequence KL was ``kl`` over ``n`` sequences; returns the
        new coefficient. A non-finite ``kl`` leaves it as it was."""
        if self.target is not None and kl == kl and abs(kl) != float("inf"):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n / self.horizon
        return self.value

    def state_dict(self) -> Dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.value = float(state["value"])

