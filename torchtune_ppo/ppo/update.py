"""The PPO update of one step: epochs x minibatches x micro-steps on the scored batch.

:class:`PPOUpdate` owns everything between the advantages and the next rollout that the
recipe should not have to know: the shuffled minibatches, packing them into micro-steps (fixed
shapes under FSDP), padding ranks to the same number of micro-steps, backward (or the
optimizer stepped in backward), the skip rule for non-finite losses and gradient norms,
clipping, the optimizer and LR scheduler steps, and every reduction across ranks. With one
process each reduction is the identity.
"""

import warnings
from itertools import chain
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torchtune import utils

from torchtune_ppo import distributed
from torchtune_ppo import rlhf
from torchtune_ppo.rlhf import Trajectory, packing
from torchtune_ppo.rlhf.correction import MismatchStats, mismatch_stats
from torchtune_ppo.rlhf.packing import PackedTokens
from torchtune_ppo.rlhf.segments import check_segment_models

log = utils.get_logger("INFO")


class LossSettings(NamedTuple):
    """The PPO loss's settings (the ``loss`` config block), passed to the loss step as keywords:
    ``epsilon`` (ratio clip), ``value_clip_range``, ``value_coeff``; clip-higher's
    ``epsilon_low``/``epsilon_high`` and ``dual_clip`` (None: ``epsilon``, off); the entropy bonus
    ``entropy_coeff`` and the KL loss term ``kl_coeff`` with its ``kl_estimator`` (0: off).
    ``aggregation`` (:data:`~torchtune_ppo.rlhf.loss.AGGREGATIONS`) goes to packing, as the
    token weights."""

    epsilon: float
    value_clip_range: float
    value_coeff: float
    epsilon_low: Optional[float] = None
    epsilon_high: Optional[float] = None
    dual_clip: Optional[float] = None
    aggregation: str = "token-mean"
    entropy_coeff: float = 0.0
    kl_coeff: float = 0.0
    kl_estimator: str = "k3"

    @classmethod
    def from_config(cls, loss) -> "LossSettings":
        """From the checked ``loss`` block, or an instantiated torchtune ``PPOLoss``, which has
        only the first three (the others keep their defaults)."""
        def number(x):
            return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x
        return cls(**{k: number(getattr(loss, k, cls._field_defaults.get(k))) for k in cls._fields})


class UpdateResult(NamedTuple):
    """What one step's update did.

    Attributes:
        stats (List[PPOStats]): one per micro-batch of every applied minibatch update, summed
            over ranks and scaled by ``1 / gradient_accumulation_steps``.
        skipped_updates (int): minibatch updates dropped for a non-finite loss or gradient norm.
        slots_per_token (float): loss-step token slots per real token (1.0: perfect packing).
        mismatch (Optional[MismatchStats]): the trainer's logprobs at the step's first
            minibatch (before any update: the rollout's weights) against the old logprobs it
            was given, over every rank's valid tokens (:func:`~torchtune_ppo.rlhf.correction.mismatch_stats`).
    """

    stats: List[rlhf.PPOStats]
    skipped_updates: int
    slots_per_token: float
    mismatch: Optional[MismatchStats] = None


