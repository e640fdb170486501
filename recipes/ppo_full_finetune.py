"""PPO full fine-tuning of a causal LM against a reward, with compiled hot regions.

Run it with ``tune run ppo_full_finetune --config <config.yaml> [key=value ...]``. To edit it, copy
it under another name (``my_ppo.py``) and ``tune run my_ppo.py --config ...``: an installed
``ppo_full_finetune`` would shadow a copy of the same name.

One PPO step reads as:

    prompts [B, P] ─ rollout    ─► Trajectory: generate (query_responses [B, P+T], logprobs
                                   [B, T]), then score (ref logprobs, values, truncation, scores)
                   ─ advantages ─► KL-penalised rewards, then GAE and whitening (or a critic-free
                                   estimator: GRPO, RLOO, REINFORCE++, over groups of responses)
                   ─ update     ─► ppo_epochs × minibatches: packed loss step, backward, optimizer
                   ─ metrics, checkpoint

This file holds the PPO decisions a user may change; the library (``torchtune_ppo``) holds the
rules that keep the compiled regions, FSDP and resumption correct, and the run's books.
"""

import sys
from typing import Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from torchtune_ppo import checkpointing, compile as compiling, distributed
from torchtune_ppo.config import CompileConfig, batches, check_cli_overrides, cpu_threads, validate_config
from torchtune_ppo.data import prompt_loader
from torchtune_ppo.eval import build_evaluator
from torchtune_ppo.models.build import build_models
from torchtune_ppo.ppo.advantages import AdvantageSettings, advantage_metrics, estimate_advantages, group_metrics
from torchtune_ppo.ppo.kl import KLController
from torchtune_ppo.ppo.update import LossSettings, PPOUpdate, nonfinite_score_rows, num_updates
from torchtune_ppo.ppo.value_pretrain import ValuePretraining
from torchtune_ppo.rewards import FunctionReward
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rlhf import ScoringSettings, repeat_prompts
from torchtune_ppo.rlhf.correction import mismatch_metrics
from torchtune_ppo.rollout import Generator, Rollout, Speculation, TurnRunner, cache_tokens, speculative_args
from torchtune_ppo.run.guards import SkippedSteps, StepInProgress, evaluate_when_due, on_step_failure
from torchtune_ppo.run.interrupt import resume_command, stop_on_signals
from torchtune_ppo.run.metrics import PhaseTimer, metric_logger, step_metrics
from torchtune_ppo.run.optim import InBackwardOptimizer, build_optimizer, master_weights
from torchtune_ppo.run.preflight import preflight
from torchtune_ppo.run.progress import Progress
from torchtune_ppo.run.watch import SampleLog, progress, run_summary

log = utils.get_logger("INFO")


