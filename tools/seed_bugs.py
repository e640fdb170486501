"""Seeded bugs: how many realistic one-line bugs the test suite catches.

Each entry of :data:`MUTATIONS` is one bug a developer could write (an off-by-one, a sign, a
swapped argument, a dropped mask or clamp, a wrong constant, a forgotten restore on resume...):
a snippet ``old`` of a file, which must occur exactly once in that file at the revision measured,
and the ``new`` text that replaces it. For each one the tool writes the bug into a git worktree
of that revision (never into the working tree it is run from: others may be editing and testing
there), runs the tests, and puts the file back from git, also after an error or Ctrl-C.

Usage::

    python tools/seed_bugs.py --list                      # every mutation checked against HEAD, and its tests
    python tools/seed_bugs.py --only rewards-gae-delta-gamma,sample-top-k-index
    python tools/seed_bugs.py --tier targeted             # the measurement (background it: see below)
    nohup python tools/seed_bugs.py --tier targeted > /tmp/seed_bugs.log 2>&1 &

Tiers (``--tier``), the tests run against each mutant:

- ``targeted`` (the default): every test file that imports the mutated module (found in the
  AST of each test file: the module's dotted path, or its package and one of its names, also
  through a test helper such as ``tests/twins/``, or through a conftest fixture that imports it,
  as ``make_recipe`` does the recipe; for the recipe, the files that import ``ppo_full_finetune``
  or take such a fixture), slow tests included, plus a fixed set that exercises the recipe
  cheaply: ``tests/parity/test_recipe_pieces.py``, ``tests/unit/test_recipe_wiring_options.py``
  (options through the recipe's loop, in process) and the golden seeded run
  ``tests/e2e/test_recipe.py::test_seeded_run_logs_the_recorded_metrics``. Unit files run
  first, then parity, then end-to-end, so a caught mutant stops early.
- ``fast``: the fast tier, ``-m "not slow"`` over ``tests/unit`` and ``tests/parity``.
- ``all``: the whole suite.

pytest runs with ``-x -q -p no:cacheprovider``, one thread (``OMP_NUM_THREADS=1``), no
bytecode written (a mutant and its restored file may share a size and an mtime second), and
``PYTHONPATH=<worktree>:<worktree>/recipes`` so that the worktree's package and recipe win over
the editable install, in the tests' subprocesses (``tune run``, torchrun) too.

What counts, per mutant:

- ``caught``: a test failed (or errored, or the collection failed), and that first failing test
  passes on the unmutated worktree: each new first failing test is run there once (about
  20-80 s; ``--no-confirm`` skips it). One that fails unmutated too is broken at the revision,
  not by the mutant: it is deselected from then on (``--deselect`` names such tests up front)
  and the mutant is tested again without it.
- ``missed``: every selected test passed.
- ``timeout``: ``--timeout`` (900 s a pytest run) ran out before any test failed; after a
  failure it is ``caught``. A mutant's seconds include its confirmation.
- ``stale``: ``old`` is missing from the file, or occurs more than once: the list needs an
  update, nothing was run. ``invalid``: the mutated file does not parse.
- ``error``: pytest could not run (usage error, no tests collected).
- ``not run``: the measurement was interrupted first (Ctrl-C, SIGTERM, SIGHUP); the line
  printed then gives the ``--only`` command that runs the rest.

The summary is caught / applicable (all but ``stale``, ``invalid``, ``not run``), overall and by
area (the recipe's wiring, ``recipes/ppo_full_finetune.py``, against the library); it goes to
stdout and, with every mutant's line and its test selection, as JSON to ``--out``
(``/tmp/seed_bugs.json``, rewritten after each mutant). Each mutant's pytest output is in
``--logs`` (``/tmp/seed_bugs_logs/<id>.log``).

How long, on 2 CPU cores shared with other work (load 3-4): ``--list`` takes 20 s. A caught
library mutant costs 15-70 s, its confirmation included; a caught recipe mutant 0.5-3 min; a
missed one runs its whole selection: ~1 min for a library module whose tests are unit tests,
~12 min for the recipe (its importing files hold the end-to-end resume tests). A test found
failing unmutated costs one more pass of the mutant that found it: name such tests with
``--deselect``. The ``targeted`` measurement of 38 of the 43 mutations took 70 min there
(benchmarks/RESULTS.md); all 43 take about 80. ``fast`` is ~1 min a mutant; ``all`` is the
suite's time (20-35 min serially) for each missed mutant.
"""

import argparse
import ast
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/ppo_full_finetune.py"
# Cheap end-to-end coverage of the recipe, added to every targeted selection.
FIXED_TESTS = (
    "tests/parity/test_recipe_pieces.py",
    "tests/unit/test_recipe_wiring_options.py",  # options through the recipe's loop, in process, seconds each
    "tests/e2e/test_recipe.py::test_seeded_run_logs_the_recorded_metrics",
)
PYTEST_FLAGS = ("-x", "-q", "-p", "no:cacheprovider")


class Mutation(NamedTuple):
    id: str
    path: str
    old: str
    new: str
    what: str


