"""Per-step metrics of the recipe: phase timing and the logged values.

Keys match torchtune's PPO recipe where it has them, so dashboards carry over; the phase
times are namespaced ``time/<phase>``.
"""

import contextlib
import time
from typing import Dict, Iterator, List

import torch
from torchtune import config
from torchtune.training.metric_logging import DiskLogger

from torchtune_ppo import distributed
from torchtune_ppo import rlhf
from torchtune_ppo.rlhf import Trajectory


class PhaseTimer:
    """Wall-clock seconds per phase of a step; syncs the device so the times are real.

    Each phase is also a ``phase/<name>`` range in a torch profile of the run (the ``profiler``
    block, ``benchmarks/bounds/smollm2_step_profile.py``)."""

    def __init__(self, device: torch.device):
        self._device = device
        self.times: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        start = time.perf_counter()
        with torch.profiler.record_function(f"phase/{phase}"):
            yield
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start


def step_metrics(
    trajectory: Trajectory,
    stats: List[rlhf.PPOStats],
    kl: torch.Tensor,
    kl_rewards: torch.Tensor,
    times: Dict[str, float],
    *,
    grad_accum: int,
    ppo_epochs: int,
) -> Dict[str, float]:
    """The logged metrics of one PPO step.

    Args:
        trajectory (Trajectory): the step's scored batch ``[B, ...]``.
        stats (List[PPOStats]): one per micro-batch of every update that was applied, each
            already scaled by ``1 / grad_accum``; empty when every update was skipped.
        kl (torch.Tensor): ``[B, T]`` per-token KL to the reference policy.
        kl_rewards (torch.Tensor): ``[B, T]`` the KL penalty part of the rewards.
        times (Dict[str, float]): seconds per phase, from :class:`PhaseTimer`.
        grad_accum (int): micro-batches per minibatch.
        ppo_epochs (int): passes over the batch.

    Returns:
        Dict[str, float]: scores, KL, losses, ratios (masked means), lengths, throughput and
        ``time/<phase>``. Loss metrics are NaN when no update was applied. On several
        processes, every metric is over the global batch (``stats`` are summed over ranks).
    """
    if distributed.world_size() > 1:
        trajectory = trajectory._replace(**{k: distributed.all_gather_rows(getattr(trajectory, k)) for k in
                                            ("query_responses", "scores", "response_padding_masks", "seq_lens")})
        kl, kl_rewards = distributed.all_gather_rows(kl), distributed.all_gather_rows(kl_rewards)
    if stats:
        # Stats of one minibatch are summed over its micro-batches (each scaled by 1/grad_accum).
        per_minibatch = [torch.stack(s).view(-1, grad_accum).sum(1).mean() for s in zip(*stats)]
    else:
        per_minibatch = [torch.tensor(float("nan"))] * len(rlhf.PPOStats._fields)
    ppo = rlhf.PPOStats(*per_minibatch)
    b, s = trajectory.query_responses.shape
    finite = torch.isfinite(trajectory.scores)
    scores = torch.where(finite, trajectory.scores, 0.0).sum() / finite.sum().clamp(min=1)
    traj_time = times["generate"] + times.get("score", 0.0)
    ppo_time = times.get("loss_step", 0.0) + times.get("optimizer", 0.0)
    metrics = {
        "scores": scores,  # over rows with a finite score
        # rows that ended before T: a stop token (one-turn), or a finished episode (multi-turn)
        "num_stop_tokens": trajectory.response_padding_masks[:, -1].sum(),
        "rlhf_reward": scores + kl_rewards.sum(1).mean(),
        "kl": kl.sum(1).mean(),
        "kl_reward": kl_rewards.sum(1).mean(),
        "loss": ppo.loss,
        "policy_loss": ppo.policy_loss,
        "value_loss": ppo.value_loss,
        "clipfrac": ppo.clipfrac,
        "clipfrac_low": ppo.clipfrac_low,
        "clipfrac_high": ppo.clipfrac_high,
        "dualclip_frac": ppo.dualclip_frac,
        "ratios": ppo.ratios,
        "approx_policy_kl": ppo.approx_policy_kls,
        "entropy": ppo.entropy,  # token mean, over the vocabulary, during the update
        "kl_loss": ppo.kl_loss,  # token mean of the loss's KL estimate, during the update
        "response_lengths": trajectory.seq_lens.float().mean(),
        # the batch's longest response: a generation call decodes until its longest row ends
        "response_lengths_max": trajectory.seq_lens.max(),
        "tokens_per_second_per_gpu_trajectory": b * s / traj_time,
        "tokens_per_second_per_gpu_ppo": ppo_epochs * b * s / ppo_time if ppo_time else 0.0,
        "generated_tokens_per_second": trajectory.seq_lens.sum() / times["generate"],
    }
    metrics.update({f"time/{k}": v for k, v in times.items()})
    return {k: float(v) for k, v in metrics.items()}


class NullMetricLogger:
    """What ranks other than 0 log to: nothing."""

    def log_config(self, cfg) -> None:
        pass

    def log_dict(self, payload: Dict[str, float], step: int) -> None:
        pass

    def log(self, name: str, data, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def metric_logger(cfg, *, rank_zero: bool):
    """The run's metric logger: ``cfg.metric_logger`` built, or torchtune's ``DiskLogger`` in
    ``<output_dir>/logs`` when it is null; a :class:`NullMetricLogger` on ranks other than 0."""
    if not rank_zero:
        return NullMetricLogger()
    if cfg.metric_logger is None:
        return DiskLogger(log_dir=f"{cfg.output_dir}/logs")
    return config.instantiate(cfg.metric_logger)