def num_updates(batch_size: int, ppo_batch_size: int, ppo_epochs: int) -> int:
    """Optimizer steps per PPO step: ``ppo_epochs`` passes over ``batch_size // ppo_batch_size``
    minibatches."""
    return ppo_epochs * (batch_size // ppo_batch_size)


def nonfinite_score_rows(trajectory: Trajectory) -> int:
    """Rows of the global batch whose score is not finite (a step with any gets no update)."""
    return int(distributed.all_reduce_sum((~trajectory.scores.isfinite()).sum()))


class PPOUpdate:
    """``ppo_epochs`` passes over shuffled minibatches, accumulating gradients per minibatch.

    A minibatch's loss is the sum of its ``gradient_accumulation_steps`` micro-batches' masked
    means; the loss step runs on their real tokens only, packed into micro-steps. A minibatch
    whose loss or gradient norm is not finite (summed over ranks, so every rank agrees) leaves
    the weights as they were and is counted as skipped.

    Args:
        policy_model (nn.Module): the trained policy.
        value_model (Optional[nn.Module]): the trained value model; None for a critic-free run.
        optimizer (Any): over both models' parameters; an ``InBackwardOptimizer`` when
            ``optimizer_in_bwd``.
        lr_scheduler (Optional[Any]): stepped after each applied optimizer step.
        loss_step (Callable): :func:`~torchtune_ppo.ppo.loss_step.packed_ppo_loss_step`,
            compiled or not (:func:`torchtune_ppo.compile.regions`).
        batch_size (int): global rows (responses) per step.
        ppo_batch_size (int): global rows per minibatch.
        ppo_epochs (int): passes over the batch.
        gradient_accumulation_steps (int): micro-batches per minibatch.
        prompt_len (int): ``P``.
        response_len (int): ``T``.
        temperature (float): the sampling temperature; logprobs are taken at it.
        loss (LossSettings): the PPO loss's scalars.
        clip_grad_norm (Optional[float]): max gradient norm; None: no clipping.
        optimizer_in_bwd (bool): ``optimizer`` steps inside backward.
        critic_warmup_steps (int): PPO steps (1-based ``step`` up to this) that update the value
            model only: the policy's gradients are dropped before clipping and the optimizer
            step, so its weights and optimizer state stay as they were.
        fixed_shapes (bool): every micro-step gets the same rows and reads, for a compiled loss
            step that cannot take dynamic sizes (under FSDP: ``regions.loss_step_fixed_shapes``
            of :func:`torchtune_ppo.compile.regions`).
        master_weights (Optional[MasterWeights]): fp32 masters of bf16 trained parameters, which
            ``optimizer`` steps (:class:`~torchtune_ppo.run.optim.MasterWeights`): the gradients
            move to them before clipping, and the stepped masters are rounded back after.
        group_size (int): ``n`` > 1: each rank's rows come in groups of ``n`` answering one prompt;
            minibatches are drawn by whole groups (the groups are shuffled, not the rows, so a
            group splits over two minibatches only where ``ppo_batch_size`` per rank is not a
            multiple of ``n``), and with ``share_prompts`` the loss step packs a group's prompt
            once per row before its responses (:func:`~torchtune_ppo.rlhf.packing.pack_minibatch`).
            1: rows are shuffled one by one.
        share_prompts (bool): with ``group_size`` > 1, pack shared prompts; False: each response
            with its own prompt copy, with the same group-wise draw (the reference path).
        share_prefix (bool): with ``group_size`` 1, the tokens every prompt of the step begins
            with are packed once per row (``share_prefix`` of
            :func:`~torchtune_ppo.rlhf.packing.pack_minibatch`; ``share_prompt_prefix``).
        segment_attention (bool): packed rows attend by sequence
            (:mod:`~torchtune_ppo.rlhf.segments`; ``segment_attention``) instead of through
            block-causal masks; the models must take layouts
            (:func:`~torchtune_ppo._patches.torchtune_modules.use_segment_attention`). Ignored
            with ``fixed_shapes``, whose compiled step takes no dynamic size.

    Raises:
        ValueError: ``segment_attention`` with a model that does not take layouts.
    """

    def __init__(
        self,
        policy_model: nn.Module,
        value_model: Optional[nn.Module],
        optimizer,
        lr_scheduler,
        loss_step: Callable,
        *,
        batch_size: int,
        ppo_batch_size: int,
        ppo_epochs: int,
        gradient_accumulation_steps: int,
        prompt_len: int,
        response_len: int,
        temperature: float,
        loss: LossSettings,
        clip_grad_norm: Optional[float],
        optimizer_in_bwd: bool,
        critic_warmup_steps: int = 0,
        fixed_shapes: bool = False,
        master_weights=None,
        group_size: int = 1,
        share_prompts: bool = True,
        share_prefix: bool = False,
        segment_attention: bool = False,
    ) -> None:
        check_segment_models("PPOUpdate", segment_attention, {"policy": policy_model, "value": value_model})
        self.policy_model, self.value_model = policy_model, value_model
        self.optimizer, self.lr_scheduler, self.loss_step = optimizer, lr_scheduler, loss_step
        world = distributed.world_size()
        # Each rank shuffles its own rows into minibatches of ppo_batch_size / W, which
        # together form one global minibatch.
        self._batch_size, self._ppo_batch_size = batch_size // world, ppo_batch_size // world
        self.ppo_epochs, self.gradient_accumulation_steps = ppo_epochs, gradient_accumulation_steps
        self.num_updates = num_updates(batch_size, ppo_batch_size, ppo_epochs)
        self._prompt_len, self._response_len, self._temperature = prompt_len, response_len, temperature
        self._loss = loss
        self._max_norm = float("inf") if clip_grad_norm is None else float(clip_grad_norm)
        self._in_bwd = optimizer_in_bwd
        self.critic_warmup_steps = critic_warmup_steps
        self._fixed_shapes = fixed_shapes
        self._master = master_weights
        if master_weights is not None and master_weights.fuses(optimizer):
            log.info("bf16 master weights: each parameter's optimizer step is one compiled pass (compile.optimizer).")
        self._packed_tokens = PackedTokens()
        self.group_size = group_size
        self._share = group_size > 1 and share_prompts
        self._share_prefix = group_size == 1 and share_prefix
        self._segments = segment_attention and not fixed_shapes
        limits = [getattr(m, "max_seq_len", None) for m in (policy_model, value_model) if m is not None]
        self._max_seq_len = min((x for x in limits if isinstance(x, int)), default=None)

    def __call__(self, trajectory: Trajectory, advantages: torch.Tensor, returns: torch.Tensor,
                 timer: Callable, step: int, value_pretrain: bool = False) -> UpdateResult:
        """Updates both models on ``trajectory`` (``advantages`` and ``returns`` ``[b, T]``).

        ``timer(phase)`` times "loss_step" and "optimizer"; ``step`` (1-based) names the PPO
        step in warnings. ``value_pretrain``: a value pretraining step, not a PPO step: the
        value model only, as in critic warm-up, with the LR scheduler left where it is and each
        param group at its scheduler's base lr (``optimizer.lr``) for the step.
        """
        if value_pretrain and self.lr_scheduler is not None:
            groups = self.optimizer.param_groups
            lrs = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] = g.get("initial_lr", g["lr"])
            try:
                return self._update(trajectory, advantages, returns, timer, step, True)
            finally:
                for g, lr in zip(groups, lrs):
                    g["lr"] = lr
        return self._update(trajectory, advantages, returns, timer, step, value_pretrain)

    def _update(self, trajectory: Trajectory, advantages: torch.Tensor, returns: torch.Tensor,
                timer: Callable, step: int, value_pretrain: bool) -> UpdateResult:
        self._packed_tokens.reset()
        stats, skipped, mismatch = [], 0, None
        micro_batch_size = self._ppo_batch_size // self.gradient_accumulation_steps
        lengths = packing.sequence_lengths(trajectory, self._prompt_len, common_prefix=self._share_prefix)  # sync
        for _ in range(self.ppo_epochs):
            order = self._draw(trajectory.scores.device)
            for start in range(0, self._batch_size, self._ppo_batch_size):
                minibatch = order[start : start + self._ppo_batch_size]
                micro_batches = [minibatch[i : i + micro_batch_size]
                                 for i in range(0, len(minibatch), micro_batch_size)]
                with timer("loss_step"):
                    minibatch_stats, measured = self._loss_and_backward(
                        trajectory, advantages, returns, micro_batches, lengths, step, measure=mismatch is None)
                    mismatch = mismatch or measured
                with timer("optimizer"):
                    if self._optimizer_step(minibatch_stats, step, value_pretrain):
                        stats.extend(minibatch_stats)
                    else:
                        skipped += 1
        return UpdateResult(stats, skipped, self._packed_tokens.ratio, mismatch)

    def _draw(self, device: torch.device) -> List[int]:
        """This epoch's order of the rank's rows: shuffled rows, or shuffled whole groups."""
        n = self.group_size
        if n == 1:
            return torch.randperm(self._batch_size, device=device).tolist()
        groups = torch.randperm(self._batch_size // n, device=device).tolist()
        return [g * n + j for g in groups for j in range(n)]

    def _packing(self, micro_batch_size: int) -> Dict[str, int]:
        """Rows, reads, chunks and (shared prompts) row length and group size of a micro-step."""
        fixed, P, T = self._fixed_shapes, self._prompt_len, self._response_len
        rows = packing.default_rows(micro_batch_size, fixed_shapes=fixed)
        if self._share_prefix:  # one copy of the prefix all prompts share a row: fewer, longer rows
            row_len, reads = packing.prefix_row_len(P, T - 1, self._max_seq_len), rows * T
            return dict(rows=packing.prefix_rows(micro_batch_size, row_len, P, T - 1, fixed_shapes=fixed),
                        max_reads=reads, num_chunks=packing.logprob_chunks(reads), row_len=row_len,
                        share_prefix=True)
        if not self._share:
            return dict(rows=rows, num_chunks=packing.logprob_chunks(rows * T))
        # the prompt counted once per row: fewer, longer rows; as many reads as unshared
        row_len = packing.shared_row_len(P, T - 1, self.group_size, self._max_seq_len)
        reads = rows * T
        return dict(rows=packing.shared_rows(micro_batch_size, row_len, P, T - 1, fixed_shapes=fixed),
                    max_reads=reads, num_chunks=packing.logprob_chunks(reads), row_len=row_len,
                    group_size=self.group_size)

    def _loss_and_backward(self, trajectory: Trajectory, advantages: torch.Tensor, returns: torch.Tensor,
                           micro_batches: List[List[int]], lengths: packing.SequenceLengths,
                           step: int, measure: bool = False) -> Tuple[List[rlhf.PPOStats], Optional[MismatchStats]]:
        """Loss and gradients of one minibatch (trajectory rows in micro-batches), packed;
        returns one :class:`~torchtune_ppo.rlhf.loss.PPOStats` per micro-batch, summed over ranks."""
        valid_totals = num_sequences = None
        if distributed.world_size() > 1:  # token weights over the global (micro-)batch's tokens, sequences
            counts = torch.tensor([sum(lengths.valid_counts[i] for i in idxs) for idxs in micro_batches]
                                  + [sum(lengths.valid_counts[i] > 0 for idxs in micro_batches for i in idxs)])
            *valid_totals, num_sequences = distributed.all_reduce_sum(counts.to(advantages.device)).tolist()
        settings = self._loss._asdict()
        aggregation = settings.pop("aggregation")
        fixed = self._fixed_shapes
        steps = packing.pack_minibatch(
            trajectory, advantages, returns, micro_batches, lengths,
            prompt_len=self._prompt_len, valid_totals=valid_totals, fixed_shapes=fixed,
            aggregation=aggregation, num_sequences=num_sequences, segment_attention=self._segments,
            **self._packing(len(micro_batches[0])),
        )
        self._packed_tokens.update(steps, lengths, micro_batches)
        step_stats, losses, gaps = [], [], []
        for micro_step in distributed.pad_micro_steps(steps):  # every rank runs as many
            loss, stats, pi_logprobs = self.loss_step(
                self.policy_model, self.value_model, *(micro_step if fixed else micro_step.mark_dynamic(self._share_prefix)),
                temperature=self._temperature, **settings,
                num_micro_batches=len(micro_batches),
            )
            if self._in_bwd:
                losses.append(loss)  # one backward for the minibatch: its hooks step the weights
            else:
                loss.backward()
            step_stats.append(stats)
            if measure:  # the reads of this rank's real tokens (filler reads have no weight)
                gaps.append(mismatch_stats(pi_logprobs, micro_step.old_logprobs, micro_step.stat_weights > 0))
        minibatch_stats = packing.micro_batch_stats(step_stats)
        if distributed.world_size() > 1:  # every rank takes the same decision on the same sums
            totals = distributed.all_reduce_sum(torch.stack([torch.stack(s) for s in minibatch_stats]))
            minibatch_stats = [rlhf.PPOStats(*row.unbind()) for row in totals]
        if losses:
            total = torch.stack(losses).sum()
            if self._finite(total, None, step):
                total.backward()
        mismatch = None
        if measure:
            mismatch = MismatchStats(distributed.all_reduce_sum(torch.stack([g.sums for g in gaps]).sum(0)),
                                     distributed.all_reduce_max(torch.stack([g.max_abs for g in gaps]).amax()))
        return minibatch_stats, mismatch

    def _optimizer_step(self, minibatch_stats: List[rlhf.PPOStats], step: int, value_pretrain: bool = False) -> bool:
        """Clip, then step; or drop the gradients when the loss or their norm is not finite.
        Returns whether the update was applied."""
        loss = torch.stack([s.loss for s in minibatch_stats]).sum()
        if self._in_bwd:  # stepped in backward, which ran only for a finite loss
            return bool(loss.isfinite())
        if value_pretrain or step <= self.critic_warmup_steps:  # torch optimizers skip a parameter whose grad is None
            for p in self.policy_model.parameters():
                p.grad = None
        if self._master is not None and self._master.fuses(self.optimizer):
            return self._fused_master_step(loss, step, value_pretrain)
        if self._master is not None:  # bf16 gradients to the fp32 masters, which are clipped and stepped
            self._master.take_grads()
            params = self._master.masters
        else:
            params = chain(*(m.parameters() for m in (self.policy_model, self.value_model) if m is not None))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=self._max_norm)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):  # sharded models: the global norm
            grad_norm = grad_norm.full_tensor()
        applied = self._finite(loss, grad_norm, step)
        if applied:
            self.optimizer.step()
            if self._master is not None:
                self._master.write_back()
            if self.lr_scheduler is not None and not value_pretrain:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._master is not None:
            self._master.zero_grad()
        return applied

    def _fused_master_step(self, loss: torch.Tensor, step: int, value_pretrain: bool) -> bool:
        """:meth:`_optimizer_step` for bf16 masters stepped in one pass a parameter (compile.optimizer)."""
        grad_norm = self._master.grad_norm()
        applied = self._finite(loss, grad_norm, step)
        if applied:
            self._master.fused_step(self.optimizer, grad_norm, self._max_norm)
            if self.lr_scheduler is not None and not value_pretrain:
                with warnings.catch_warnings():  # the optimizer's state was stepped without optimizer.step()
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                    self.lr_scheduler.step()
        self._master.zero_grad()
        return applied

    @staticmethod
    def _finite(loss: torch.Tensor, grad_norm: Optional[torch.Tensor], step: int) -> bool:
        """The skip rule: an update is applied only with a finite loss and gradient norm."""
        checks = [loss] if grad_norm is None else [loss, grad_norm]
        finite = torch.stack([x.isfinite() for x in checks]).tolist()  # one host sync
        if all(finite):
            return True
        quantity = "loss" if not finite[0] else "gradient norm"
        norm = "" if grad_norm is None else f", grad norm {grad_norm.item():.4g}"
        log.warning(f"step {step}: non-finite {quantity} (loss {loss.item():.4g}{norm}); "
                    "this minibatch update is skipped.")
        return False