M = Mutation
MUTATIONS: Tuple[Mutation, ...] = (
    # ---- the recipe's wiring -------------------------------------------------------------
    M("recipe-pretrain-lmbda", RECIPE,
      "settings = settings._replace(lmbda=self._progress.value_pretrain.lmbda)",
      "settings = settings._replace(lmbda_actor=self._progress.value_pretrain.lmbda)",
      "value pretraining's lambda set as the actor's lambda, so the critic's returns keep the config's lmbda"),
    M("recipe-loss-kl-coeff", RECIPE,
      "adv = estimate_advantages(trajectory, settings, kl_coeff=self._kl.value)",
      "adv = estimate_advantages(trajectory, settings, kl_coeff=self._update._loss.kl_coeff)",
      "the reward's KL penalty takes loss.kl_coeff (the loss term's, 0 by default) instead of the KL controller's value"),
    M("recipe-kl-update-n", RECIPE,
      'self._kl.update(metrics["kl"], n=self._rows_per_step)',
      'self._kl.update(metrics["kl"], n=self._n)',
      "the adaptive KL controller is told num_samples_per_prompt sequences instead of the step's rows"),
    M("recipe-lr-schedule-length", RECIPE,
      "lr_scheduler = config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=steps)",
      "lr_scheduler = config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=cfg.num_ppo_steps)",
      "the LR schedule is num_ppo_steps long, not num_ppo_steps x optimizer steps per PPO step"),
    M("recipe-resume-skip-batches", RECIPE,
      "for _ in range(progress_.batches_run_in_epoch):",
      "for _ in range(progress_.batches_run_in_epoch - 1):",
      "on resume one batch fewer is skipped: the last trained batch is trained again"),
    M("recipe-sampler-epoch", RECIPE,
      "self._sampler.set_epoch(progress_.epochs_run)",
      "self._sampler.set_epoch(0)",
      "the sampler's epoch is never advanced: every epoch sees the prompts in the same order"),
    M("recipe-scoring-temperature", RECIPE,
      "temperature=float(cfg.temperature), penalise_no_eos=cfg.penalise_no_eos,",
      "temperature=1.0, penalise_no_eos=cfg.penalise_no_eos,",
      "scoring (reference and policy logprobs) at temperature 1 whatever the sampling temperature"),
    M("recipe-min-response-length", RECIPE,
      "min_response_length=cfg.min_response_length,",
      "min_response_length=None,",
      "min_response_length is not passed to scoring: short responses are never penalised"),
    M("recipe-critic-warmup", RECIPE,
      "critic_warmup_steps=cfg.critic_warmup_steps,",
      "critic_warmup_steps=0,",
      "critic_warmup_steps is not passed to the update: the policy trains from step 1"),
    M("recipe-clip-grad-norm", RECIPE,
      "clip_grad_norm=cfg.clip_grad_norm, optimizer_in_bwd=cfg.optimizer_in_bwd,",
      "clip_grad_norm=None, optimizer_in_bwd=cfg.optimizer_in_bwd,",
      "clip_grad_norm is not passed to the update: gradients are never clipped"),
    M("recipe-rng-restore", RECIPE,
      'self._checkpoints.pending_rng = state["rng"]',
      "self._checkpoints.pending_rng = None",
      "a resume never restores the saved random states"),
    M("recipe-rows-per-step", RECIPE,
      "self._rows_per_step = cfg.batch_size * self._n",
      "self._rows_per_step = cfg.batch_size",
      "rows per step forget the n samples per prompt (the update's batch, the LR schedule, the KL controller)"),
    M("recipe-pretrain-updates-policy", RECIPE,
      "value_pretrain=pretraining)",
      "value_pretrain=False)",
      "a value pretraining step runs as a PPO update: the policy trains and the LR schedule steps"),
    # ---- rlhf/: the PPO math -------------------------------------------------------------
    M("rewards-kl-mask", "torchtune_ppo/rlhf/rewards.py",
      "kl = kl_estimate(logprobs, ref_logprobs, kl_estimator) * masks",
      "kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)",
      "the per-token KL penalty is not masked: tokens after the stop token are penalised"),
    M("rewards-whiten-biased-var", "torchtune_ppo/rlhf/rewards.py",
      "var = centered.pow(2).sum() / (n - 1).clamp(min=1.0)",
      "var = centered.pow(2).sum() / n.clamp(min=1.0)",
      "whitening divides by the biased variance (n, not n - 1) on one process"),
    M("rewards-gae-delta-gamma", "torchtune_ppo/rlhf/rewards.py",
      "delta = rewards[:, t] + gamma * next_value - values[:, t]",
      "delta = rewards[:, t] + next_value - values[:, t]",
      "GAE's TD error does not discount the next value"),
    M("rewards-rloo-factor", "torchtune_ppo/rlhf/rewards.py",
      "out = centred * (n / (n - 1))",
      "out = centred * ((n - 1) / n)",
      "RLOO's leave-one-out factor inverted: (n - 1) / n instead of n / (n - 1)"),
    M("loss-clip-sides-swapped", "torchtune_ppo/rlhf/loss.py",
      "clipped_ratios = torch.clamp(ratios, 1.0 - low, 1.0 + high)",
      "clipped_ratios = torch.clamp(ratios, 1.0 - high, 1.0 + low)",
      "clip-higher's epsilon_low and epsilon_high swapped"),
    M("loss-value-clip-dropped", "torchtune_ppo/rlhf/loss.py",
      "value_losses = torch.maximum((phi_values - returns) ** 2, (values_clipped - returns) ** 2)",
      "value_losses = (phi_values - returns) ** 2",
      "the value loss is never clipped"),
    M("loss-token-mean-sum", "torchtune_ppo/rlhf/loss.py",
      "return 1.0 / (grad_accum * max(micro_batch_tokens, 1))",
      "return 1.0 / max(micro_batch_tokens, 1)",
      "token-mean sums its micro-batches' means instead of averaging them (grad_accum forgotten)"),
    M("kl-k3-direction", "torchtune_ppo/rlhf/kl.py",
      "log_ratio = ref_logprobs - logprobs",
      "log_ratio = logprobs - ref_logprobs",
      "the reward's k3 estimator takes log(pi / ref) instead of log(ref / pi)"),
    M("kl-straight-through-detach", "torchtune_ppo/rlhf/kl.py",
      "return k2 - k2.detach() + value(logprobs.detach())",
      "return k2 - k2.detach() + value(logprobs)",
      "the straight-through KL loss (k1+, k3+) adds the value's gradient to k2's"),
    M("seq-stop-token-masked", "torchtune_ppo/rlhf/sequence_processing.py",
      "padding_masks = (seen > 1) | ((seen == 1) & ~is_stop)",
      "padding_masks = seen >= 1",
      "truncation masks the stop token itself"),
    M("seq-logprob-temperature", "torchtune_ppo/rlhf/sequence_processing.py",
      ':func:`chunked_logprobs`): float32 ``[n]``."""\n    logits = output(hidden).float() / temperature',
      ':func:`chunked_logprobs`): float32 ``[n]``."""\n    logits = output(hidden).float()',
      "the logprob reads of scoring ignore the temperature"),
    M("corr-tis-clamp", "torchtune_ppo/rlhf/correction.py",
      "weights = torch.exp(log_ratio.clamp(max=log_c))",
      "weights = torch.exp(log_ratio.clamp(min=-log_c, max=log_c))",
      "TIS truncates small ratios too (at 1 / C), not only those above C"),
    M("corr-mis-abs", "torchtune_ppo/rlhf/correction.py",
      "hit = log_ratio.abs() > log_c",
      "hit = log_ratio > log_c",
      "MIS masks only ratios above C, not those below 1 / C"),
    # ---- ppo/: advantages, update, value pretraining, KL controller ------------------------
    M("adv-group-uses-scores", "torchtune_ppo/ppo/advantages.py",
      "per_row = rlhf.group_baseline(rewards.sum(-1), s.num_samples_per_prompt, estimator)",
      "per_row = rlhf.group_baseline(trajectory.scores, s.num_samples_per_prompt, estimator)",
      "group baselines on the raw scores: the KL penalty is left out of critic-free advantages"),
    M("update-warmup-comparison", "torchtune_ppo/ppo/update.py",
      "if value_pretrain or step <= self.critic_warmup_steps:",
      "if value_pretrain or step < self.critic_warmup_steps:",
      "critic warm-up ends one step early (< for <=)"),
    M("update-clip-policy-only", "torchtune_ppo/ppo/update.py",
      "params = chain(*(m.parameters() for m in (self.policy_model, self.value_model) if m is not None))",
      "params = self.policy_model.parameters()",
      "the gradient norm is clipped (and checked for finiteness) over the policy only, not the value model"),
    M("update-no-shuffle", "torchtune_ppo/ppo/update.py",
      "return torch.randperm(self._batch_size, device=device).tolist()",
      "return list(range(self._batch_size))",
      "minibatches are never shuffled: every PPO epoch takes the rows in the same order"),
    M("vp-max-steps-off-by-one", "torchtune_ppo/ppo/value_pretrain.py",
      "self.done = self.done or self.steps_run >= self.max_steps",
      "self.done = self.done or self.steps_run > self.max_steps",
      "value pretraining runs max_steps + 1 steps (> for >=)"),
    M("klctl-clip-dropped", "torchtune_ppo/ppo/kl.py",
      "error = min(max(kl / self.target - 1.0, -0.2), 0.2)",
      "error = kl / self.target - 1.0",
      "the adaptive KL controller's error is not clipped to [-0.2, 0.2]"),
    # ---- rollout/: sampling and generation ------------------------------------------------
    M("sample-top-p-off-by-one", "torchtune_ppo/rollout/sampling.py",
      "drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p",
      "drop = torch.cumsum(sorted_probs, dim=-1) > top_p",
      "top-p drops the token whose probability crosses top_p (the nucleus one token short)"),
    M("sample-top-k-index", "torchtune_ppo/rollout/sampling.py",
      "token = choice if cand_idx is None else cand_idx.gather(-1, choice[:, None])[:, 0]",
      "token = choice",
      "with top-k the position among the candidates is returned, not the vocabulary id"),
    M("gen-decode-position", "torchtune_ppo/rollout/generation.py",
      "inp.decode_pos.copy_(inp.prompt_lens[:, None])",
      "inp.decode_pos.fill_(P)",
      "the first response token's position is the padded prompt width, not the prompt's real length"),
    # ---- checkpointing/ ------------------------------------------------------------------
    M("store-prune-keeps-oldest", "torchtune_ppo/checkpointing/store.py",
      "kept = {p for _, p in complete[-self.keep_last_n:]} | {keep}",
      "kept = {p for _, p in complete[:self.keep_last_n]} | {keep}",
      "pruning keeps the oldest keep_last_n checkpoints instead of the newest"),
    M("store-set-aside-chosen", "torchtune_ppo/checkpointing/store.py",
      "if m is not None and p.is_dir() and int(m.group(1)) > floor:",
      "if m is not None and p.is_dir() and int(m.group(1)) >= floor:",
      "a resume sets aside the checkpoint it resumes from along with the damaged newer ones (>= for >)"),
    M("state-torch-rng-restore", "torchtune_ppo/checkpointing/training_state.py",
      'torch.set_rng_state(state["torch"])',
      "pass",
      "a resume does not restore torch's global random state (minibatch shuffling)"),
    M("state-scheduler-restore", "torchtune_ppo/checkpointing/training_state.py",
      'self.lr_scheduler.load_state_dict(state["lr_scheduler"])',
      "pass",
      "a resume does not restore the LR scheduler: the schedule starts over"),
    M("resume-nested-must-match", "torchtune_ppo/checkpointing/resume_config.py",
      'return any(key == p or key.startswith(p + ".") for p in patterns)',
      "return any(key == p for p in patterns)",
      "a key under a must-match block (dataset.data_files, optimizer._component_) may change on resume"),
    # ---- run/: progress and guards --------------------------------------------------------
    M("progress-epoch-save", "torchtune_ppo/run/progress.py",
      "and (self.epochs_run + 1) % self.save_every_n_epochs == 0)",
      "and self.epochs_run % self.save_every_n_epochs == 0)",
      "save_every_n_epochs counts epochs from 0: it saves after epoch 1, then every N from there, one early"),
    M("progress-epoch-reset", "torchtune_ppo/run/progress.py",
      "self.epochs_run += 1\n        self.batches_run_in_epoch = 0",
      "self.epochs_run += 1",
      "the batch counter is not reset at an epoch's end (data position and the epoch save rule)"),
    M("guards-never-reset", "torchtune_ppo/run/guards.py",
      "self.consecutive = self.consecutive + 1 if skipped else 0",
      "self.consecutive += skipped",
      "consecutive skipped steps are never reset by a good step: they add up over the run"),
    # ---- several processes, sharded checkpoints, bf16 masters on several processes ----------------
    M("recipe-rank-seed", RECIPE,
      "manual_seed(self.seed + distributed.rank())",
      "manual_seed(self.seed)",
      "every rank's sampling generator seeded alike: the ranks draw the same noise"),
    M("sharded-stage-no-copy", "torchtune_ppo/checkpointing/sharded.py",
      '        return t.detach().to("cpu", copy=True)\n    return {k: copy(v)',
      '        return t.detach()\n    return {k: copy(v)',
      "a background save stages CPU tensors by reference: the steps after the save change what it writes"),
    M("sharded-load-param-groups", "torchtune_ppo/checkpointing/sharded.py",
      '        g.update({k: v for k, v in saved_group.items() if k != "params"})',
      '        g.update({})',
      "a sharded resume keeps the new optimizer's settings (lr, betas) instead of the saved ones"),
    M("sharded-masters-remap", "torchtune_ppo/checkpointing/sharded.py",
      '        sources.update({f"model.{n}": f"master.{n}" for n in names})',
      '        sources.update({})',
      "one process's masters not read into several processes' fp32 shards: the bf16 weights are"),
    M("sharded-one-in-flight", "torchtune_ppo/checkpointing/sharded.py",
      '        self.wait()\n        if not self.async_save:',
      '        if not self.async_save:',
      "a save starts while the previous one is still being written"),
    M("sharded-optimizer-init", "torchtune_ppo/checkpointing/sharded.py",
      '    if settings["stateful"]:\n        init_optimizer_state(optimizer)',
      '    if not settings["stateful"]:\n        init_optimizer_state(optimizer)',
      "the optimizer's state is created when the checkpoint has none, and not when it has"),
    M("store-sharded-marker", "torchtune_ppo/checkpointing/store.py",
      '        if f"{SHARDS_DIRNAME}/.metadata" not in files or not any(f.endswith(".distcp") for f in files):',
      '        if False:',
      "a sharded folder whose marker lists no metadata or shards is taken as complete"),
    M("fsdp-reduce-bf16", "torchtune_ppo/distributed.py",
      "MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)",
      "MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)",
      "bf16 masters on several processes: gradients reduced in bf16"),
    M("build-masters-dtype", "torchtune_ppo/models/build.py",
      "dtype = torch.float32 if trainable and sharded_masters(cfg, self.dtype) else self.dtype",
      "dtype = self.dtype",
      "bf16 on several processes trains bf16 weights: no fp32 masters"),
    M("export-no-merge", "torchtune_ppo/checkpointing/export.py",
      "return get_merged_lora_ckpt(dict(state), rank=rank, alpha=alpha), None",
      "return {k: v for k, v in state.items() if 'lora' not in k}, None",
      "a LoRA model exported as its base weights, adapters dropped"),
    M("client-async-state-shared", "torchtune_ppo/checkpointing/training_state.py",
      "            state = copy.deepcopy(state)  # the steps that follow",
      "            state = state  # the steps that follow",
      "a background save pickles the training state the next steps keep changing (evaluation record, counters)"),
    # A fresh set (2026-12-07): kinds the earlier sets did not seed.
    # ---- the recipe's wiring -------------------------------------------------------------
    M("fresh-recipe-top-p-dropped", RECIPE,
      "temperature=float(cfg.temperature), top_k=cfg.top_k, top_p=cfg.top_p,",
      "temperature=float(cfg.temperature), top_k=cfg.top_k, top_p=None,",
      "top_p is not passed to the generator: sampling is never restricted to the nucleus"),
    M("fresh-recipe-kl-horizon-default", RECIPE,
      "self._kl = KLController(cfg.kl_coeff, cfg.kl_target, cfg.kl_horizon)",
      "self._kl = KLController(cfg.kl_coeff, cfg.kl_target)",
      "kl_horizon is not passed to the KL controller: the adaptive coefficient moves at the default horizon of 10000"),
    M("fresh-recipe-keep-last-n-dropped", RECIPE,
      "keep_last_n=cfg.keep_last_n_checkpoints)",
      "keep_last_n=None)",
      "keep_last_n_checkpoints is not passed to the checkpoint manager: no checkpoint is ever pruned"),
    M("fresh-recipe-batches-per-epoch", RECIPE,
      "batches_per_epoch=len(self._dataloader),",
      "batches_per_epoch=len(self._dataloader.dataset),",
      "an epoch counted in prompts, not in the loader's batches: save_every_n_epochs never finds an epoch's last batch"),
    M("fresh-recipe-references-key", RECIPE,
      'int(batch["num_truncated"]), batch.get("references"))',
      'int(batch["num_truncated"]), batch.get("reference"))',
      "the batch's references read under the wrong key: a function reward is given none"),
    M("fresh-recipe-pretrain-adapts-kl", RECIPE,
      "timer, adapt_kl=not pretraining)",
      "timer, adapt_kl=True)",
      "a value pretraining step adapts the KL coefficient (its KL is the starting policy's, not PPO's)"),
    M("fresh-recipe-eval-record", RECIPE,
      "save_every_n_steps=cfg.save_every_n_steps, save_every_n_epochs=cfg.save_every_n_epochs, evaluation=cfg.eval)",
      "save_every_n_steps=cfg.save_every_n_steps, save_every_n_epochs=cfg.save_every_n_epochs, evaluation=None)",
      "the eval block is not given to the run's books: the evaluation record is disabled and no evaluation runs"),
    # ---- the library ---------------------------------------------------------------------
    M("fresh-progress-save-ppo-steps", "torchtune_ppo/run/progress.py",
      "        step = self.global_step\n        every_n_steps",
      "        step = self.steps_run\n        every_n_steps",
      "save_every_n_steps counts PPO steps, not global steps: after value pretraining saves fall off the step grid"),
    M("fresh-progress-resume-unsaved", "torchtune_ppo/run/progress.py",
      "        self.last_saved_step = self.global_step",
      "        self.last_saved_step = None",
      "a resume does not count the restored step as saved: it is saved again (refused: the checkpoint exists)"),
    M("fresh-klctl-update-sign", "torchtune_ppo/ppo/kl.py",
      "self.value *= 1.0 + error * n / self.horizon",
      "self.value *= 1.0 - error * n / self.horizon",
      "the adaptive KL controller moves the wrong way: a KL above target lowers the coefficient"),
    M("fresh-klctl-load-ignored", "torchtune_ppo/ppo/kl.py",
      '        self.value = float(state["value"])',
      "        pass",
      "a resume does not restore the adaptive KL coefficient: it starts again from kl_coeff"),
    M("fresh-corr-mean-per-sequence", "torchtune_ppo/rlhf/correction.py",
      "sums = torch.stack([valid.sum().float(), d.abs().sum(), k3.sum(), d.sum()])",
      "sums = torch.stack([valid.any(-1).sum().float(), d.abs().sum(), k3.sum(), d.sum()])",
      "rollout_corr/* means divide token sums by the number of sequences, not of tokens"),
    M("fresh-corr-k3-direction", "torchtune_ppo/rlhf/correction.py",
      "    k3 = torch.expm1(d) - d",
      "    k3 = torch.expm1(-d) + d",
      "the mismatch's k3 uses log(mu / pi_train): exp(-d) + d - 1 instead of exp(d) - d - 1"),
    M("fresh-update-mismatch-per-epoch", "torchtune_ppo/ppo/update.py",
      "            order = self._draw(trajectory.scores.device)",
      "            order, mismatch = self._draw(trajectory.scores.device), None",
      "the mismatch is measured again every PPO epoch: the one kept is the last epoch's, after updates"),
    M("fresh-turns-obs-mask-boundary", "torchtune_ppo/rollout/turns.py",
      "is_obs = self._chunk[None, :] < n_obs_dev[:, None]",
      "is_obs = self._chunk[None, :] <= n_obs_dev[:, None]",
      "the observation mask runs one token past the observation: the next turn's first policy token is masked"),
    M("fresh-spec-noise-sample-index", "torchtune_ppo/rollout/speculative.py",
      "keys.append(mix64(seed, round, digest, index))",
      "keys.append(mix64(seed, round, digest))",
      "the noise key leaves out the sample index: a group's n responses draw the same noise"),
    M("fresh-spec-store-load-signed", "torchtune_ppo/rollout/speculative.py",
      "self._entries[(int(key[0]) & _MASK64, int(key[1]))] = tokens.clone()",
      "self._entries[(int(key[0]), int(key[1]))] = tokens.clone()",
      "a resumed draft store keeps digests >= 2**63 as negative ints: those prompts' drafts are never found"),
    M("fresh-packing-prefix-off-by-one", "torchtune_ppo/rlhf/packing.py",
      "        if any(p[k] != first[k] for p in prompts):\n            return k\n",
      "        if any(p[k] != first[k] for p in prompts):\n            return k + 1\n",
      "the prompts' common prefix counts their first differing token: shared-prefix rows read the first prompt's token"),
    M("fresh-eval-best-ties", "torchtune_ppo/eval/record.py",
      "or (value > self.best_value if self.best_mode == \"max\" else value < self.best_value))",
      "or (value >= self.best_value if self.best_mode == \"max\" else value <= self.best_value))",
      "an evaluation equal to the best counts as a new best: a plateau never early-stops and moves the best step"),
    M("fresh-eval-pass-at-k-denominator", "torchtune_ppo/eval/metrics.py",
      "Fraction(math.comb(n - c, k), math.comb(n, k))",
      "Fraction(math.comb(n - c, k), math.comb(n, c))",
      "pass@k divides by C(n, c) instead of C(n, k)"),
    M("fresh-data-truncate-keeps-start", "torchtune_ppo/data/collate.py",
      "ids = ids[-max_prompt_len:]",
      "ids = ids[:max_prompt_len]",
      "an over-long prompt keeps its first max_prompt_len tokens, not the last ones next to the response"),
    M("fresh-reward-batch-references", "torchtune_ppo/rewards/functions.py",
      "return self(prompts, responses, references, device=query_responses.device)",
      "return self(prompts, responses, None, device=query_responses.device)",
      "a function reward scoring a batch is given no references"),
    M("fresh-reward-first-number", "torchtune_ppo/rewards/builtins.py",
      "return found[-1] if found else None",
      "return found[0] if found else None",
      "extract=last_number takes the first number of the response"),
    M("fresh-lora-shared-base-restore", "torchtune_ppo/lora.py",
      "        for m in adapters:\n            m.disabled = False",
      "        for m in adapters:\n            pass",
      "the shared base's adapters are not switched back on after the reward's forward: the value model loses its adapters"),
    M("fresh-store-best-pruned", "torchtune_ppo/checkpointing/store.py",
      "        kept |= {p for s, p in complete if s == self.kept_step}\n",
      "",
      "pruning deletes the best evaluation's checkpoint like any other old one"),
    M("fresh-gen-decode-mask-column", "torchtune_ppo/rollout/generation.py",
      "self._decode_mask_cols[P + i - 1].fill_(True)",
      "self._decode_mask_cols[P + i].fill_(True)",
      "decoding opens the next cache column instead of the fed token's: the first response token is never attended"),
    # A second fresh set (2026-12-07), written without reading the tests.
    # ---- the recipe's wiring -------------------------------------------------------------
    M("fresh2-recipe-reward-penalty-sign", RECIPE,
      "min_response_length=cfg.min_response_length, reward_penalty=float(cfg.reward_penalty))",
      "min_response_length=cfg.min_response_length, reward_penalty=-float(cfg.reward_penalty))",
      "reward_penalty negated as if it were a magnitude: a response without EOS scores +3 instead of -3"),
    M("fresh2-recipe-shuffle-forced", RECIPE,
      "batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=self.seed,",
      "batch_size=cfg.batch_size, shuffle=True, seed=self.seed,",
      "shuffle is not passed to the prompt loader: shuffle=False still shuffles the prompts"),
    M("fresh2-recipe-grad-accum-dropped", RECIPE,
      "gradient_accumulation_steps=cfg.gradient_accumulation_steps, group_size=self._group,",
      "gradient_accumulation_steps=1, group_size=self._group,",
      "gradient_accumulation_steps is not passed to the update: each minibatch runs as one micro-batch"),
    # ---- the library ---------------------------------------------------------------------
    M("fresh2-env-stale-worker-env", "torchtune_ppo/envs/base.py",
      "if self._worker is not None and (self._env is not env or not self._worker.alive):",
      "if self._worker is not None and not self._worker.alive:",
      "a timed step of another environment reuses the live worker, which still runs the first environment's copy"),
    M("fresh2-turns-obs-limit-off-by-one", "torchtune_ppo/rollout/turns.py",
      "while len(ids) > limit and observation:",
      "while len(ids) >= limit and observation:",
      "an observation of exactly max_observation_tokens tokens is cut (and counted in turns/observations_cut)"),
    M("fresh2-identity-same-size-only", "torchtune_ppo/data/identity.py",
      'a.get("size") == b.get("size") and a.get("sha256") == b.get("sha256")',
      'a.get("size") == b.get("size")',
      "a data file is taken as the saved one moved when its size alone matches: different bytes resume unrefused"),
    M("fresh2-eval-model-reward-past-last", "torchtune_ppo/eval/evaluator.py",
      "scores = self.reward(rows, masks, positions, (P + seq_lens - 1).clamp(min=0))",
      "scores = self.reward(rows, masks, positions, (P + seq_lens).clamp(min=0))",
      "the evaluation reads a reward model one past each row's last valid token (padding, or out of range)"),
    M("fresh2-weighted-sum-ignores-weights", "torchtune_ppo/rewards/builtins.py",
      "total = [t + w * s for t, s in zip(total, scores)]",
      "total = [t + s for t, s in zip(total, scores)]",
      "WeightedSum adds its components unweighted"),
    M("fresh2-sample-top-p-not-unsorted", "torchtune_ppo/rollout/sampling.py",
      "return torch.empty_like(scores).scatter_(-1, order, sorted_scores)",
      "return sorted_scores",
      "top-p without top-k returns the scores in sorted order: the sampled index is a rank, not a token id"),
    M("fresh2-adv-rpp-baseline-unwhitened", "torchtune_ppo/ppo/advantages.py",
      'if estimator == "reinforce_plus_plus_baseline":\n            advantages = rlhf.whiten(',
      'if estimator == "reinforce_plus_plus":\n            advantages = rlhf.whiten(',
      "the group branch tests the wrong estimator name: reinforce_plus_plus_baseline's advantages are never whitened"),
    M("fresh2-metrics-rlhf-reward-sign", "torchtune_ppo/run/metrics.py",
      '"rlhf_reward": scores + kl_rewards.sum(1).mean(),',
      '"rlhf_reward": scores - kl_rewards.sum(1).mean(),',
      "rlhf_reward subtracts the (already negative) KL penalty: the KL is added to the score"),
    M("fresh2-guards-updating-not-reset", "torchtune_ppo/run/guards.py",
      "self.rng, self.updating, self.evaluating, self.completed = self._capture_rng(), False, False, True",
      "self.rng, self.evaluating, self.completed = self._capture_rng(), False, True",
      # begin() and complete() both reset it; since complete() exists, this is the one a failure
      # between steps depends on (begin()'s alone would be an equivalent mutant)
      "a counted step does not reset `updating`: a failure after it (logging, on_step) is never saved"),
    M("fresh2-batches-grad-accum-global", "torchtune_ppo/config/batches.py",
      "if (cfg.ppo_batch_size // world_size) % cfg.gradient_accumulation_steps:",
      "if cfg.ppo_batch_size % cfg.gradient_accumulation_steps:",
      "several processes: gradient_accumulation_steps checked against the global ppo_batch_size, not each rank's rows"),
    M("fresh2-resume-lr-override-unscaled", "torchtune_ppo/checkpointing/resume_config.py",
      'group["lr"], group["initial_lr"] = old * new / base, new',
      'group["lr"], group["initial_lr"] = new, new',
      "a resume's new optimizer.lr replaces the scheduled lr outright: the LR schedule's position is lost"),
    # A third fresh set (2026-12-07), written without reading the tests.
    # ---- the recipe's wiring -------------------------------------------------------------
    M("fresh3-recipe-skipped-nonfinite-uncounted", RECIPE,
      "skipped = self._update.num_updates if result is None else result.skipped_updates",
      "skipped = 0 if result is None else result.skipped_updates",
      "a step skipped for a non-finite score counts no skipped updates and no skipped step"),
    M("fresh3-recipe-stats-grad-accum-one", RECIPE,
      "timer.times, grad_accum=self._update.gradient_accumulation_steps,",
      "timer.times, grad_accum=1,",
      "the step's stats are averaged as if each micro-batch were a minibatch: with accumulation they shrink"),
    M("fresh3-recipe-generator-batch-global", RECIPE,
      "self._models.policy, batch_size=cfg.forward_batch_size // self._world_size,",
      "self._models.policy, batch_size=cfg.forward_batch_size,",
      "several processes: each rank's generator is sized for the global forward batch"),
    M("fresh3-recipe-mismatch-prefers-update", RECIPE,
      "metrics.update(mismatch_metrics(adv.mismatch or (result and result.mismatch)))",
      "metrics.update(mismatch_metrics((result and result.mismatch) or adv.mismatch))",
      "with rollout_correction, rollout_corr/* report the first minibatch's gap, not the recomputed batch's"),
    M("fresh3-recipe-stop-ids-first-only", RECIPE,
      "stop_token_ids = torch.tensor(list(cfg.stop_token_ids), device=self._device)",
      "stop_token_ids = torch.tensor(list(cfg.stop_token_ids)[:1], device=self._device)",
      "scoring knows only the first stop token: a response ended by another one is scored as cut"),
    # ---- the library ---------------------------------------------------------------------
    M("fresh3-loss-dual-clip-sign", "torchtune_ppo/rlhf/loss.py",
      "is_dual = (advantages < 0) & (policy_losses > bound)",
      "is_dual = (advantages > 0) & (policy_losses > bound)",
      "dual clip bounds the tokens of positive advantage instead of negative"),
    M("fresh3-loss-clipfrac-sides", "torchtune_ppo/rlhf/loss.py",
      "(is_clipped & (ratios < 1.0)).to(dtype), (is_clipped & (ratios > 1.0)).to(dtype), is_dual.to(dtype),",
      "(is_clipped & (ratios > 1.0)).to(dtype), (is_clipped & (ratios < 1.0)).to(dtype), is_dual.to(dtype),",
      "clipfrac_low and clipfrac_high swapped"),
    M("fresh3-loss-weight-sum-norm", "torchtune_ppo/rlhf/loss.py",
      "return 1.0 / (n * response_len)",
      "return 1.0 / n",
      "seq-mean-token-sum-norm does not divide by the response length (it equals seq-mean-token-sum)"),
    M("fresh3-whiten-reduce-biased", "torchtune_ppo/rlhf/rewards.py",
      "var = reduce(centered.pow(2).sum()) / (n - 1).clamp(min=1.0)",
      "var = reduce(centered.pow(2).sum()) / n.clamp(min=1.0)",
      "several processes: whitening divides by n, not n - 1, unlike one process"),
    M("fresh3-gae-returns-actor-lambda", "torchtune_ppo/rlhf/rewards.py",
      "returns = advantages + values\n    if lmbda_actor is not None:\n        advantages = gae(values, rewards, gamma, lmbda_actor)",
      "if lmbda_actor is not None:\n        advantages = gae(values, rewards, gamma, lmbda_actor)\n    returns = advantages + values",
      "decoupled lambdas: the critic's returns use the actor's lambda"),
    M("fresh3-adaptive-lmbda-alpha", "torchtune_ppo/rlhf/rewards.py",
      "return (1.0 - 1.0 / (alpha * seq_lens.clamp(min=1).float())).clamp(min=0.0)",
      "return (1.0 - alpha / seq_lens.clamp(min=1).float()).clamp(min=0.0)",
      "length-adaptive lambda multiplies by alpha where it should divide"),
    M("fresh3-kl-k2-half", "torchtune_ppo/rlhf/kl.py",
      "return 0.5 * (logprobs - ref_logprobs).pow(2)",
      "return (logprobs - ref_logprobs).pow(2)",
      "the k2 estimator loses its one half"),
    M("fresh3-eval-shard-drops-remainder", "torchtune_ppo/eval/metrics.py",
      "return range(num_prompts * rank // world_size, num_prompts * (rank + 1) // world_size)",
      "return range(num_prompts // world_size * rank, num_prompts // world_size * (rank + 1))",
      "several processes: the prompts past the last whole share are never evaluated"),
    M("fresh3-eval-threshold-strict", "torchtune_ppo/eval/metrics.py",
      "correct = (scores.double() >= correct_threshold).view(-1, k).sum(1).tolist()",
      "correct = (scores.double() > correct_threshold).view(-1, k).sum(1).tolist()",
      "a response scoring exactly the threshold is not counted correct"),
    M("fresh3-eval-length-per-prompt", "torchtune_ppo/eval/metrics.py",
      'metrics["val/response_length"] = sums["length"] / responses',
      'metrics["val/response_length"] = sums["length"] / prompts',
      "val/response_length divides by prompts: k samples a prompt give k times the length"),
    M("fresh3-update-lr-steps-in-pretrain", "torchtune_ppo/ppo/update.py",
      "            if self.lr_scheduler is not None and not value_pretrain:\n                self.lr_scheduler.step()",
      "            if self.lr_scheduler is not None:\n                self.lr_scheduler.step()",
      "value pretraining advances the policy's LR schedule"),
    M("fresh3-fused-master-no-clip", "torchtune_ppo/ppo/update.py",
      "self._master.fused_step(self.optimizer, grad_norm, self._max_norm)",
      'self._master.fused_step(self.optimizer, grad_norm, float("inf"))',
      "bf16 masters stepped in one pass ignore clip_grad_norm"),
    M("fresh3-store-marker-step-unchecked", "torchtune_ppo/checkpointing/store.py",
      'if marker.get("step") != int(m.group(1)):',
      'if marker.get("step") is None:',
      "a checkpoint folder whose marker names another step is taken as complete"),
    M("fresh3-store-finite-first-model-only", "torchtune_ppo/checkpointing/store.py",
      "for model, sd in state_dicts.items():\n        bad, count = [], 0",
      "for model, sd in list(state_dicts.items())[:1]:\n        bad, count = [], 0",
      "only the first model's weights are checked for NaN/Inf before a save"),
    # A fourth fresh set (2026-12-07), written without reading the tests.
    # ---- the recipe's wiring -------------------------------------------------------------
    M("fresh4-recipe-update-temperature-one", RECIPE,
      "temperature=float(cfg.temperature), loss=LossSettings.from_config(loss),",
      "temperature=1.0, loss=LossSettings.from_config(loss),",
      "the update takes its logprobs at temperature 1: at another temperature the ratios are off from the first minibatch"),
    M("fresh4-recipe-recompute-logprobs-dropped", RECIPE,
      "recompute_logprobs=cfg.rollout_correction.mode is not None,",
      "",
      "rollout_correction never recomputes the old logprobs: TIS/MIS weights are all 1 and rollout_corr/* read 0"),
    M("fresh4-recipe-merge-adapters-inverted", RECIPE,
      "merge_adapters_at_end=not cfg.save_adapter_weights_only,",
      "merge_adapters_at_end=cfg.save_adapter_weights_only,",
      "a LoRA run's last save merges the adapters only when save_adapter_weights_only asks not to"),
    M("fresh4-recipe-group-metrics-n2", RECIPE,
      "if self._n > 1:",
      "if self._n > 2:",
      "with num_samples_per_prompt=2 the group metrics are not logged"),
    M("fresh4-recipe-checkpoint-format-dropped", RECIPE,
      "checkpoint_format=cfg.checkpoint_format, async_save=cfg.async_save)",
      "async_save=cfg.async_save)",
      "checkpoint_format is not passed to the checkpoint client: checkpoint_format=sharded saves full checkpoints"),
    # ---- the library ---------------------------------------------------------------------
    M("fresh4-trajectory-episode-end-off-by-one", "torchtune_ppo/rlhf/trajectory.py",
      "after = torch.arange(responses.shape[1], device=responses.device) >= episode_lens[:, None]",
      "after = torch.arange(responses.shape[1], device=responses.device) > episode_lens[:, None]",
      "multi-turn: the padding token after each episode's end counts as a valid response token"),
    M("fresh4-turns-env-reward-last-only", "torchtune_ppo/rollout/turns.py",
      "env_scores[r] += float(step.reward or 0.0)",
      "env_scores[r] = float(step.reward or 0.0)",
      "an episode's environment score is its last step's reward, not the sum of its steps' rewards"),
    M("fresh4-gen-group-logits-repeat", "torchtune_ppo/rollout/generation.py",
      "logits = logits.repeat_interleave(group_size, dim=0)  # [G * n, V]",
      "logits = logits.repeat(group_size, 1)  # [G * n, V]",
      "group prefill tiles the prompts' logits: with several groups in a chunk rows sample their first token from another prompt"),
    M("fresh4-loss-step-entropy-no-grad", "torchtune_ppo/ppo/loss_step.py",
      "entropy_grad=entropy_coeff != 0)",
      "entropy_grad=False)",
      "the entropy bonus is detached: entropy_coeff changes the logged loss but not the gradient"),
    M("fresh4-calc-first-call", "torchtune_ppo/envs/calculator.py",
      'expression = calls[-1].group(1) or ""',
      'expression = calls[0].group(1) or ""',
      "the calculator answers a turn's first call instead of its last"),
    M("fresh4-loader-seed-dropped", "torchtune_ppo/data/loader.py",
      "rank=distributed.rank(), shuffle=shuffle, seed=seed)",
      "rank=distributed.rank(), shuffle=shuffle)",
      "the prompt shuffle ignores the run's seed: every seed sees the prompts in seed 0's order"),
    M("fresh4-dataset-row-system-ignored", "torchtune_ppo/data/datasets.py",
      "system=self._system_prompt if system is None else system)",
      "system=self._system_prompt)",
      "prompt_dataset's system_column is read but ignored: every row gets the block's system_prompt"),
    M("fresh4-eval-max-prompts-ignored", "torchtune_ppo/eval/data.py",
      "n = len(dataset) if cfg.eval.max_prompts is None else min(len(dataset), cfg.eval.max_prompts)",
      "n = len(dataset)",
      "eval.max_prompts is ignored: every prompt of the evaluation set is evaluated"),
    M("fresh4-evaluator-stop-swallowed", "torchtune_ppo/eval/evaluator.py",
      'if self.on_error != "skip" or distributed.world_size() > 1:',
      'if self.on_error != "skip" and distributed.world_size() > 1:',
      "on one process a failing evaluation is skipped even with eval.on_error=stop"),
    M("fresh4-optim-fused-overrides-config", "torchtune_ppo/run/optim.py",
      'if cfg_optimizer.get("fused") is not None or cfg_optimizer.get("foreach") is not None:',
      'if cfg_optimizer.get("fused") is not None and cfg_optimizer.get("foreach") is not None:',
      "an optimizer block that sets only fused or foreach still gets fused=True added"),
    M("fresh4-interrupt-sighup-inverted", "torchtune_ppo/run/interrupt.py",
      "if signum == SIGHUP and signal.getsignal(signum) is signal.SIG_IGN:",
      "if signum == SIGHUP and signal.getsignal(signum) is not signal.SIG_IGN:",
      "SIGHUP is handled only under nohup: a closed terminal kills the run without a save"),
    M("fresh4-checks-loss-defaults-override", "torchtune_ppo/config/checks.py",
      "if key not in loss and default is not inspect.Parameter.empty:",
      "if default is not inspect.Parameter.empty:",
      "a loss _component_ block's own values (epsilon, ...) are overwritten by the component's defaults"),
    M("fresh4-format-match-anchored", "torchtune_ppo/rewards/builtins.py",
      "match = self.regex.fullmatch if self.fullmatch else self.regex.search",
      "match = self.regex.fullmatch if self.fullmatch else self.regex.match",
      "FormatMatch without fullmatch finds its pattern only at the start of the response"),
    M("fresh4-lora-value-head-frozen", "torchtune_ppo/lora.py",
      "train_adapters_only(model, also=head_names(model) if train_head else ())",
      "train_adapters_only(model)",
      "a LoRA value model's head is frozen: only its adapters train"),
    M("fresh4-store-verify-oldest", "torchtune_ppo/checkpointing/store.py",
      "for _, path in reversed(complete if verify else []):",
      "for _, path in (complete if verify else []):",
      "with verify the oldest intact checkpoint is chosen, not the newest (and the newer ones are set aside)"),
    M("fresh4-state-pending-rng-kept", "torchtune_ppo/checkpointing/training_state.py",
      "self.restore_rng(self.pending_rng)\n            self.pending_rng = None",
      "self.restore_rng(self.pending_rng)",
      "a resumed run's saved random states are put back at every epoch start, not once"),
    # A fifth fresh set (2026-12-08), written without reading the tests; the library first, so
    # that a round cut short still has them (a missed recipe mutant runs ~10 min).
    # ---- the library ---------------------------------------------------------------------
    M("fresh5-gen-prefix-copy-last-col", "torchtune_ppo/rollout/generation.py",
      "self.kv_cache.copy_to_group(self.batch_size, self.prefix_len)",
      "self.kv_cache.copy_to_group(self.batch_size, self.prefix_len - 1)",
      "the shared prefix's last cache column is not copied from row 0: every other row attends a stale column"),
    M("fresh5-gen-prefix-whole-prompt", "torchtune_ppo/rollout/generation.py",
      "if not bool((lens > self.prefix_len).all() & (prefixes == prefixes[:1]).all()):",
      "if not bool((lens >= self.prefix_len).all() & (prefixes == prefixes[:1]).all()):",
      "a prompt that is exactly the shared prefix takes the prefix path: its first token is sampled after a padding column"),
    M("fresh5-gen-prefix-rest-unshifted", "torchtune_ppo/rollout/generation.py",
      "torch.ge(self._prompt_cols, P + c - inp.prompt_lens[:, None], out=not_padding)",
      "torch.ge(self._prompt_cols, P - inp.prompt_lens[:, None], out=not_padding)",
      "with a shared prefix the rest's real columns start c too early: c padding columns are attended and positions run c too far"),
    M("fresh5-machine-busy-truncated", "torchtune_ppo/config/machine.py",
      "others = 0 if taken is None else min(cores, int(taken + 0.5))",
      "others = 0 if taken is None else min(cores, int(taken))",
      "cpu_threads=auto truncates the busy cores: a core another process keeps 90% busy is taken as free"),
    M("fresh5-machine-local-world-ignored", "torchtune_ppo/config/machine.py",
      "threads = max(1, (cores - others) // local)",
      "threads = max(1, cores - others)",
      "cpu_threads=auto under torchrun: each local process takes every free core, not its share"),
    M("fresh5-machine-iowait-busy", "torchtune_ppo/config/machine.py",
      "idle = ticks[3] + ticks[4]",
      "idle = ticks[3]",
      "busy_cores counts time waiting for I/O as busy: a core idle on I/O is left out of cpu_threads=auto"),
    M("fresh5-eval-prefix-unclamped", "torchtune_ppo/eval/evaluator.py",
      "shared.append(min(common_prefix_len(rows), min(lens, default=0) - 1))",
      "shared.append(common_prefix_len(rows))",
      "eval_prefix_len is not kept below a set's shortest prompt: a prompt that is the whole prefix turns sharing off (or the Generator refuses it)"),
    M("fresh5-eval-batch-cap-per-prompt", "torchtune_ppo/eval/evaluator.py",
      "for p in prompt_sets) * block.num_samples",
      "for p in prompt_sets)",
      "the evaluation's batch is capped at a process's prompts, not its k responses to them: k times the calls"),
    M("fresh5-eval-prefix-null-off", "torchtune_ppo/eval/evaluator.py",
      "prefix_len=eval_prefix_len(prompt_sets) if share_prefix is not False and turns is None else 0,",
      "prefix_len=eval_prefix_len(prompt_sets) if share_prefix and turns is None else 0,",
      "share_prompt_prefix: null (the default) turns the evaluation's shared prefix off"),
    M("fresh5-batches-generation-prefix-always", "torchtune_ppo/config/batches.py",
      "return max(0, min(dataset_prefix(dataset)[0], prompt_len - 1)) if on else 0",
      "return max(0, min(dataset_prefix(dataset)[0], prompt_len - 1))",
      "generation_prefix ignores `on`: the generator shares the dataset's prefix with share_prompt_prefix off, and with groups"),
    M("fresh5-metrics-length-max-mean", "torchtune_ppo/run/metrics.py",
      '"response_lengths_max": trajectory.seq_lens.max(),',
      '"response_lengths_max": trajectory.seq_lens.float().mean(),',
      "response_lengths_max copied from the line above: it logs the mean length"),
    M("fresh5-metrics-gen-tps-traj-time", "torchtune_ppo/run/metrics.py",
      '"generated_tokens_per_second": trajectory.seq_lens.sum() / times["generate"],',
      '"generated_tokens_per_second": trajectory.seq_lens.sum() / traj_time,',
      "generated_tokens_per_second divides by generation and scoring time"),
    M("fresh5-packing-prefix-row-len-no-copy", "torchtune_ppo/rlhf/packing.py",
      "return [p for p in pieces if p], shared_len + max(load, default=0)",
      "return [p for p in pieces if p], max(load, default=0)",
      "prefix_pieces' row length leaves out the prefix copy's slots: the longest piece no longer fits its row"),
    M("fresh5-scoring-first-read-after-previous", "torchtune_ppo/rollout/scoring.py",
      "read_pos[read] = at - 1 if own else slot + p - 1",
      "read_pos[read] = at - 1",
      "shared prompts in scoring: a piece's second response reads its first token after the first response's last token"),
    M("fresh5-scoring-reward-past-last", "torchtune_ppo/rollout/scoring.py",
      "last_positions[i] = at + v - 1",
      "last_positions[i] = at + v",
      "packed scoring reads the reward model one slot past each row's last valid token"),
    # ---- the recipe's wiring -------------------------------------------------------------
    M("fresh5-recipe-generation-prefix-config", RECIPE,
      "prefix_len=batches.generation_prefix(self._prefix, self._dataloader.dataset,",
      "prefix_len=batches.generation_prefix(cfg.share_prompt_prefix, self._dataloader.dataset,",
      "the generator's prefix follows the config key, not the resolved sharing: null never shares it in generation"),
    M("fresh5-recipe-update-share-prefix-dropped", RECIPE,
      "master_weights=self._master, share_prefix=self._prefix,",
      "master_weights=self._master,",
      "share_prompt_prefix is not passed to the update: the loss step packs every prompt whole"),
    M("fresh5-recipe-eval-keep-step-dropped", RECIPE,
      "warm_up=self._recompiles.excluded, keep_step=manager.keep_step,",
      "warm_up=self._recompiles.excluded,",
      "the evaluator is not given the manager's keep_step: the best evaluation's checkpoint is pruned like any other"),
)
del M


