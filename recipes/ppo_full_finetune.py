"""PPO full fine-tuning of a causal LM against a reward model, with compiled hot regions.

Run it with ``tune run ppo_full_finetune --config <config.yaml> [key=value ...]``. To edit it,
copy this file into your own folder under another name (``my_ppo.py``) and run
``tune run my_ppo.py --config ...`` there: an installed ``ppo_full_finetune`` would shadow a
copy of the same name.

One PPO step reads as:

    prompts [B, P] ─ generate ─► query_responses [B, P+T], logprobs [B, T]
                   ─ score    ─► Trajectory (ref logprobs, values, truncation, scores, masks)
                   ─ advantages (KL-penalised rewards, GAE, whitening)
                   ─ ppo_epochs × minibatches × grad-accumulation: loss step, backward, optimizer
"""

import sys
from contextlib import nullcontext
from functools import partial
from itertools import chain
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import config, modules, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from torchtune_ppo.checkpointing import store as checkpointing

from torchtune_ppo import distributed

from torchtune_ppo.ppo import packing, rlhf
from torchtune_ppo.compile import RecompileCounter, maybe_compile
from torchtune_ppo.config import (
    check_cli_overrides,
    cpu_threads,
    check_sequence_length,
    instantiate_dataset,
    parse_compile,
    validate_config,
    validate_dataset,
    validate_with_tokenizer,
)
from torchtune_ppo.data import left_pad_prompts
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.run.guards import SkippedSteps
from torchtune_ppo.run.interrupt import stop_on_signals
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.run.memory import check_plan
from torchtune_ppo.run.metrics import PackedTokens, PhaseTimer, step_metrics
from torchtune_ppo.run.optim import InBackwardOptimizer, build_optimizer
from torchtune_ppo.rollout import Rollout
from torchtune_ppo.rewards import FunctionReward
from torchtune_ppo.rollout.trajectory import ModelReward, Trajectory
from torchtune_ppo.run.watch import log_samples, progress, run_summary, sample_rows

log = utils.get_logger("INFO")


