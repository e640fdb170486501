"""PPO full fine-tuning of a causal LM against a reward, with compiled hot regions.

Run it with ``tune run ppo_full_finetune --config <config.yaml> [key=value ...]``. To edit it,
copy this file into your own folder under another name (``my_ppo.py``) and run
``tune run my_ppo.py --config ...`` there: an installed ``ppo_full_finetune`` would shadow a
copy of the same name.

One PPO step reads as:

    prompts [B, P] ─ rollout    ─► Trajectory: generate (query_responses [B, P+T], logprobs
                                   [B, T]), then score (ref logprobs, values, truncation, scores)
                   ─ advantages ─► KL-penalised rewards, then GAE and whitening (or a critic-free
                                   estimator: GRPO, RLOO, REINFORCE++, over groups of responses)
                   ─ update     ─► ppo_epochs × minibatches: packed loss step, backward, optimizer
                   ─ metrics, checkpoint

This file holds the PPO decisions a user may change; the library (``torchtune_ppo``) holds the
rules that keep the compiled regions, FSDP and resumption correct.
"""

import sys
from typing import Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, modules, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.metric_logging import DiskLogger
from tqdm import tqdm

from torchtune_ppo import checkpointing, compile as compiling, distributed, lora
from torchtune_ppo.config import (
    check_cli_overrides,
    check_sequence_length,
    cpu_threads,
    instantiate_dataset,
    parse_compile,
    shares_reward_value_base,
    validate_config,
    validate_dataset,
    validate_with_tokenizer,
)
from torchtune_ppo.config.checks import warn_unknown_tokens
from torchtune_ppo.data import prompt_loader
from torchtune_ppo.ppo.advantages import (
    advantage_metrics, estimate_advantages, group_metrics, repeat_prompts, uses_value_model,
)
from torchtune_ppo.ppo.kl import KLController
from torchtune_ppo.ppo.update import LossSettings, PPOUpdate, nonfinite_score_rows, num_updates
from torchtune_ppo.ppo.value_pretrain import ValuePretraining
from torchtune_ppo.rewards import FunctionReward
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout import Rollout, ScoringSettings
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.run.guards import SkippedSteps, StepInProgress, on_step_failure
from torchtune_ppo.run.interrupt import resume_command, stop_on_signals
from torchtune_ppo.run.memory import check_plan
from torchtune_ppo.run.metrics import NullMetricLogger, PhaseTimer, step_metrics
from torchtune_ppo.run.optim import InBackwardOptimizer, build_optimizer
from torchtune_ppo.run.watch import log_samples, progress, run_summary, sample_rows

log = utils.get_logger("INFO")