# ---- reading a revision ------------------------------------------------------------------

def git(*args: str, cwd: Path = ROOT, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


class Tree:
    """The files of one revision: a worktree's, or read from git (``--list``)."""

    def __init__(self, rev: str, worktree: Optional[Path] = None) -> None:
        self.rev, self.worktree = rev, worktree
        self._cache: Dict[str, Optional[str]] = {}
        self._trees: Dict[str, Optional[ast.AST]] = {}
        self._tests: Dict[str, List[str]] = {}

    def read(self, path: str) -> Optional[str]:
        if path not in self._cache:
            if self.worktree is not None:
                p = self.worktree / path
                self._cache[path] = p.read_text() if p.is_file() else None
            else:
                proc = subprocess.run(["git", "show", f"{self.rev}:{path}"], cwd=ROOT, capture_output=True)
                self._cache[path] = proc.stdout.decode() if proc.returncode == 0 else None
        return self._cache[path]

    def parse(self, path: str) -> Optional[ast.AST]:
        if path not in self._trees:
            try:
                self._trees[path] = ast.parse(self.read(path) or "")
            except SyntaxError:
                self._trees[path] = None
        return self._trees[path]

    def files(self, folder: str) -> List[str]:
        out = git("ls-tree", "-r", "--name-only", self.rev, "--", folder)
        return sorted(p for p in out.splitlines() if p.endswith(".py"))


def check_mutation(m: Mutation, tree: Tree) -> Tuple[str, str]:
    """``(status, detail)``: ``ok``, ``stale`` (``old`` missing or not unique) or ``invalid``
    (the mutated file does not parse)."""
    text = tree.read(m.path)
    if text is None:
        return "stale", f"{m.path} does not exist"
    count = text.count(m.old)
    if count != 1:
        return "stale", "old snippet missing" if count == 0 else f"old snippet occurs {count} times"
    if m.old == m.new:
        return "invalid", "new equals old"
    try:
        ast.parse(text.replace(m.old, m.new))
    except SyntaxError as e:
        return "invalid", f"the mutated file does not parse: {e}"
    return "ok", ""


# ---- which tests import a module --------------------------------------------------------

def module_of(path: str) -> str:
    """The dotted module a file is imported as (the recipe is the top-level ``ppo_full_finetune``)."""
    if path == RECIPE:
        return "ppo_full_finetune"
    return path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def top_level_names(source: str) -> Set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names - {"log", "__all__"}


def refers_to(tree: Optional[ast.AST], dotted: str, names: Set[str], strings: bool = True) -> bool:
    """Whether a test file (its AST) imports module ``dotted``: by its path, ``from <package>
    import <one of its names>``, or ``<package alias>.<one of its names>``; with ``strings`` also
    a string naming it or something in it (a monkeypatch target such as ``"pkg.mod.name"``)."""
    if tree is None:
        return False
    pkg, _, base = dotted.rpartition(".")
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module == dotted or full == dotted or node.module.startswith(dotted + "."):
                    return True
                if pkg and node.module == pkg and a.name in names:
                    return True
                if pkg and full == pkg:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == dotted or a.name.startswith(dotted + "."):
                    return True
                if pkg and a.name == pkg and a.asname:
                    aliases.add(a.asname)
        elif (strings and isinstance(node, ast.Constant) and isinstance(node.value, str)
              and (node.value == dotted or node.value.startswith(dotted + "."))):
            return True
    return any(isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
               and (node.attr in names or node.attr == base) for node in ast.walk(tree))


def helper_module(path: str) -> Optional[str]:
    """The name a test helper is imported as (``tests/twins/rlhf.py`` -> ``twins.rlhf``)."""
    rel = path[len("tests/"):-len(".py")]
    name = Path(path).name
    if name.startswith("test_") or name == "conftest.py":
        return None
    return rel.replace("/", ".").removesuffix(".__init__")


def fixture_users(tree: Tree, test_files: Sequence[str], dotted: str, names: Set[str]) -> Set[str]:
    """Test files that reach module ``dotted`` through a conftest fixture that imports it
    (``make_recipe`` imports the recipe in its body): the fixture, and the fixtures that take
    it, named as a test function's argument or in ``usefixtures``."""
    fixtures: Dict[str, ast.FunctionDef] = {}
    for conf in (f for f in test_files if Path(f).name == "conftest.py"):
        parsed = tree.parse(conf)
        for node in ast.walk(parsed) if parsed is not None else ():
            if isinstance(node, ast.FunctionDef) and any(
                    "fixture" in ast.unparse(d) for d in node.decorator_list):
                fixtures[node.name] = node
    using = {name for name, fn in fixtures.items() if refers_to(fn, dotted, names, strings=False)}
    while True:  # fixtures that take one of those
        more = {name for name, fn in fixtures.items()
                if name not in using and any(a.arg in using for a in fn.args.args)}
        if not more:
            break
        using |= more
    if not using:
        return set()
    hits = set()
    for f in test_files:
        parsed = tree.parse(f)
        if Path(f).name == "conftest.py" or parsed is None:
            continue
        for node in ast.walk(parsed):
            if (isinstance(node, ast.FunctionDef) and any(a.arg in using for a in node.args.args)) or (
                    isinstance(node, ast.Constant) and node.value in using):
                hits.add(f)
                break
    return hits


def importing_tests(tree: Tree, path: str) -> List[str]:
    """Test files that import the module at ``path``, directly or through test helpers."""
    if path in tree._tests:
        return tree._tests[path]
    dotted, names = module_of(path), top_level_names(tree.read(path) or "")
    test_files = tree.files("tests")
    # the recipe: only the files that import it (every end-to-end test names it in `tune run`)
    hits = {f for f in test_files if refers_to(tree.parse(f), dotted, names, strings=path != RECIPE)}
    hits |= fixture_users(tree, test_files, dotted, names)
    # helpers one level at a time, until nothing new (twins.loss_step imports twins.rlhf)
    frontier, seen = {f for f in hits if helper_module(f)}, set()
    while frontier:
        seen |= frontier
        new = set()
        for helper in frontier:
            hmod, hnames = helper_module(helper), top_level_names(tree.read(helper) or "")
            new |= {f for f in test_files if f not in hits and refers_to(tree.parse(f), hmod, hnames, strings=False)}
        hits |= new
        frontier = {f for f in new if helper_module(f)} - seen
    tree._tests[path] = sorted(f for f in hits if Path(f).name.startswith("test_"))
    return tree._tests[path]


def _order(item: str) -> Tuple[int, int, str]:
    path = item.split("::")[0]
    rank = next((i for i, d in enumerate(("tests/unit/", "tests/parity/", "tests/e2e/")) if path.startswith(d)), 3)
    return rank, 0 if "::" in item else 1, item  # a single end-to-end test before whole files


def selection(tree: Tree, m: Mutation, tier: str) -> List[str]:
    """The pytest arguments that select the tests run against mutant ``m``."""
    if tier == "fast":
        return ["-m", "not slow", "tests/unit", "tests/parity"]
    if tier == "all":
        return ["tests"]
    files = importing_tests(tree, m.path)
    items = set(files)
    for fixed in FIXED_TESTS:
        if fixed.split("::")[0] not in items:
            items.add(fixed)
    return sorted(items, key=_order)


# ---- running ------------------------------------------------------------------------------

PLUGIN = '''\
"""Records each failing test (and failed collection) as it happens: a timeout after a failure
still counts the mutant as caught, with its first failing test."""
import os


def _record(nodeid):
    with open(os.environ["SEED_BUGS_FAILED"], "a") as f:
        f.write(nodeid + "\\n")


def pytest_runtest_logreport(report):
    if report.failed:
        _record(report.nodeid)


def pytest_collectreport(report):
    if report.failed:
        _record("collecting " + (report.nodeid or "tests"))
'''


class Run(NamedTuple):
    rc: Optional[int]  # None: timed out
    seconds: float
    failures: List[str]


class Runner:
    """Runs pytest in the worktree, one process group per run, killed on timeout or Ctrl-C."""

    def __init__(self, worktree: Path, plugin_dir: Path, logs: Path) -> None:
        self.worktree, self.logs = worktree, logs
        self.failed_file = plugin_dir / "failed.txt"
        env = dict(os.environ)
        env.pop("PYTEST_ADDOPTS", None)
        env.update(
            PYTHONPATH=os.pathsep.join([str(worktree), str(worktree / "recipes"), str(plugin_dir)]),
            OMP_NUM_THREADS="1",
            PYTHONDONTWRITEBYTECODE="1",
            SEED_BUGS_FAILED=str(self.failed_file),
        )
        self.env = env
        self.deselected: List[str] = []  # tests that fail on the unmutated revision

    def check_imports(self) -> None:
        """The worktree's package and recipe must be the ones imported, not the editable install's."""
        code = "import torchtune_ppo, ppo_full_finetune; print(torchtune_ppo.__file__); print(ppo_full_finetune.__file__)"
        out = subprocess.run([sys.executable, "-c", code], cwd=self.worktree, env=self.env,
                             capture_output=True, text=True)
        paths = out.stdout.split()
        if out.returncode != 0 or len(paths) != 2 or not all(
                Path(p).resolve().is_relative_to(self.worktree.resolve()) for p in paths):
            raise SystemExit(f"the worktree's code is not the one imported: {out.stdout}{out.stderr[-2000:]}")

    def pytest(self, args: Sequence[str], timeout: float, log_name: str, exitfirst: bool = True) -> Run:
        flags = PYTEST_FLAGS if exitfirst else PYTEST_FLAGS[1:]
        deselect = [a for t in self.deselected for a in ("--deselect", t)]
        cmd = [sys.executable, "-m", "pytest", *flags, "-p", "_seed_bugs_plugin", *deselect, *args]
        self.failed_file.write_text("")
        self.logs.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(self.logs / f"{log_name}.log", "w") as log:
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=self.worktree, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc)
        failures = [line for line in self.failed_file.read_text().splitlines() if line]
        return Run(rc, time.monotonic() - start, failures)