class PPOFullFinetuneRecipe(FTRecipeInterface):
    """PPO full fine-tuning: a trained policy and value model, a frozen reference policy and reward model.

    The policy, reference policy, value model and reward model are each loaded through the
    torchtune checkpointer named in the config; the value model starts from the reward model.
    See the README for every config key.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        # Under torchrun: one rank per process, each with 1/W of every batch of prompts.
        distributed.init_distributed(self._device)
        self._world_size, self._is_rank_zero = distributed.world_size(), distributed.rank() == 0
        if self._device.type == "cpu":
            torch.set_num_threads(cpu_threads(cfg.cpu_threads))
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self.seed = training.set_seed(seed=cfg.seed)
        # Each rank samples its own prompts' responses from its own stream.
        self._rng = torch.Generator(self._device).manual_seed(self.seed + distributed.rank())
        self._compile = parse_compile(cfg.compile)
        self._output_dir = cfg.output_dir
        self._num_steps = cfg.num_ppo_steps
        self._batch_size = cfg.batch_size
        self._forward_batch_size = cfg.forward_batch_size
        self._ppo_epochs = cfg.ppo_epochs
        self._ppo_batch_size = cfg.ppo_batch_size
        self._grad_accum = cfg.gradient_accumulation_steps
        distributed.check_world_size(cfg, self._world_size)
        # This rank's share of the global batch_size and ppo_batch_size.
        self._rank_batch_size = self._batch_size // self._world_size
        self._rank_ppo_batch_size = self._ppo_batch_size // self._world_size
        self._prompt_len = cfg.max_prompt_len
        self._response_len = cfg.max_generated_tokens
        self._temperature = float(cfg.temperature)
        self._kl_coeff = cfg.kl_coeff
        self._gamma = cfg.gamma
        self._lmbda = cfg.lmbda
        self._whiten_rewards = cfg.whiten_rewards
        self._clip_grad_norm = cfg.clip_grad_norm
        self._save_every_n_steps = cfg.save_every_n_steps
        self._save_every_n_epochs = cfg.save_every_n_epochs
        self._log_every_n_steps = cfg.log_every_n_steps
        self._log_samples_every_n_steps = cfg.log_samples_every_n_steps
        self._score_history: List[Dict[str, float]] = []  # for the end-of-run summary
        self._log_peak_memory_stats = cfg.log_peak_memory_stats and self._device.type == "cuda"
        self._recompiles = RecompileCounter()
        self._packed_tokens = PackedTokens()
        self.steps_run = 0
        self.epochs_run = 0
        self._batches_run_in_epoch = 0  # the data position inside the current epoch
        self._skipped = SkippedSteps(max_consecutive=cfg.max_consecutive_skipped_steps)
        self._pending_rng_state = None  # restored once the data iterator is back in place
        self._last_saved_step = None

    def setup(self, cfg: DictConfig) -> None:
        # First, before anything is written to output_dir: a fresh run must not overwrite one.
        resume_from = checkpointing.checkpoint_to_resume(self._output_dir, cfg.resume_from_checkpoint)
        self._metric_logger = self._setup_metric_logger(cfg)
        self._metric_logger.log_config(cfg)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        validate_with_tokenizer(cfg, self._tokenizer)
        self._pad_id = self._tokenizer.pad_id
        self._stop_token_ids = torch.tensor(list(cfg.stop_token_ids), device=self._device)
        # Every prompt is read and checked before any weights load.
        self._sampler, self._dataloader = self._setup_data(cfg)
        check_plan(cfg, self._prompt_len, log)
        reward_model = self._setup_models(cfg, resume_from)
        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._optimizer = (
            InBackwardOptimizer(cfg.optimizer, {"policy": self._policy_model, "value": self._value_model})
            if self._optimizer_in_bwd
            else build_optimizer(cfg.optimizer, chain(self._policy_model.parameters(),
                                                      self._value_model.parameters()))
        )
        self._lr_scheduler = self._setup_lr_scheduler(cfg.lr_scheduler)
        self._profiler = training.setup_torch_profiler(enabled=False)[0] if cfg.profiler is None \
            else config.instantiate(cfg.profiler)[0]
        self._epsilon, self._value_clip_range, self._value_coeff = self._setup_loss(cfg.loss)
        # Under FSDP generation runs on the whole policy, gathered once per step; compiled
        # scoring (one graph, no FSDP hooks inside) on whole scoring models, gathered while it
        # scores. Eager scoring gathers them layer by layer; what stays gathered after is freed
        # after the rollout.
        self._scoring_models = [m for m in (self._ref_policy_model, self._value_model, reward_model) if m is not None]
        self._rollout = self._setup_rollout(cfg, reward_model)
        # FSDP2's hooks run outside dynamo: under FSDP the region breaks its graph at each
        # sharded module's forward (the pieces between are compiled).
        self._ppo_loss_step = maybe_compile(packed_ppo_loss_step, enabled=self._compile.loss_step,
                                            fullgraph=self._world_size == 1)
        log.info(f"Compiled regions: {self._compile}")
        if resume_from:
            self._load_training_state(resume_from)

    def _setup_models(self, cfg: DictConfig, resume_from: Optional[str]) -> Optional[torch.nn.Module]:
        """Policy, reference, value model (from ``resume_from`` when resuming); returns the
        reward model, or None for a function reward."""
        weights = checkpointing.checkpointer_overrides(resume_from) if resume_from else {}
        self._policy_model = self._setup_model(
            cfg.policy_model, "checkpointer", weights.get("policy", {}), trainable=True, cfg=cfg
        )
        self._ref_policy_model = self._setup_model(
            cfg.policy_model, "ref_policy_checkpointer", {}, trainable=False, cfg=cfg
        )
        self._value_model = self._setup_model(
            cfg.reward_and_value_model, "value_checkpointer", weights.get("value", {}),
            trainable=True, cfg=cfg,
        )
        reward_model = None if cfg.reward is not None else self._setup_model(
            cfg.reward_and_value_model, "reward_checkpointer", {}, trainable=False, cfg=cfg
        )
        self._checkpoints = checkpointing.CheckpointManager(
            self._output_dir, cfg.checkpointer, cfg.value_checkpointer,
            keep_last_n=cfg.keep_last_n_checkpoints,
        )
        return reward_model

    def _setup_rollout(self, cfg: DictConfig, reward_model: Optional[torch.nn.Module]) -> Rollout:
        generator = Generator(
            self._policy_model,
            batch_size=self._forward_batch_size // self._world_size,
            max_prompt_len=self._prompt_len,
            max_generated_tokens=self._response_len,
            pad_id=self._pad_id,
            stop_token_ids=list(cfg.stop_token_ids),
            temperature=self._temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            compiled=self._compile.generate and not self._compile.rollout,
            compile_mode=self._compile.mode,
            dtype=self._dtype,
            device=self._device,
        )
        if self._compile.rollout and (self._compile.generate or self._compile.trajectory):
            log.warning("compile.rollout compiles steps 1-6 as one region; "
                        "compile.generate and compile.trajectory are unused.")
        return Rollout(
            generator,
            self._ref_policy_model,
            self._value_model,
            ModelReward(reward_model) if reward_model is not None
            else FunctionReward(config.instantiate(cfg.reward), self._tokenizer),
            self._stop_token_ids,
            pad_id=self._pad_id,
            penalise_no_eos=cfg.penalise_no_eos,
            min_response_length=cfg.min_response_length,
            reward_penalty=cfg.reward_penalty,
            compile_trajectory=self._compile.trajectory and not self._compile.rollout,
            fused=self._compile.rollout,
            generation_context=partial(distributed.gathered, self._policy_model),
            scoring_context=partial(distributed.gathered, *self._scoring_models)
            if self._compile.trajectory or self._compile.rollout else nullcontext,
        )

    def _load_training_state(self, checkpoint: str) -> None:
        state = checkpointing.load_training_state(checkpoint)
        models = {"policy": self._policy_model, "value": self._value_model}
        if self._world_size == 1 and not distributed.keyed_by_name(state["optimizer"]):
            self._optimizer.load_state_dict(state["optimizer"])
        else:  # saved or loaded on several ranks: a full state keyed by parameter name
            distributed.load_full_optimizer_state_dict(models, self._optimizer, state["optimizer"])
        if self._lr_scheduler is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.steps_run, self.epochs_run = state["steps_run"], state["epochs_run"]
        self._batches_run_in_epoch = state["batches_run_in_epoch"]
        self._skipped.load_state_dict(state["skipped_steps"])
        self._pending_rng_state = state["rng"]
        if self._world_size > 1:
            per_rank = state.get("rng_per_rank") or []
            self._pending_rng_state = per_rank[distributed.rank()] if len(per_rank) == self._world_size else None
            if self._pending_rng_state is None and self._is_rank_zero:
                log.warning(f"{checkpoint} was saved on {len(per_rank) or 1} process(es), not "
                            f"{self._world_size}: the random states start afresh.")
        self._last_saved_step = self.steps_run

    def _setup_metric_logger(self, cfg: DictConfig):
        if not self._is_rank_zero:
            return distributed.NullMetricLogger()
        if cfg.metric_logger is None:
            return training.metric_logging.DiskLogger(log_dir=f"{cfg.output_dir}/logs")
        return config.instantiate(cfg.metric_logger)

    def _setup_model(
        self, cfg_model: DictConfig, checkpointer_key: str, overrides: Dict, *,
        trainable: bool, cfg: DictConfig,
    ) -> torch.nn.Module:
        checkpointer = config.instantiate(cfg[checkpointer_key], **overrides)
        state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        checkpointing.check_shapes(model, state_dict, checkpointer_key)
        model.load_state_dict(state_dict)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        # Dropout would make the trajectory's logprobs disagree with the loss step's.
        training.disable_dropout(model)
        if trainable and cfg.enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        if self._world_size > 1 and (trainable or cfg.shard_frozen_models):
            distributed.shard(model)  # else the frozen models stay whole on every rank
        return model

    def _setup_lr_scheduler(self, cfg_scheduler: Optional[DictConfig]):
        if cfg_scheduler is None:
            return None
        # torchtune's schedulers take the optimizer and the run's length in optimizer steps.
        optimizer_steps = self._num_steps * self._ppo_epochs * (self._batch_size // self._ppo_batch_size)
        return config.instantiate(
            cfg_scheduler, self._optimizer, num_training_steps=optimizer_steps
        )

    def _setup_loss(self, cfg_loss: DictConfig) -> Tuple[float, float, float]:
        # Accepts torchtune's `_component_: torchtune.rlhf.loss.PPOLoss` block or plain keys.
        loss = config.instantiate(cfg_loss) if "_component_" in cfg_loss else cfg_loss
        return float(loss.epsilon), float(loss.value_clip_range), float(loss.value_coeff)

    def _setup_data(self, cfg: DictConfig) -> Tuple[DistributedSampler, DataLoader]:
        dataset = instantiate_dataset(cfg.dataset, self._tokenizer)
        num_long = validate_dataset(dataset, cfg)
        if self._prompt_len is None:  # max_prompt_len: null
            self._prompt_len = max(len(dataset[i]["tokens"]) for i in range(len(dataset)))
            check_sequence_length(cfg, self._prompt_len)
            log.info(f"max_prompt_len: null, so P = {self._prompt_len}, the longest prompt.")
        if num_long:
            log.info(f"{num_long} of {len(dataset)} prompts are longer than max_prompt_len="
                     f"{self._prompt_len}; their last {self._prompt_len} tokens are kept.")
        sampler = DistributedSampler(
            dataset, num_replicas=self._world_size, rank=distributed.rank(),
            shuffle=cfg.shuffle, seed=self.seed,
        )
        collate = partial(
            left_pad_prompts,
            max_prompt_len=self._prompt_len,
            pad_id=self._pad_id,
            long_prompts=cfg.long_prompts,
        )
        loader = DataLoader(
            dataset, batch_size=self._rank_batch_size, sampler=sampler, drop_last=True, collate_fn=collate
        )
        return sampler, loader

    def ppo_update(
        self, trajectory: Trajectory, advantages: torch.Tensor, returns: torch.Tensor, timer: PhaseTimer
    ) -> List[rlhf.PPOStats]:
        """``ppo_epochs`` passes over shuffled minibatches, accumulating gradients per minibatch.

        A minibatch's loss is the sum of its ``gradient_accumulation_steps`` micro-batches'
        masked means; the loss step runs on their real tokens only, packed into fixed-shape
        micro-steps. Returns the stats of every micro-batch whose minibatch update was applied;
        an update with a non-finite loss or gradient norm is skipped (see :meth:`_optimizer_step`).
        """
        stats = []
        # On W ranks each shuffles its own rows into minibatches of ppo_batch_size / W, which
        # together form one global minibatch.
        batch_size, ppo_batch_size = self._rank_batch_size, self._rank_ppo_batch_size
        micro_batch_size = ppo_batch_size // self._grad_accum
        lengths = packing.sequence_lengths(trajectory, self._prompt_len)  # one host sync
        for _ in range(self._ppo_epochs):
            order = torch.randperm(batch_size, device=self._device).tolist()
            for start in range(0, batch_size, ppo_batch_size):
                minibatch = order[start : start + ppo_batch_size]
                micro_batches = [minibatch[i : i + micro_batch_size]
                                 for i in range(0, len(minibatch), micro_batch_size)]
                with timer("loss_step"):
                    minibatch_stats = self._loss_and_backward(
                        trajectory, advantages, returns, micro_batches, lengths
                    )
                with timer("optimizer"):
                    if self._optimizer_step(minibatch_stats):
                        stats.extend(minibatch_stats)
        return stats

    def _optimizer_step(self, minibatch_stats: List[rlhf.PPOStats]) -> bool:
        """Clip, then step; or drop the gradients when the loss or their norm is not finite.

        On W ranks ``minibatch_stats`` are this rank's shares; they are summed over ranks in
        place first, so every rank takes the same decision.
        """
        if self._world_size > 1:
            totals = distributed.all_reduce_sum(torch.stack([torch.stack(s) for s in minibatch_stats]))
            minibatch_stats[:] = [rlhf.PPOStats(*row.unbind()) for row in totals]
        if self._optimizer_in_bwd:  # stepped in backward, which ran only for a finite loss
            return bool(torch.stack([s.loss for s in minibatch_stats]).sum().isfinite())
        params = chain(self._policy_model.parameters(), self._value_model.parameters())
        max_norm = float("inf") if self._clip_grad_norm is None else float(self._clip_grad_norm)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):  # sharded models: the global norm
            grad_norm = grad_norm.full_tensor()
        loss = torch.stack([s.loss for s in minibatch_stats]).sum()
        finite = torch.stack([loss.isfinite(), grad_norm.isfinite()]).tolist()  # one host sync
        if all(finite):
            self._optimizer.step()
            if self._lr_scheduler is not None:
                self._lr_scheduler.step()
        else:
            quantity = "loss" if not finite[0] else "gradient norm"
            log.warning(f"step {self.steps_run + 1}: non-finite {quantity} ({loss.item():.4g}, grad "
                        f"norm {grad_norm.item():.4g}); this minibatch update is skipped.")
        self._optimizer.zero_grad(set_to_none=True)
        return all(finite)

    def _loss_and_backward(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        micro_batches: List[List[int]],
        lengths: packing.SequenceLengths,
    ) -> List[rlhf.PPOStats]:
        """Loss and gradients of one minibatch (trajectory rows in micro-batches), packed.

        Returns one :class:`~torchtune_ppo.ppo.rlhf.PPOStats` per micro-batch, scaled by
        ``1 / gradient_accumulation_steps``.
        """
        valid_totals = None
        if self._world_size > 1:  # token weights over the global micro-batch's valid tokens
            counts = torch.tensor([sum(lengths.valid_counts[i] for i in idxs) for idxs in micro_batches])
            valid_totals = distributed.all_reduce_sum(counts.to(self._device)).tolist()
        # Under FSDP the compiled step is split into frames at its hooks, and those frames
        # specialise any dynamic size: fixed shapes there, one graph either way.
        fixed = self._world_size > 1
        rows = packing.default_rows(len(micro_batches[0]), fixed_shapes=fixed)
        steps = packing.pack_minibatch(
            trajectory, advantages, returns, micro_batches, lengths,
            prompt_len=self._prompt_len, rows=rows, valid_totals=valid_totals,
            num_chunks=packing.logprob_chunks(rows * self._response_len), fixed_shapes=fixed,
        )
        self._packed_tokens.update(steps, lengths, micro_batches)
        steps = distributed.pad_micro_steps(steps)  # every rank runs as many
        step_stats, losses = [], []
        for step in steps:  # one compiled graph: dynamic in rows and reads, or fixed shapes
            loss, stats = self._ppo_loss_step(
                self._policy_model,
                self._value_model,
                *(step if fixed else packing.mark_dynamic(step)),
                temperature=self._temperature,
                epsilon=self._epsilon,
                value_clip_range=self._value_clip_range,
                value_coeff=self._value_coeff,
                num_micro_batches=len(micro_batches),
            )
            if self._optimizer_in_bwd:
                losses.append(loss)  # one backward for the minibatch: its hooks step the weights
            else:
                loss.backward()
            step_stats.append(stats)
        if losses:
            total = torch.stack(losses).sum()
            if total.isfinite():
                total.backward()
            else:
                log.warning(f"step {self.steps_run + 1}: non-finite loss ({total.item():.4g}); "
                            "this minibatch update is skipped.")
        return packing.micro_batch_stats(step_stats)

    def train_step(
        self, prompts: torch.Tensor, prompt_lens: torch.Tensor, num_truncated: int,
        references: Optional[List[Optional[str]]] = None,
    ) -> Dict[str, float]:
        """One PPO step on ``prompts [B, P]`` of real lengths ``prompt_lens [B]``; returns its metrics.

        ``num_truncated``, the prompts the collator cut to ``max_prompt_len``, is only logged;
        ``references`` (the dataset's answers, one per row) go to a function reward.
        A batch with a non-finite score gets no update at all.
        """
        timer = PhaseTimer(self._device)
        self._packed_tokens.reset()
        with timer("step"):
            trajectory = self._rollout(prompts, prompt_lens, self._rng, timer, references)
            distributed.reshard(*self._scoring_models)  # what eager scoring's forwards left gathered
            bad_rows = int(distributed.all_reduce_sum((~trajectory.scores.isfinite()).sum()))
            if bad_rows:
                log.warning(f"step {self.steps_run + 1}: the reward is not finite in {bad_rows} of "
                            f"{len(trajectory.scores)} rows; the update is skipped.")
            advantages, returns, kl, kl_rewards = self.estimate_advantages(trajectory, timer)
            stats = [] if bad_rows else self.ppo_update(trajectory, advantages, returns, timer)
        if (self._is_rank_zero and self._log_samples_every_n_steps
                and (self.steps_run + 1) % self._log_samples_every_n_steps == 0):
            rows = sample_rows(trajectory, prompt_lens, self._tokenizer, self._prompt_len, n=4)
            log_samples(rows, self.steps_run + 1, f"{self._output_dir}/logs", log)
        if self._world_size > 1:  # metrics over the global batch
            trajectory = SimpleNamespace(**{k: distributed.all_gather_rows(getattr(trajectory, k)) for k in
                                            ("query_responses", "scores", "response_padding_masks", "seq_lens")})
            kl, kl_rewards = distributed.all_gather_rows(kl), distributed.all_gather_rows(kl_rewards)
        metrics = step_metrics(trajectory, stats, kl, kl_rewards, timer.times,
                               grad_accum=self._grad_accum, ppo_epochs=self._ppo_epochs)
        updates = self._ppo_epochs * (self._batch_size // self._ppo_batch_size)
        self._skipped.count(len(stats) < updates * self._grad_accum)
        metrics.update(
            prompts_truncated=float(num_truncated),
            nonfinite_score_rows=float(bad_rows),
            skipped_updates=float(updates - len(stats) // self._grad_accum),
            skipped_steps=float(self._skipped.total),
            lr=float(self._optimizer.param_groups[0]["lr"]),
            recompiles=float(self._recompiles.since_mark),
            loss_step_slots_per_token=self._packed_tokens.ratio,
        )
        if self._log_peak_memory_stats:
            metrics.update(training.get_memory_stats(device=self._device))
        return metrics

    def estimate_advantages(
        self, trajectory: Trajectory, timer: PhaseTimer
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """KL-penalised rewards, then GAE: ``advantages, returns, kl, kl_rewards``, each ``[B, T]``."""
        with timer("advantages"), torch.no_grad():
            valid = ~trajectory.response_padding_masks
            rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
                trajectory.scores,
                trajectory.logprobs,
                trajectory.ref_logprobs,
                self._kl_coeff,
                trajectory.seq_lens,
                valid,
            )
            # Whitening over every rank's valid tokens.
            reduce = distributed.all_reduce_sum if self._world_size > 1 else None
            if self._whiten_rewards:
                rewards = rlhf.whiten(rewards, valid, reduce=reduce)
            advantages, returns = rlhf.estimate_advantages(
                trajectory.values, rewards, self._gamma, self._lmbda, valid, reduce=reduce
            )
        return advantages, returns, kl, kl_rewards

    def train(self, on_step: Optional[Callable[[int, Dict[str, float]], None]] = None) -> None:
        """Runs PPO steps until ``num_steps``; ``on_step(step, metrics)`` is called after each.

        SIGINT or SIGTERM finishes the current step, saves a checkpoint and exits.
        """
        pbar = tqdm(total=self._num_steps, initial=self.steps_run, desc="PPO", dynamic_ncols=True,
                    disable=not self._is_rank_zero)
        self._profiler.start()
        with stop_on_signals() as stop:
            while self.steps_run < self._num_steps and not stop:
                self._run_epoch(on_step, pbar, stop)
        self._profiler.stop()
        pbar.close()
        if self._last_saved_step != self.steps_run:
            self.save_checkpoint(self.steps_run)
        if self._is_rank_zero:
            log.info(run_summary(self._score_history, checkpointing.existing_checkpoints(self._output_dir)))
        if stop:
            log.warning(f"Stopped after step {self.steps_run}. To continue: tune run "
                        f"{' '.join(sys.argv)} output_dir={self._output_dir} resume_from_checkpoint=True")
            raise SystemExit(128 + stop.signum)

    def _run_epoch(self, on_step, pbar: tqdm, stop) -> None:
        self._sampler.set_epoch(self.epochs_run)
        batches = iter(self._dataloader)
        for _ in range(self._batches_run_in_epoch):  # resuming: the batches already trained on
            next(batches)
        if self._pending_rng_state is not None:
            checkpointing.restore_rng_state(self._pending_rng_state, [self._rng])
            self._pending_rng_state = None
        for batch in batches:
            metrics = self.train_step(
                batch["tokens"].to(self._device),
                batch["prompt_lens"].to(self._device),
                int(batch["num_truncated"]),
                batch.get("references"),
            )
            self.steps_run += 1
            self._batches_run_in_epoch += 1
            if not self._recompiles.marked:
                self._recompiles.mark()  # everything after the first step must reuse its graphs
            self._log(metrics, pbar)
            self._score_history.append({"scores": metrics["scores"]})
            self._profiler.step()
            if on_step is not None:
                on_step(self.steps_run, metrics)
            distributed.agree_on_stop(stop)  # torchrun signals ranks at slightly different times
            if self._save_due():
                self.save_checkpoint(self.steps_run)
            if self.steps_run == self._num_steps or stop:
                return
        self.epochs_run += 1
        self._batches_run_in_epoch = 0

    def _save_due(self) -> bool:
        every_n_steps = self._save_every_n_steps and self.steps_run % self._save_every_n_steps == 0
        # Saved at an epoch's last batch (not after the loop) so that a resume finds the data
        # iterator and the random state in the same order as the uninterrupted run.
        epoch_done = self._batches_run_in_epoch == len(self._dataloader)
        every_n_epochs = (self._save_every_n_epochs and epoch_done
                          and (self.epochs_run + 1) % self._save_every_n_epochs == 0)
        return bool(every_n_steps or every_n_epochs)

    def _log(self, metrics: Dict[str, float], pbar: tqdm) -> None:
        if self.steps_run % self._log_every_n_steps == 0:
            self._metric_logger.log_dict(metrics, step=self.steps_run)
        pbar.update(1)
        pbar.set_postfix(progress(metrics))

    def save_checkpoint(self, step: int) -> None:
        """Write ``<output_dir>/checkpoints/step_<step>``: policy and value in HF format and the
        training state (optimizer, counters, data position, random states), atomically."""
        models = {"policy": self._policy_model, "value": self._value_model}
        training_state = {
            # On W ranks: keyed by parameter name with full tensors, so any W can resume it.
            "optimizer": self._optimizer.state_dict() if self._world_size == 1
            else distributed.full_optimizer_state_dict(models, self._optimizer),
            "lr_scheduler": None if self._lr_scheduler is None else self._lr_scheduler.state_dict(),
            "steps_run": self.steps_run,
            "epochs_run": self.epochs_run,
            "batches_run_in_epoch": self._batches_run_in_epoch,
            "skipped_steps": self._skipped.state_dict(),
            "rng": checkpointing.capture_rng_state([self._rng]),
        }
        if self._world_size > 1:  # resumed on the same number of ranks, each gets its own back
            training_state["rng_per_rank"] = distributed.all_gather_objects(training_state["rng"])
        # Every rank takes part in gathering the weights; rank 0 writes them. The random states
        # are rank 0's: a resume on another number of ranks draws different samples.
        policy, value = (distributed.full_state_dict(m) for m in models.values())
        if self._is_rank_zero:
            self._checkpoints.save(step, policy, value, training_state)
        distributed.barrier()
        self._last_saved_step = step

    def cleanup(self) -> None:
        self._metric_logger.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    check_cli_overrides(sys.argv[1:])
    cfg = validate_config(cfg)
    config.log_config(recipe_name="PPOFullFinetuneRecipe", cfg=cfg)
    recipe = PPOFullFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