class PPOFullFinetuneRecipe(FTRecipeInterface):
    """PPO full fine-tuning: a trained policy and value model, a frozen reference policy and a
    reward (a frozen reward model, or a function of the decoded texts). With a critic-free
    ``advantage_estimator`` (GRPO, RLOO, REINFORCE++) there is no value model at all.

    Each model is loaded through the torchtune checkpointer named in the config; the value
    model starts from the reward model's checkpoint (or the policy's, see ``value_head_init``).
    A policy built with a LoRA builder trains its adapters only, and the reference policy is
    that same model with its adapters off (docs/lora.md). docs/config.md lists every key.
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
        self._output_dir = cfg.output_dir
        # The KL penalty's coefficient: fixed, or adapted towards kl_target after every step.
        self._kl = KLController(cfg.kl_coeff, cfg.kl_target, cfg.kl_horizon)
        self._advantages = AdvantageSettings.from_config(cfg)
        self._n = cfg.num_samples_per_prompt  # each prompt is generated n times (a group)
        self._rows_per_step = cfg.batch_size * self._n  # responses, over every rank
        self._log_every_n_steps = cfg.log_every_n_steps
        self._log_peak_memory_stats = cfg.log_peak_memory_stats and self._device.type == "cuda"
        self._score_history: List[Dict[str, float]] = []  # for the end-of-run summary
        self._recompiles = compiling.RecompileCounter.for_run(cfg, self._is_rank_zero)  # graphs compiled after step 1
        self._skipped = SkippedSteps(max_consecutive=cfg.max_consecutive_skipped_steps)

    def setup(self, cfg: DictConfig) -> None:
        # Everything that can fail without weights fails here, before any model loads.
        checked = preflight(cfg, world_size=self._world_size, log=log)
        self._metric_logger = metric_logger(cfg, rank_zero=self._is_rank_zero)
        self._metric_logger.log_config(cfg)
        self._tokenizer, self._prompt_len = checked.tokenizer, checked.prompt_len
        self._samples = SampleLog(cfg.log_samples_every_n_steps, self._tokenizer, self._prompt_len,
                                  f"{self._output_dir}/logs", log, rank_zero=self._is_rank_zero)
        self._sampler, self._dataloader = prompt_loader(
            checked.dataset, batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=self.seed,
            max_prompt_len=self._prompt_len, pad_id=self._tokenizer.pad_id, long_prompts=cfg.long_prompts)
        self._progress = Progress(
            num_ppo_steps=cfg.num_ppo_steps, batches_per_epoch=len(self._dataloader),
            value_pretrain=ValuePretraining.from_config(cfg.value_pretrain), data_identity=checked.data_identity,
            save_every_n_steps=cfg.save_every_n_steps, save_every_n_epochs=cfg.save_every_n_epochs, evaluation=cfg.eval)
        regions = compiling.regions(CompileConfig(**cfg.compile), world_size=self._world_size, device=self._device)
        self._group, self._prefix = batches.prompt_sharing(cfg, self._world_size, self._dataloader.dataset)
        self._models = build_models(cfg, device=self._device, dtype=self._dtype, resume_from=checked.resume_from)
        compiling.use_layers(self._models, regions.layers)  # compile.layers: one layer compiled per use
        self._rollout = self._setup_rollout(cfg, regions)
        self._update = self._setup_update(cfg, regions)
        manager = checkpointing.CheckpointManager(self._output_dir, cfg.checkpointer, cfg.value_checkpointer,
                                                  keep_last_n=cfg.keep_last_n_checkpoints)
        self._checkpoints = checkpointing.CheckpointClient(
            manager, self._models.trained, self._update.optimizer, self._update.lr_scheduler, self._skipped,
            [self._rng], run_config=checkpointing.config_to_save(cfg), kl_controller=self._kl, master_weights=self._master,
            merge_adapters_at_end=not cfg.save_adapter_weights_only, speculation=self._rollout.speculation,
            checkpoint_format=cfg.checkpoint_format, async_save=cfg.async_save)  # sharded: each rank its own
        self._step = StepInProgress(self._checkpoints.capture_rng)
        self._profiler = (training.setup_torch_profiler(enabled=False)[0] if cfg.profiler is None
                          else config.instantiate(cfg.profiler)[0])
        if checked.resume_from:
            state = self._checkpoints.load(checked.resume_from)
            self._progress.load_state_dict(state)
            self._checkpoints.pending_rng = state["rng"]  # put back once the data iterator is in place
            # After the restored state, which holds the saved optimizer settings: the config's win.
            checkpointing.apply_optimizer_overrides(self._update.optimizer, cfg.optimizer, self._update.lr_scheduler)
        self._evaluator = build_evaluator(cfg.eval, checked, self._rollout, regions.generation, self._progress.evaluation,
                                          seed=self.seed, warm_up=self._recompiles.excluded, keep_step=manager.keep_step,
                                          log_dict=self._metric_logger.log_dict, share_prefix=cfg.share_prompt_prefix)

    def _setup_rollout(self, cfg: DictConfig, regions: compiling.Regions) -> Rollout:
        generator = Generator(
            self._models.policy, batch_size=cfg.forward_batch_size // self._world_size,
            max_prompt_len=self._prompt_len, max_generated_tokens=cfg.max_generated_tokens,
            pad_id=self._tokenizer.pad_id, stop_token_ids=list(cfg.stop_token_ids),
            temperature=float(cfg.temperature), top_k=cfg.top_k, top_p=cfg.top_p,
            steps=regions.generation,  # compiled or eager, as compile.generate says
            group_size=self._group, prefix_len=batches.generation_prefix(self._prefix, self._dataloader.dataset,
                                                                         self._prompt_len),  # computed once a call
            dtype=self._dtype, device=self._device, cache_tokens=cache_tokens(cfg),  # more with turns
            **speculative_args(cfg))  # speculative rollouts: a draft checked in one forward
        reward = (ModelReward(self._models.reward) if self._models.reward is not None
                  else FunctionReward(config.instantiate(cfg.reward), self._tokenizer))
        settings = ScoringSettings(prompt_len=self._prompt_len, pad_id=self._tokenizer.pad_id,
                                   temperature=float(cfg.temperature), penalise_no_eos=cfg.penalise_no_eos,
                                   min_response_length=cfg.min_response_length, reward_penalty=float(cfg.reward_penalty))
        stop_token_ids = torch.tensor(list(cfg.stop_token_ids), device=self._device)
        return Rollout(generator, self._models.ref_policy, self._models.value, reward, stop_token_ids, settings,
                       score=regions.score, fused_rollout=regions.fused_rollout,
                       whole_scoring_models=regions.whole_scoring_models, reference=self._models.reference,
                       recompute_logprobs=cfg.rollout_correction.mode is not None,  # TIS / MIS
                       turns=TurnRunner.from_config(cfg, generator, self._tokenizer), share_prefix=self._prefix,
                       segment_attention=cfg.segment_attention,  # packed rows attend by sequence
                       speculation=Speculation.from_config(cfg, self.seed))  # position-keyed noise, drafts

    def _setup_update(self, cfg: DictConfig, regions: compiling.Regions) -> PPOUpdate:
        models, rows = self._models.trained, self._rows_per_step
        params = [p for m in models.values() for p in m.parameters() if p.requires_grad]  # LoRA: adapters only
        # bf16: the optimizer steps fp32 copies of the weights (on W processes FSDP2's fp32 shards)
        self._master = master_weights(cfg, params, regions.master_step, self._world_size)
        optimizer = (InBackwardOptimizer(cfg.optimizer, models) if cfg.optimizer_in_bwd else
                     build_optimizer(cfg.optimizer, params if self._master is None else self._master.masters))
        lr_scheduler = None
        if cfg.lr_scheduler is not None:  # torchtune's schedulers count optimizer steps
            steps = cfg.num_ppo_steps * num_updates(rows, cfg.ppo_batch_size, cfg.ppo_epochs)
            lr_scheduler = config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps)
        # Accepts torchtune's `_component_: torchtune.rlhf.loss.PPOLoss` block or plain keys.
        loss = config.instantiate(cfg.loss) if "_component_" in cfg.loss else cfg.loss
        return PPOUpdate(
            self._models.policy, self._models.value, optimizer, lr_scheduler, regions.loss_step,
            batch_size=rows, ppo_batch_size=cfg.ppo_batch_size, ppo_epochs=cfg.ppo_epochs,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps, group_size=self._group,  # whole groups
            prompt_len=self._prompt_len, response_len=cfg.max_generated_tokens,
            temperature=float(cfg.temperature), loss=LossSettings.from_config(loss),
            clip_grad_norm=cfg.clip_grad_norm, optimizer_in_bwd=cfg.optimizer_in_bwd,
            critic_warmup_steps=cfg.critic_warmup_steps,  # the first N steps train the value model only
            fixed_shapes=regions.loss_step_fixed_shapes, master_weights=self._master, share_prefix=self._prefix,
            segment_attention=cfg.segment_attention)

    def train_step(self, prompts: torch.Tensor, prompt_lens: torch.Tensor, num_truncated: int,
                   references: Optional[List[Optional[str]]] = None) -> Dict[str, float]:
        """One PPO step on ``prompts [B, P]`` of real lengths ``prompt_lens [B]``; returns its metrics.

        ``num_truncated``, the prompts the collator cut to ``max_prompt_len``, is only logged;
        ``references`` (the dataset's answers, one per row) go to a function reward.
        A batch with a non-finite score gets no update at all. While value pretraining is on,
        the step is a pretraining step: the critic's returns use its lambda and only the value
        model is updated.
        """
        timer, step = PhaseTimer(self._device), self._progress.steps_run + 1
        pretraining = self._progress.pretraining
        settings = self._advantages
        if pretraining:
            settings = settings._replace(lmbda=self._progress.value_pretrain.lmbda)
        # [B * n, P]: each prompt n times in a row, so a group sits on this rank
        prompts, prompt_lens, references = repeat_prompts(prompts, prompt_lens, references, self._n)
        self._step.begin()  # what a failure of this step may still save
        with timer("step"):
            # step 1-6: generate the responses and score them
            trajectory = self._rollout(prompts, prompt_lens, self._rng, timer, references, step=step)
            bad_rows = nonfinite_score_rows(trajectory)
            if bad_rows:
                log.warning(f"step {step}: the reward is not finite in {bad_rows} of "
                            f"{len(trajectory.scores)} rows; the update is skipped.")
            # step 7: KL-penalised rewards, advantages and returns
            with timer("advantages"):
                adv = estimate_advantages(trajectory, settings, kl_coeff=self._kl.value)
            # step 8: the PPO update, skipped for a batch with a non-finite score
            result = None
            if not bad_rows:
                self._step.update_begins()
                result = self._update(trajectory, adv.advantages, adv.returns, timer, step, value_pretrain=pretraining)
        self._samples(trajectory, prompt_lens, step=self._progress.global_step + 1)
        return self._step_metrics(trajectory, adv, result, bad_rows, num_truncated, timer, adapt_kl=not pretraining)

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
        # rollout_corr/*: over the recomputed batch with rollout_correction, else at the first minibatch
        metrics.update(mismatch_metrics(adv.mismatch or (result and result.mismatch)))
        metrics.update(getattr(self._rollout, "episode_metrics", {}))  # turns/*: with an environment
        if self._n > 1:
            metrics.update(group_metrics(trajectory.scores, self._n))
        if adapt_kl:  # kl: the global batch's, on every rank
            self._kl.update(metrics["kl"], n=self._rows_per_step)
        if self._log_peak_memory_stats:
            metrics.update(training.get_memory_stats(device=self._device))
        return metrics

    def train(self, on_step: Optional[Callable[[int, Dict[str, float]], None]] = None) -> None:
        """Runs PPO steps until ``num_ppo_steps``; ``on_step(step, metrics)`` is called after each.

        SIGINT, SIGTERM or SIGHUP finishes the current step, saves a checkpoint and exits. An exception
        saves the state after the last completed step when it can (see ``StepInProgress``).
        """
        progress_ = self._progress
        pbar = tqdm(total=progress_.num_ppo_steps, initial=progress_.steps_run, desc="PPO", dynamic_ncols=True,
                    disable=not self._is_rank_zero)
        if progress_.pretraining and self._is_rank_zero:
            log.info(progress_.start_note())
        self._profiler.start()
        resume = resume_command(sys.argv, self._output_dir)
        nothing_to_train = progress_.nothing_to_train()  # resumed after its last step or its early stop
        try:
            with stop_on_signals() as stop:
                self._evaluate()  # the starting policy, before step 1 (resumed: the saved step's, if unfinished)
                while not progress_.done and not stop:
                    self._run_epoch(on_step, pbar, stop)
            if progress_.unsaved:
                self.save_checkpoint(progress_.global_step)
        except Exception as e:
            on_step_failure(e, self._step, steps_run=progress_.global_step, saved_step=progress_.last_saved_step,
                            save=lambda rng: self.save_checkpoint(progress_.global_step, rng),
                            world_size=self._world_size, resume=resume, log=log, rank_zero=self._is_rank_zero)
            if isinstance(e, checkpointing.CheckpointWriteError):
                raise SystemExit(1) from e  # said above: where, why, and how to continue
            raise
        self._profiler.stop()
        pbar.close()
        if self._is_rank_zero:
            log.info(run_summary(self._score_history, self._output_dir, self._progress.evaluation, nothing_to_train))
        if stop:
            if self._is_rank_zero:
                log.warning(f"Stopped after step {progress_.global_step}. To continue: {resume}")
            raise SystemExit(128 + stop.signum)

    def _run_epoch(self, on_step, pbar: tqdm, stop) -> None:
        progress_ = self._progress
        self._sampler.set_epoch(progress_.epochs_run)
        if progress_.global_step == 0:  # a checkpoint of step 0 was captured before any data iterator
            self._checkpoints.restore_pending_rng()
        remaining = iter(self._dataloader)
        for _ in range(progress_.batches_run_in_epoch):  # resuming: the batches already trained on
            next(remaining)
        self._checkpoints.restore_pending_rng()
        for batch in remaining:
            pretraining = progress_.pretraining
            metrics = self.train_step(batch["tokens"].to(self._device), batch["prompt_lens"].to(self._device),
                                      int(batch["num_truncated"]), batch.get("references"))
            note = progress_.count_step(metrics, pretraining)
            self._step.complete()  # a failure from here on saves this step
            if note and self._is_rank_zero:
                log.info(note)
            if not self._recompiles.marked:
                self._recompiles.mark()  # everything after the first step must reuse its graphs
            self._log(metrics, pbar, ppo_step=not pretraining)
            self._profiler.step()
            if on_step is not None:
                on_step(progress_.global_step, metrics)
            stop.agree()  # every rank leaves after the same step
            # A due checkpoint (the last step's too) before the step's evaluation, which may fail or be killed.
            if progress_.save_due() or progress_.all_steps_run:
                self.save_checkpoint(progress_.global_step)
            self._evaluate()
            if progress_.done or stop:
                return
        progress_.end_epoch()

    def _evaluate(self) -> None:  # the evaluation due, if any; a new best is saved
        evaluate_when_due(self._evaluator, self._progress, self._step, self._checkpoints, self.save_checkpoint)

    def _log(self, metrics: Dict[str, float], pbar: tqdm, ppo_step: bool = True) -> None:
        if self._progress.global_step % self._log_every_n_steps == 0:
            self._metric_logger.log_dict(metrics, step=self._progress.global_step)
        if ppo_step:
            self._score_history.append({"scores": metrics["scores"]})
            pbar.update(1)
        pbar.set_postfix(progress(metrics))

    def save_checkpoint(self, step: int, rng=None) -> str:
        """Writes ``checkpoints/step_<step>`` atomically; ``rng``: after a failure, those from before the step."""
        path = self._checkpoints.save(step, self._progress.state_dict(), rng, final=rng is None and self._progress.done)
        self._progress.saved(step)
        return path

    def cleanup(self) -> None:
        self._checkpoints.close()  # a save in flight (async_save) is written
        self._metric_logger.close()
        checkpointing.release_output_dir(self._output_dir)


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