def _kill_group(proc: subprocess.Popen) -> None:
    """Ends the pytest process and everything it started (``tune run``, torchrun), if still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL also for stragglers that outlive pytest
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def classify(run: Run) -> str:
    if run.rc is None:
        return "caught" if run.failures else "timeout"
    if run.rc == 0:
        return "missed"
    if run.rc in (1, 2) or run.failures:  # failed tests, or errors during collection
        return "caught"
    return "error"


class Worktree:
    """``git worktree add --detach <path> <rev>``, removed on exit."""

    def __init__(self, path: Path, rev: str, keep: bool = False) -> None:
        self.path, self.rev, self.keep = path, rev, keep

    def __enter__(self) -> Path:
        git("worktree", "prune")
        listed = [line.split(" ", 1)[1] for line in git("worktree", "list", "--porcelain").splitlines()
                  if line.startswith("worktree ")]
        if self.path.exists():
            if str(self.path.resolve()) not in {str(Path(p).resolve()) for p in listed}:
                raise SystemExit(f"{self.path} exists and is not a worktree of {ROOT}: remove it or pass --worktree")
            git("worktree", "remove", "--force", str(self.path))
        git("worktree", "add", "--detach", str(self.path), self.rev)
        return self.path

    def __exit__(self, *exc) -> None:
        if not self.keep and self.path.exists():
            git("worktree", "remove", "--force", str(self.path), check=False)
            shutil.rmtree(self.path, ignore_errors=True)
            git("worktree", "prune", check=False)


def apply_and_test(m: Mutation, worktree: Path, runner: Runner, args: Sequence[str], timeout: float,
                   log_name: str) -> Run:
    """Writes the bug, runs the tests, and puts the file back from git whatever happens."""
    target = worktree / m.path
    original = target.read_bytes()
    try:
        target.write_text(original.decode().replace(m.old, m.new, 1))
        return runner.pytest(args, timeout, log_name)
    finally:
        git("-C", str(worktree), "checkout", "--", m.path, check=False)
        if target.read_bytes() != original:
            target.write_bytes(original)


class Confirmer:
    """Whether a test passes on the unmutated worktree, each test run there once."""

    def __init__(self, runner: Runner, timeout: float) -> None:
        self.runner, self.timeout = runner, timeout
        self.passes: Dict[str, bool] = {}

    def __call__(self, test: str) -> bool:
        if test not in self.passes:
            name = "_unmutated_" + "".join(c if c.isalnum() else "_" for c in test)[-120:]
            run = self.runner.pytest([test], self.timeout, name)
            self.passes[test] = run.rc == 0
            verdict = "passes" if self.passes[test] else "FAILS: deselected from now on"
            print(f"{'':8}unmutated, {run.seconds:.0f} s: {test} {verdict}", flush=True)
        return self.passes[test]


def test_mutant(m: Mutation, worktree: Path, runner: Runner, args: Sequence[str], timeout: float,
                confirm: Optional[Confirmer]) -> Tuple[Run, List[str]]:
    """The mutant's run, and the first failing tests found broken without it (then deselected
    and the mutant run again)."""
    broken: List[str] = []
    while True:
        run = apply_and_test(m, worktree, runner, args, timeout, m.id if not broken else f"{m.id}.{len(broken)}")
        first = run.failures[0] if run.failures else None
        if (confirm is None or classify(run) != "caught" or first is None or first.startswith("collecting")
                or confirm(first)):
            return run, broken
        broken.append(first)
        runner.deselected.append(first)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    except OSError:
        return ""


def area(m: Mutation) -> str:
    return "recipe" if m.path == RECIPE else "library"


def summarize(results: List[dict]) -> dict:
    def part(rows):
        applicable = [r for r in rows if r["status"] not in ("stale", "invalid", "not run")]
        caught = sum(r["status"] == "caught" for r in applicable)
        return {"caught": caught, "applicable": len(applicable),
                "percent": round(100.0 * caught / len(applicable), 1) if applicable else None,
                **{s: sum(r["status"] == s for r in rows)
                   for s in ("missed", "timeout", "error", "stale", "invalid", "not run")}}
    return {"all": part(results), "recipe": part([r for r in results if r["area"] == "recipe"]),
            "library": part([r for r in results if r["area"] == "library"])}


def _line(r: dict) -> str:
    first = f"  <- {r['first_failure']}" if r.get("first_failure") else ""
    detail = f" ({r['detail']})" if r.get("detail") else ""
    return f"{r['status']:<8}{r['seconds']:>6.0f}s  {r['id']:<32} {r['path']:<44} {r['what']}{detail}{first}"


def _summary_lines(s: dict) -> List[str]:
    out = []
    for name in ("all", "recipe", "library"):
        p = s[name]
        pct = "n/a" if p["percent"] is None else f"{p['percent']:.1f}%"
        extra = ", ".join(f"{k} {p[k]}" for k in ("missed", "timeout", "error", "stale", "invalid", "not run")
                          if p[k])
        out.append(f"{name:<8} caught {p['caught']}/{p['applicable']} = {pct}" + (f" ({extra})" if extra else ""))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=("fast", "targeted", "all"), default="targeted")
    parser.add_argument("--only", default="", help="comma-separated mutation ids")
    parser.add_argument("--list", action="store_true", help="check every mutation against the revision, run nothing")
    parser.add_argument("--rev", default="HEAD", help="the revision measured (default HEAD)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run of a mutant (default 900)")
    parser.add_argument("--out", default="/tmp/seed_bugs.json")
    parser.add_argument("--logs", default="/tmp/seed_bugs_logs", help="each mutant's pytest output")
    parser.add_argument("--worktree", default="/tmp/seedwt")
    parser.add_argument("--keep-worktree", action="store_true")
    parser.add_argument("--no-confirm", action="store_true",
                        help="do not run a caught mutant's first failing test on the unmutated worktree")
    parser.add_argument("--deselect", action="append", default=[], metavar="NODEID",
                        help="a test known to fail on the revision, left out of every run (repeatable)")
    args = parser.parse_args(argv)

    chosen = list(MUTATIONS)
    ids = [m.id for m in MUTATIONS]
    if len(set(ids)) != len(ids):
        raise SystemExit("duplicate mutation ids")
    if args.only:
        wanted = [i.strip() for i in args.only.split(",") if i.strip()]
        unknown = [i for i in wanted if i not in ids]
        if unknown:
            raise SystemExit(f"unknown mutation ids: {unknown}; --list shows them")
        chosen = [m for m in MUTATIONS if m.id in wanted]

    rev = git("rev-parse", "--short", args.rev).strip()
    if args.list:
        tree, bad = Tree(rev), 0
        for m in chosen:
            status, detail = check_mutation(m, tree)
            bad += status != "ok"
            sel = selection(tree, m, args.tier)
            print(f"{status:<8}{m.id:<32} {m.path:<44} {m.what}" + (f" ({detail})" if detail else ""))
            print(f"{'':8}tests: {' '.join(sel)}")
        print(f"{len(chosen)} mutations at {rev} ({sum(area(m) == 'recipe' for m in chosen)} in the recipe), "
              f"{bad} stale or invalid")
        return 1 if bad else 0

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
    results: List[dict] = []
    report = {"rev": rev, "deselected": list(args.deselect), "tier": args.tier, "started": started, "cpu": _cpu(), "timeout_s": args.timeout,
              "command": " ".join(["python tools/seed_bugs.py", *(sys.argv[1:] if argv is None else argv)]),
              "mutants": results}

    def write_out(done: bool) -> None:
        report.update(seconds=round(time.monotonic() - t0, 1), complete=done, summary=summarize(results))
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    plugin_dir = Path(tempfile.mkdtemp(prefix="seed_bugs_plugin_"))
    (plugin_dir / "_seed_bugs_plugin.py").write_text(PLUGIN)
    interrupted = False
    try:
        with Worktree(Path(args.worktree), rev, keep=args.keep_worktree) as wt:
            tree = Tree(rev, wt)
            runner = Runner(wt, plugin_dir, Path(args.logs))
            runner.deselected = list(args.deselect)
            runner.check_imports()
            confirm = None if args.no_confirm else Confirmer(runner, args.timeout)
            print(f"seed_bugs: {len(chosen)} mutations at {rev}, tier {args.tier}, worktree {wt}", flush=True)
            try:
                for m in chosen:
                    status, detail = check_mutation(m, tree)
                    row = {"id": m.id, "path": m.path, "area": area(m), "what": m.what, "status": status,
                           "detail": detail, "seconds": 0.0, "first_failure": None, "tests": []}
                    if status == "ok":
                        row["tests"] = selection(tree, m, args.tier)
                        t = time.monotonic()
                        run, broken = test_mutant(m, wt, runner, row["tests"], args.timeout, confirm)
                        row.update(status=classify(run), seconds=round(time.monotonic() - t, 1), rc=run.rc,
                                   first_failure=run.failures[0] if run.failures else None,
                                   broken_unmutated=broken,
                                   log=str(Path(args.logs) / f"{m.id}{f'.{len(broken)}' if broken else ''}.log"))
                    results.append(row)
                    print(_line(row), flush=True)
                    report["deselected"] = list(runner.deselected)
                    write_out(False)
            except KeyboardInterrupt:
                interrupted = True
                done = {r["id"] for r in results}
                rest = [m for m in chosen if m.id not in done]
                results.extend({"id": m.id, "path": m.path, "area": area(m), "what": m.what, "status": "not run",
                                "detail": "", "seconds": 0.0, "first_failure": None, "tests": []} for m in rest)
                print(f"interrupted: {len(rest)} mutations not run; to run them: "
                      f"python tools/seed_bugs.py --only {','.join(m.id for m in rest)}", flush=True)
    finally:
        shutil.rmtree(plugin_dir, ignore_errors=True)
        write_out(not interrupted)
    print(f"\n{rev}, tier {args.tier}, {time.monotonic() - t0:.0f} s; caught / applicable:")
    for line in _summary_lines(report["summary"]):
        print("  " + line)
    missed = [r for r in results if r["status"] in ("missed", "timeout", "error")]
    if missed:
        print("not caught:")
        for r in missed:
            print(f"  {r['status']:<8}{r['id']:<32} {r['path']}: {r['what']}")
    for test in report.get("deselected", []):
        print(f"deselected (fails on the unmutated revision): {test}")
    print(f"JSON: {args.out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
