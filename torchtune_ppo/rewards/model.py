"""The reward from a reward model: a classifier read at each row's last valid token."""

import torch
from torch import nn


class ModelReward:
    """Reward from a classifier with one output ``[b, S, 1]``, read at the last valid token.

    The rollout scores it on packed real tokens (its ``model`` runs inside the scoring region);
    called directly it scores padded rows.

    Args:
        model (nn.Module): the reward model, a ``[D, 1]`` output layer.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, tokens: torch.Tensor, masks: torch.Tensor, position_ids: torch.Tensor,
                 last_idx: torch.Tensor) -> torch.Tensor:
        """Scores ``[b]`` of ``tokens [b, S]`` (masks ``[b, S, S]``, positions ``[b, S]``) read at
        ``last_idx [b]``."""
        out = self.model(tokens, mask=masks, input_pos=position_ids)  # [b, S, 1]
        return out[torch.arange(out.shape[0], device=out.device), last_idx, 0].float()