class PPOFullFinetuneRecipe(FTRecipeInterface):
    """PPO full fine-tuning: a trained policy and value model, a frozen reference policy and a
    reward (a frozen reward model, or a function of the decoded texts). With a critic-free
    ``advantage_estimator`` (GRPO, RLOO, REINFORCE++) there is no value model at all.

    Each model is loaded through the torchtune checkpointer named in the config; the value
    model starts from the reward model's checkpoint (or the policy's, see ``value_head_init``).
    A policy built with a LoRA builder trains its adapters only, and the reference policy is
    that same model with its adapters off (README, "LoRA"). See the README for every config key.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        # Under torchrun: one rank per process, each with 1/W of every batch of prompts.
        distributed.init_distributed(self._device)
        distributed.check_world_size(cfg, distributed.world_size())
        self._is_rank_zero = distributed.rank() == 0
        if self._device.type == "cpu":
            torch.set_num_threads(cpu_threads(cfg.cpu_threads))
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self.seed = training.set_seed(seed=cfg.seed)
        # Each rank samples its own prompts' responses from its own stream.
        self._rng = torch.Generator(self._device).manual_seed(self.seed + distributed.rank())
        self._output_dir, self._num_steps = cfg.output_dir, cfg.num_ppo_steps
        self._prompt_len = cfg.max_prompt_len
        # The KL penalty's coefficient: fixed, or adapted towards kl_target after every step.
        self._kl = KLController(cfg.kl_coeff, cfg.kl_target, cfg.kl_horizon)
        self._kl_estimator, self._batch_size = cfg.kl_estimator, cfg.batch_size
        self._gamma, self._lmbda = cfg.gamma, cfg.lmbda
        # Decoupled GAE (VAPO): the actor's lambda, fixed or per response length; None: lmbda.
        self._lmbda_actor, self._lmbda_length_alpha = cfg.lmbda_actor, cfg.lmbda_length_alpha
        # Each prompt is generated n times (a group); the batch then has batch_size * n rows.
        self._estimator, self._n = cfg.advantage_estimator, cfg.num_samples_per_prompt
        self._whiten_rewards = cfg.whiten_rewards
        # Value pretraining (VC-PPO, VAPO): steps before PPO's first that train the value model alone.
        self._value_pretrain = ValuePretraining.from_config(cfg.value_pretrain)
        self._save_every_n_steps, self._save_every_n_epochs = cfg.save_every_n_steps, cfg.save_every_n_epochs
        self._log_every_n_steps = cfg.log_every_n_steps
        self._log_samples_every_n_steps = cfg.log_samples_every_n_steps
        self._log_peak_memory_stats = cfg.log_peak_memory_stats and self._device.type == "cuda"
        self._score_history: List[Dict[str, float]] = []  # for the end-of-run summary
        self._recompiles = compiling.RecompileCounter()
        self._skipped = SkippedSteps(max_consecutive=cfg.max_consecutive_skipped_steps)
        self.steps_run = self.epochs_run = 0
        self._batches_run_in_epoch = 0  # the data position inside the current epoch
        self._pending_rng_state = None  # restored once the data iterator is back in place
        self._last_saved_step = None

    def setup(self, cfg: DictConfig) -> None:
        # First, before anything is written to output_dir: a fresh run must not overwrite one.
        resume_from = checkpointing.checkpoint_to_resume(self._output_dir, cfg.resume_from_checkpoint)
        if resume_from:  # before any weights load: the keys the saved state depends on must match
            checkpointing.check_resume_config(resume_from, cfg)
        checkpointing.check_writable(self._output_dir)
        if not self._is_rank_zero:
            self._metric_logger = NullMetricLogger()
        elif cfg.metric_logger is None:
            self._metric_logger = DiskLogger(log_dir=f"{cfg.output_dir}/logs")
        else:
            self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        validate_with_tokenizer(cfg, self._tokenizer)
        # Every prompt is read and checked before any weights load.
        self._sampler, self._dataloader = self._setup_data(cfg)
        check_plan(cfg, self._prompt_len, log)
        regions = compiling.regions(parse_compile(cfg.compile), world_size=distributed.world_size())
        log.info(f"Compiled regions: {parse_compile(cfg.compile)}")
        reward_model = self._setup_models(cfg, resume_from)
        self._rollout = self._setup_rollout(cfg, reward_model, regions)
        self._update = self._setup_update(cfg, regions.loss_step)
        models = self._trained_models()
        manager = checkpointing.CheckpointManager(self._output_dir, cfg.checkpointer, cfg.value_checkpointer,
                                                  keep_last_n=cfg.keep_last_n_checkpoints)
        self._checkpoints = checkpointing.CheckpointClient(
            manager, models, self._update.optimizer, self._update.lr_scheduler, self._skipped, [self._rng],
            run_config=checkpointing.config_to_save(cfg), kl_controller=self._kl,
            merge_adapters_at_end=not cfg.save_adapter_weights_only)
        self._step = StepInProgress(self._checkpoints.capture_rng)
        self._profiler = (training.setup_torch_profiler(enabled=False)[0] if cfg.profiler is None
                          else config.instantiate(cfg.profiler)[0])
        if resume_from:
            state = self._checkpoints.load(resume_from)
            self.steps_run, self.epochs_run = state["steps_run"], state["epochs_run"]
            self._batches_run_in_epoch, self._pending_rng_state = state["batches_run_in_epoch"], state["rng"]
            self._value_pretrain.load_state_dict(state["value_pretrain"], ppo_steps_run=self.steps_run)
            self._last_saved_step = self._global_step
            # After the restored state, which holds the saved optimizer settings: the config's win.
            checkpointing.apply_optimizer_overrides(self._update.optimizer, cfg.optimizer, self._update.lr_scheduler)

    def _setup_models(self, cfg: DictConfig, resume_from: Optional[str]) -> Optional[torch.nn.Module]:
        """Policy, reference, value model (from ``resume_from`` when resuming); returns the
        reward model, or None for a function reward."""
        weights = checkpointing.checkpointer_overrides(resume_from) if resume_from else {}
        self._policy_model = self._setup_model(
            cfg.policy_model, "checkpointer", weights.get("policy", {}), trainable=True, cfg=cfg,
            resume_from=resume_from and (resume_from, "policy"))
        # LoRA: the reference is the policy's frozen base, its adapters off while it scores.
        self._ref_policy_model = self._policy_model if lora.has_adapters(self._policy_model) else self._setup_model(
            cfg.policy_model, "ref_policy_checkpointer", {}, trainable=False, cfg=cfg)
        self._value_model = None  # critic-free estimators: no value model is built, trained or saved
        reward_head = {}  # the reward checkpoint's head, when the reward model shares the value model's base
        if uses_value_model(cfg.advantage_estimator):
            self._value_model = self._setup_model(
                cfg.reward_and_value_model, "value_checkpointer", weights.get("value", {}), trainable=True, cfg=cfg,
                resume_from=resume_from and (resume_from, "value"), train_head=True, reward_head=reward_head)
        if cfg.reward is not None:
            return None
        if reward_head:  # one frozen base: the value model's, its adapters off, and the checkpoint's head
            log.info("The reward model is the value model's base with its adapters off (share_reward_value_base).")
            return lora.SharedBaseReward(self._value_model, reward_head["output"])
        return self._setup_model(cfg.reward_and_value_model, "reward_checkpointer", {}, trainable=False, cfg=cfg)

    def _setup_model(self, cfg_model: DictConfig, checkpointer_key: str, overrides: Dict, *,
                     trainable: bool, cfg: DictConfig, resume_from=None, train_head: bool = False,
                     reward_head: Optional[Dict] = None) -> torch.nn.Module:
        """Builds, loads and freezes one model; a LoRA value model whose checkpoint is the reward
        model's also puts that checkpoint's head (frozen) in ``reward_head["output"]``."""
        rng = checkpointing.capture_rng_state()
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        adapters = lora.has_adapters(model)
        if adapters and not trainable:  # a LoRA reward model's adapters stay off: their random init
            checkpointing.restore_rng_state(rng)  # draws nothing, as with a shared base (none built)
        # A LoRA model's base always comes from its own checkpointer; a resume adds the adapters.
        checkpointer = config.instantiate(cfg[checkpointer_key], **({} if adapters else overrides))
        state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
        checkpointing.check_shapes(model, state_dict, checkpointer_key)
        checkpointing.check_loaded_finite(state_dict, checkpointer_key)
        if reward_head is not None and shares_reward_value_base(cfg, value_is_lora=adapters):
            reward_head["output"] = lora.checkpoint_head(model, state_dict)  # before a resume loads the trained one
        if adapters:  # the base frozen; the adapters (and a value head) train, or stay off for good
            saved = (checkpointing.load_adapters(*resume_from), resume_from[0]) if trainable and resume_from else None
            lora.setup_lora_model(model, state_dict, checkpointer_key, trainable=trainable, train_head=train_head,
                                  saved=saved)
        else:
            model.load_state_dict(state_dict)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        # Dropout would make the trajectory's logprobs disagree with the loss step's.
        training.disable_dropout(model)
        if trainable and cfg.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        if distributed.world_size() > 1 and (trainable or cfg.shard_frozen_models):
            distributed.shard(model)  # else the frozen models stay whole on every rank
        return model

    def _setup_rollout(self, cfg: DictConfig, reward_model: Optional[torch.nn.Module],
                       regions: compiling.Regions) -> Rollout:
        generator = Generator(
            self._policy_model,
            batch_size=cfg.forward_batch_size // distributed.world_size(),
            max_prompt_len=self._prompt_len,
            max_generated_tokens=cfg.max_generated_tokens,
            pad_id=self._tokenizer.pad_id,
            stop_token_ids=list(cfg.stop_token_ids),
            temperature=float(cfg.temperature),
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            compiled=regions.generate,
            compile_mode=regions.mode,
            group_size=cfg.num_samples_per_prompt if cfg.share_group_prefill else 1,
            dtype=self._dtype,
            device=self._device,
        )
        reward = (ModelReward(reward_model) if reward_model is not None
                  else FunctionReward(config.instantiate(cfg.reward), self._tokenizer))
        settings = ScoringSettings(
            prompt_len=self._prompt_len, pad_id=self._tokenizer.pad_id, temperature=float(cfg.temperature),
            penalise_no_eos=cfg.penalise_no_eos, min_response_length=cfg.min_response_length,
            reward_penalty=float(cfg.reward_penalty),
        )
        stop_token_ids = torch.tensor(list(cfg.stop_token_ids), device=self._device)
        reference = None  # a separate frozen model; for a LoRA policy, the policy with adapters off
        if self._ref_policy_model is self._policy_model:
            reference = lambda: lora.adapters_off(self._policy_model)  # noqa: E731
        return Rollout(generator, self._ref_policy_model, self._value_model, reward, stop_token_ids,
                       settings, regions, reference=reference)

    def _trained_models(self) -> Dict[str, torch.nn.Module]:
        return {"policy": self._policy_model, **({} if self._value_model is None else {"value": self._value_model})}

    def _setup_update(self, cfg: DictConfig, loss_step: Callable) -> PPOUpdate:
        models = self._trained_models()
        rows = cfg.batch_size * cfg.num_samples_per_prompt  # responses per step
        optimizer = (InBackwardOptimizer(cfg.optimizer, models) if cfg.optimizer_in_bwd else
                     build_optimizer(cfg.optimizer, [p for m in models.values() for p in m.parameters()
                                                     if p.requires_grad]))  # LoRA: adapters only
        lr_scheduler = None
        if cfg.lr_scheduler is not None:  # torchtune's schedulers count optimizer steps
            steps = self._num_steps * num_updates(rows, cfg.ppo_batch_size, cfg.ppo_epochs)
            lr_scheduler = config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps)
        # Accepts torchtune's `_component_: torchtune.rlhf.loss.PPOLoss` block or plain keys.
        loss = config.instantiate(cfg.loss) if "_component_" in cfg.loss else cfg.loss
        return PPOUpdate(
            self._policy_model, self._value_model, optimizer, lr_scheduler, loss_step,
            batch_size=rows, ppo_batch_size=cfg.ppo_batch_size, ppo_epochs=cfg.ppo_epochs,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            prompt_len=self._prompt_len, response_len=cfg.max_generated_tokens,
            temperature=float(cfg.temperature),
            loss=LossSettings.from_config(loss),
            clip_grad_norm=cfg.clip_grad_norm, optimizer_in_bwd=cfg.optimizer_in_bwd,
            critic_warmup_steps=cfg.critic_warmup_steps,  # the first N steps train the value model only
        )

    def _setup_data(self, cfg: DictConfig):
        dataset = instantiate_dataset(cfg.dataset, self._tokenizer)
        num_long = validate_dataset(dataset, cfg)
        warn_unknown_tokens(dataset, self._tokenizer)
        if self._prompt_len is None:  # max_prompt_len: null
            self._prompt_len = max(len(dataset[i]["tokens"]) for i in range(len(dataset)))
            check_sequence_length(cfg, self._prompt_len)
            log.info(f"max_prompt_len: null, so P = {self._prompt_len}, the longest prompt.")
        if num_long:
            log.info(f"{num_long} of {len(dataset)} prompts are longer than max_prompt_len="
                     f"{self._prompt_len}; their last {self._prompt_len} tokens are kept.")
        return prompt_loader(dataset, batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=self.seed,
                             max_prompt_len=self._prompt_len, pad_id=self._tokenizer.pad_id,
                             long_prompts=cfg.long_prompts)

    def train_step(
        self, prompts: torch.Tensor, prompt_lens: torch.Tensor, num_truncated: int,
        references: Optional[List[Optional[str]]] = None,
    ) -> Dict[str, float]:
        """One PPO step on ``prompts [B, P]`` of real lengths ``prompt_lens [B]``; returns its metrics.

        ``num_truncated``, the prompts the collator cut to ``max_prompt_len``, is only logged;
        ``references`` (the dataset's answers, one per row) go to a function reward.
        A batch with a non-finite score gets no update at all. While value pretraining is on,
        the step is a pretraining step: the critic's returns use its lambda and only the value
        model is updated.
        """
        timer, step = PhaseTimer(self._device), self.steps_run + 1
        pretraining = self._value_pretrain.active
        lmbda = self._value_pretrain.lmbda if pretraining else self._lmbda
        # [B * n, P]: each prompt n times in a row, so a group sits on this rank
        prompts, prompt_lens, references = repeat_prompts(prompts, prompt_lens, references, self._n)
        self._step.begin()  # what a failure of this step may still save
        with timer("step"):
            # step 1-6: generate the responses and score them
            trajectory = self._rollout(prompts, prompt_lens, self._rng, timer, references)
            bad_rows = nonfinite_score_rows(trajectory)
            if bad_rows:
                log.warning(f"step {step}: the reward is not finite in {bad_rows} of "
                            f"{len(trajectory.scores)} rows; the update is skipped.")
            # step 7: KL-penalised rewards, advantages and returns
            with timer("advantages"):
                adv = estimate_advantages(trajectory, kl_coeff=self._kl.value, gamma=self._gamma, lmbda=lmbda,
                                          whiten_rewards=self._whiten_rewards, kl_estimator=self._kl_estimator,
                                          advantage_estimator=self._estimator, num_samples_per_prompt=self._n,
                                          lmbda_actor=self._lmbda_actor, lmbda_length_alpha=self._lmbda_length_alpha)
            # step 8: the PPO update, skipped for a batch with a non-finite score
            if not bad_rows:
                self._step.update_begins()
                result = self._update(trajectory, adv.advantages, adv.returns, timer, step, value_pretrain=pretraining)
        logged_step = self._global_step + 1  # value pretraining's steps first
        every = self._log_samples_every_n_steps
        if self._is_rank_zero and every and logged_step % every == 0:
            rows = sample_rows(trajectory, prompt_lens, self._tokenizer, self._prompt_len, n=4)
            log_samples(rows, logged_step, f"{self._output_dir}/logs", log)
        return self._step_metrics(trajectory, adv, None if bad_rows else result, bad_rows, num_truncated, timer,
                                  adapt_kl=not pretraining)

    def _step_metrics(self, trajectory, adv, result, bad_rows: int, num_truncated: int, timer,
                      adapt_kl: bool = True) -> Dict[str, float]:
        """The step's logged metrics; counts a skipped step and adapts the KL coefficient (not
        after a value pretraining step)."""
        skipped = self._update.num_updates if result is None else result.skipped_updates
        self._skipped.count(skipped > 0)
        metrics = step_metrics(trajectory, [] if result is None else result.stats, adv.kl, adv.kl_rewards,
                               timer.times, grad_accum=self._update.gradient_accumulation_steps,
                               ppo_epochs=self._update.ppo_epochs)
        metrics.update(
            prompts_truncated=float(num_truncated), nonfinite_score_rows=float(bad_rows),
            skipped_updates=float(skipped), skipped_steps=float(self._skipped.total),
            lr=float(self._update.optimizer.param_groups[0]["lr"]),
            recompiles=float(self._recompiles.since_mark),
            loss_step_slots_per_token=float("nan") if result is None else result.slots_per_token,
            kl_coeff=self._kl.value,  # the coefficient this step used
            **advantage_metrics(adv),  # explained_variance, lmbda_actor
        )
        if self._n > 1:
            metrics.update(group_metrics(trajectory.scores, self._n))
        if adapt_kl:
            self._kl.update(metrics["kl"], n=self._batch_size * self._n)  # kl: the global batch's, on every rank
        if self._log_peak_memory_stats:
            metrics.update(training.get_memory_stats(device=self._device))
        return metrics

    def train(self, on_step: Optional[Callable[[int, Dict[str, float]], None]] = None) -> None:
        """Runs PPO steps until ``num_steps``; ``on_step(step, metrics)`` is called after each.

        SIGINT or SIGTERM finishes the current step, saves a checkpoint and exits. An exception
        saves the state after the last completed step when it can (see ``StepInProgress``).
        """
        pbar = tqdm(total=self._num_steps, initial=self.steps_run, desc="PPO", dynamic_ncols=True,
                    disable=not self._is_rank_zero)
        if self._value_pretrain.active and self._is_rank_zero:
            log.info(f"Value pretraining: up to {self._value_pretrain.max_steps - self._value_pretrain.steps_run} "
                     "steps on the starting policy's rollouts before PPO's first step.")
        self._profiler.start()
        resume = resume_command(sys.argv, self._output_dir)
        try:
            with stop_on_signals() as stop:
                while (self._value_pretrain.active or self.steps_run < self._num_steps) and not stop:
                    self._run_epoch(on_step, pbar, stop)
            if self._last_saved_step != self._global_step:
                self.save_checkpoint(self._global_step)
        except Exception as e:
            on_step_failure(e, self._step, steps_run=self._global_step, saved_step=self._last_saved_step,
                            save=self._save_after_failure, world_size=distributed.world_size(),
                            resume=resume, log=log, rank_zero=self._is_rank_zero)
            if isinstance(e, checkpointing.CheckpointWriteError):
                raise SystemExit(1) from e  # said above: where, why, and how to continue
            raise
        self._profiler.stop()
        pbar.close()
        if self._is_rank_zero:
            log.info(run_summary(self._score_history, checkpointing.existing_checkpoints(self._output_dir)))
        if stop:
            if self._is_rank_zero:
                log.warning(f"Stopped after step {self._global_step}. To continue: {resume}")
            raise SystemExit(128 + stop.signum)

    def _run_epoch(self, on_step, pbar: tqdm, stop) -> None:
        self._sampler.set_epoch(self.epochs_run)
        batches = iter(self._dataloader)
        for _ in range(self._batches_run_in_epoch):  # resuming: the batches already trained on
            next(batches)
        if self._pending_rng_state is not None:
            self._checkpoints.restore_rng(self._pending_rng_state)
            self._pending_rng_state = None
        for batch in batches:
            pretraining = self._value_pretrain.active
            metrics = self.train_step(batch["tokens"].to(self._device), batch["prompt_lens"].to(self._device),
                                      int(batch["num_truncated"]), batch.get("references"))
            self._count_step(metrics, pretraining)
            self._batches_run_in_epoch += 1
            if not self._recompiles.marked:
                self._recompiles.mark()  # everything after the first step must reuse its graphs
            self._log(metrics, pbar, ppo_step=not pretraining)
            if not pretraining:
                self._score_history.append({"scores": metrics["scores"]})
            self._profiler.step()
            if on_step is not None:
                on_step(self._global_step, metrics)
            stop.agree()  # every rank leaves after the same step
            if self._save_due():
                self.save_checkpoint(self._global_step)
            if self.steps_run == self._num_steps or stop:
                return
        self.epochs_run += 1
        self._batches_run_in_epoch = 0

    def _count_step(self, metrics: Dict[str, float], pretraining: bool) -> None:
        """A PPO step counts in ``steps_run``; a value pretraining step apart, and its value loss
        goes to the stopping rule. Adds the pretraining metrics to ``metrics``."""
        if not pretraining:
            self.steps_run += 1
            if self._value_pretrain.steps_run:  # a run that pretrained: its PPO rows say they are not
                metrics["value_pretrain"] = 0.0
            return
        self._value_pretrain.record(metrics["value_loss"])
        metrics.update(self._value_pretrain.metrics())
        if self._value_pretrain.done and self._is_rank_zero:
            log.info(f"Value pretraining done after {self._value_pretrain.steps_run} steps (value loss moving "
                     f"average {metrics['value_pretrain/loss_avg']:.4g}, relative change "
                     f"{metrics['value_pretrain/rel_change']:.3g}); PPO starts.")

    @property
    def _global_step(self) -> int:
        """Steps run, value pretraining's first: names the logged rows and the checkpoints."""
        return self._value_pretrain.steps_run + self.steps_run

    def _save_due(self) -> bool:
        every_n_steps = self._save_every_n_steps and self._global_step % self._save_every_n_steps == 0
        # Saved at an epoch's last batch (not after the loop) so that a resume finds the data
        # iterator and the random state in the same order as the uninterrupted run.
        epoch_done = self._batches_run_in_epoch == len(self._dataloader)
        every_n_epochs = (self._save_every_n_epochs and epoch_done
                          and (self.epochs_run + 1) % self._save_every_n_epochs == 0)
        return bool(every_n_steps or every_n_epochs)

    def _log(self, metrics: Dict[str, float], pbar: tqdm, ppo_step: bool = True) -> None:
        if self._global_step % self._log_every_n_steps == 0:
            self._metric_logger.log_dict(metrics, step=self._global_step)
        if ppo_step:
            pbar.update(1)
        pbar.set_postfix(progress(metrics))

    def save_checkpoint(self, step: int) -> None:
        """Write ``<output_dir>/checkpoints/step_<step>``: policy and value (if any) in HF format
        and the training state (optimizer, counters, data position, random states), atomically."""
        self._checkpoints.save(step, self._progress(), final=self.steps_run == self._num_steps)
        self._last_saved_step = step

    def _save_after_failure(self, rng) -> str:
        """The state after the last completed step, with the random states from before the
        failed step drew from them."""
        path = self._checkpoints.save(self._global_step, self._progress(), rng=rng)
        self._last_saved_step = self._global_step
        return path

    def _progress(self) -> Dict:
        return {"steps_run": self.steps_run, "epochs_run": self.epochs_run,
                "batches_run_in_epoch": self._batches_run_in_epoch, "value_pretrain": self._value_pretrain.state_dict()}

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
    from torchtune_ppo.cli import resolve_config_arg

    sys.argv = resolve_config_arg(sys.argv)  # `--config tiny/ppo_tiny_sentiment`: a shipped config
    sys.exit(recipe_main())
