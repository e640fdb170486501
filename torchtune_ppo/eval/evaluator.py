"""Evaluation during training: the policy's responses to held-out prompts, scored, as ``val/`` metrics.

:class:`Evaluator` is what the recipe calls after each step (:meth:`Evaluator.when_due`). It
generates with its own :class:`~torchtune_ppo.rollout.generation.Generator` on the policy (its
own KV cache and sampling settings, the run's prefill and decode step, compiled when
``compile.generate`` is), from its own random stream seeded by the run's seed and the step, so
the training's streams are never drawn from: a run with evaluation trains exactly as one
without. Each process evaluates its own block of the prompts; the sums are added over processes
before the means are taken. The scores are the reward's (the training reward or
``eval.reward``) with the training's penalties; a response is correct when its score reaches
``eval.correct_threshold``.

An evaluation that raises ends the run (``eval.on_error: stop``, the recipe saves the steps
completed before it) or, with ``skip`` on one process, is logged as a warning and left out: no
``val/`` row, nothing recorded, training goes on.
"""

import contextlib
import time
import zlib
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, utils

from torchtune_ppo import distributed, lora
from torchtune_ppo._patches.torchtune_modules import final_hidden_states
from torchtune_ppo.config.batches import MIN_SHARED_PREFIX
from torchtune_ppo.eval.data import EvalPrompts
from torchtune_ppo.eval.metrics import eval_metrics, part_names, prompt_shard, sum_over_processes, tally
from torchtune_ppo.eval.record import EvalRecord
from torchtune_ppo.rewards import FunctionReward, ModelReward, WeightedSum
from torchtune_ppo.rlhf import ScoringSettings, block_causal_masks, get_reward_penalty_mask, repeat_prompts, truncated
from torchtune_ppo.rlhf.packing import common_prefix_len, prefix_row_len, prompt_prefix
from torchtune_ppo.rollout import Rollout
from torchtune_ppo.rollout.generation import GenerationSteps, Generator
from torchtune_ppo.rollout.scoring import plan_scoring
from torchtune_ppo.rollout.turns import EpisodeStats, TurnRunner, episode_texts

__all__ = ["ON_ERROR", "EvalScorer", "Evaluator", "build_evaluator", "eval_mode", "eval_prefix_len", "eval_seed",
           "packed_model_scores", "reward_parts"]

# What an evaluation that raises does (``eval.on_error``): end the run, or be left out.
ON_ERROR = ("stop", "skip")


def eval_seed(seed: int, step: int, rank: int, name: Optional[str] = None) -> int:
    """The seed of the evaluation's random stream after ``step`` steps on process ``rank``, for its
    set of prompts called ``name`` (each named set draws from a stream of its own, whatever sets
    are evaluated beside it; the one unnamed set of ``eval.dataset`` from the run's)."""
    salt = 0 if name is None else zlib.crc32(name.encode()) * 999_983
    return (int(seed) * 1_000_003 + int(step) * 1_009 + int(rank) + salt) % (2**63)


class EvalScorer:
    """Scores of generated rows: the reward's, then the training's penalties (no KL).

    Args:
        reward (Union[FunctionReward, ModelReward]): a function of the decoded texts, or a reward
            model read at each row's last valid token.
        settings (ScoringSettings): ``prompt_len`` (the evaluation's ``P``), ``pad_id`` and the
            penalties.
        stop_token_ids (torch.Tensor): ``[n_stop]`` on the models' device.
        parts (Optional[Mapping[str, FunctionReward]]): the parts of a combined reward, each scored
            on its own as well (their means are logged as ``val/reward/<name>``).
    """

    def __init__(self, reward: Union[FunctionReward, ModelReward], settings: ScoringSettings,
                 stop_token_ids: torch.Tensor, parts: Optional[Mapping[str, FunctionReward]] = None) -> None:
        self.reward, self.settings, self.stop_token_ids = reward, settings, stop_token_ids
        self.parts = dict(parts or {})

    def __call__(self, query_responses: torch.Tensor, prompt_lens: torch.Tensor,
                 references: Sequence[Optional[str]], episodes=None) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """``[b]`` scores (float32) and valid lengths of ``query_responses [b, P + T]``, and each part's
        ``[b]`` scores. ``episodes``: the :class:`~torchtune_ppo.rollout.turns.EpisodeOutput` of
        multi-turn rows, scored whole (with the environment's rewards); their lengths count the
        policy's tokens."""
        P = self.settings.prompt_len
        lens, obs = (None, None) if episodes is None else (episodes.episode_lens, episodes.observation_masks)
        rows, padding, masks, positions = truncated(query_responses, prompt_lens, self.stop_token_ids, self.settings,
                                                    lens, obs)
        seq_lens = (~padding).sum(-1)  # [b], stop token included
        if episodes is not None:  # the reward reads the whole episode
            valid, seq_lens = seq_lens, episodes.episode_lens
        if isinstance(self.reward, ModelReward) and episodes is None:
            scores = packed_model_scores(self.reward.model, rows, prompt_lens, seq_lens, P)
        elif isinstance(self.reward, ModelReward):
            scores = self.reward(rows, masks, positions, (P + seq_lens - 1).clamp(min=0))
        else:
            scores = self._function(self.reward, rows, prompt_lens, seq_lens, references, episodes)
        parts = {name: self._function(fn, rows, prompt_lens, seq_lens, references, episodes)
                 for name, fn in self.parts.items()}
        penalty = get_reward_penalty_mask(padding, seq_lens, self.stop_token_ids, rows[:, P:],
                                          self.settings.penalise_no_eos, self.settings.min_response_length)
        scores = torch.where(penalty, torch.full_like(scores, self.settings.reward_penalty), scores.float())
        if episodes is not None:
            return scores + episodes.env_scores, valid, parts
        return scores, seq_lens, parts

    def _function(self, fn: FunctionReward, rows, prompt_lens, seq_lens, references, episodes=None) -> torch.Tensor:
        if episodes is not None:  # an episode's reward reads its final assistant turn
            return fn(*episode_texts(episodes, prompt_lens, self.settings.prompt_len), list(references),
                      device=rows.device)
        return fn.score_batch(rows, prompt_lens, seq_lens, list(references), prompt_len=self.settings.prompt_len,
                              stop_token_ids=self.stop_token_ids)


def packed_model_scores(model: nn.Module, rows: torch.Tensor, prompt_lens: torch.Tensor, seq_lens: torch.Tensor,
                        prompt_len: int) -> torch.Tensor:
    """A reward model's ``[b]`` scores of truncated ``rows [b, P + T]``, on their real tokens only:
    packed as the rollout's scoring packs them (:func:`~torchtune_ppo.rollout.scoring.plan_scoring`),
    the prefix every prompt shares once per packed row, read at each row's last valid token
    (``seq_lens [b]`` valid response tokens, each >= 1). The padded rows' scores up to rounding:
    the same tokens, positions and attention, in fewer slots."""
    lens, valid = prompt_lens.tolist(), seq_lens.tolist()
    prefix, response_len = prompt_prefix(rows, lens, prompt_len), rows.shape[1] - prompt_len
    limit = getattr(model, "max_seq_len", None)  # packed rows no longer than the model takes
    plan = plan_scoring(lens, valid, prompt_len=prompt_len, response_len=response_len, num_chunks=1,
                        device=rows.device, common_prefix=prefix,
                        row_len=prefix_row_len(prompt_len, response_len, limit if isinstance(limit, int) else None))
    # rows and row length dynamic, as the rollout's: compiled layers trace once for every mix
    plan = plan.mark_dynamic(length=True)
    tokens = rows.flatten()[plan.token_src]  # [R, L]
    masks = block_causal_masks(plan.segment_ids, plan.prefix_ids)
    h = lora.base_adapters_off(model, lambda m: final_hidden_states(m, tokens, mask=masks, input_pos=plan.position_ids))
    return model.output(h.flatten(0, 1)[plan.last_positions])[:, 0].float()


@contextlib.contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """Every module of ``models`` in eval mode for the block, each back to its own mode after."""
    modes = [(m, m.training) for model in models for m in model.modules()]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class Evaluator:
    """Evaluates the policy when the record says it is due; see the module's docstring.

    Args:
        generator (Optional[Generator]): the evaluation's generator on the policy; None when
            evaluation is off.
        prompts (Optional[Union[EvalPrompts, Sequence[EvalPrompts]]]): every evaluation prompt (each
            process takes its block of each set), every set of one width. A named set's metrics
            are logged as ``val/<name>/...``, an unnamed one's as ``val/...``.
        scorer (Optional[EvalScorer]): scores the responses.
        record (EvalRecord): when to evaluate, the history, the best and the stopping rule.
        num_samples (int): ``k``, responses per prompt.
        correct_threshold (float): a response is correct when its score is at least this.
        seed (int): the run's seed; each evaluation's stream is seeded from it and the step.
        models (Sequence[nn.Module]): the models the evaluation runs (the policy, a reward model):
            put in eval mode, and gathered whole when sharded, for the evaluation.
        warm_up (Callable[[], ContextManager]): entered around this process's first evaluation,
            whose graphs are compiled then (the run's recompile counter leaves them out).
        log_dict (Optional[Callable]): the metric logger's ``log_dict(metrics, step=...)``.
        keep_step (Optional[Callable[[int], None]]): told the step of a new best, whose checkpoint
            pruning must keep.
        log: where each evaluation's line goes (on rank 0).
        turns (Optional[TurnRunner]): multi-turn episodes with the training's environment, on
            ``generator``; None: one response per prompt.
        on_error (str): ``"stop"``: an evaluation that raises raises out of :meth:`when_due`;
            ``"skip"``: it is logged as a warning (to ``log``) and left out, on one process
            (under several it raises all the same: the others may be waiting in a collective
            the failed process left).
    """

    def __init__(self, generator: Optional[Generator],
                 prompts: Optional[Union[EvalPrompts, Sequence[EvalPrompts]]], scorer: Optional[EvalScorer],
                 record: EvalRecord, *, num_samples: int = 1, correct_threshold: float = 1.0, seed: int = 0,
                 models: Sequence[nn.Module] = (), warm_up: Callable[[], ContextManager] = contextlib.nullcontext,
                 log_dict: Optional[Callable] = None, keep_step: Optional[Callable[[int], None]] = None,
                 log=None, turns: Optional[TurnRunner] = None, on_error: str = "stop") -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"eval.on_error must be one of {list(ON_ERROR)}, got {on_error!r}.")
        self.turns, self.on_error = turns, on_error
        self.failed = 0  # evaluations left out under on_error="skip"
        if isinstance(prompts, EvalPrompts):
            prompts = [prompts]
        names = [p.name for p in prompts or ()]
        if len(names) > 1 and (None in names or len(set(names)) < len(names)):
            raise ValueError(f"Evaluator: several sets of prompts need distinct names, got {names}.")
        self.generator, self.prompts, self.scorer, self.record = generator, list(prompts or ()), scorer, record
        self.num_samples, self.correct_threshold, self.seed = num_samples, correct_threshold, seed
        self.models = list(models)
        self._warm_up, self._warmed = warm_up, False
        self._log_dict, self._keep_step, self._log = log_dict, keep_step, log
        if keep_step is not None and record.best_step:  # resumed: the best's checkpoint stays
            keep_step(record.best_step)

    def due(self, progress) -> bool:
        """An evaluation is due after ``progress.global_step`` steps (and not yet recorded)."""
        return self.record.due(progress.global_step, last_step=progress.all_steps_run)

    def when_due(self, progress) -> bool:
        """Evaluates after ``progress.global_step`` steps when due; True when that is a new best
        of a trained policy (step > 0), whose checkpoint the run then saves.

        Raises:
            Exception: what the evaluation raised, unless ``on_error`` is ``"skip"`` on one
                process (then logged, and False returned).
        """
        step = progress.global_step
        if not self.due(progress):
            return False
        start = time.perf_counter()
        try:
            metrics = self.evaluate(step)
        except Exception as e:  # noqa: BLE001 - skipped only where the config asks, else raised as it was
            if self.on_error != "skip" or distributed.world_size() > 1:
                raise
            self._skip(step, e)
            return False
        improved = self.record.add(step, metrics)
        metrics["time/eval"] = time.perf_counter() - start
        if self._log_dict is not None:
            self._log_dict(metrics, step=step)
        if self._log is not None and distributed.rank() == 0:
            shown = " | ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            self._log.info(f"step {step} | {shown}{' | new best' if improved else ''}")
            if self.record.stopped:
                self._log.info(self.record.stop_message())
        if improved and step > 0 and self._keep_step is not None:
            self._keep_step(step)
        return improved and step > 0

    def _skip(self, step: int, error: Exception) -> None:
        self.failed += 1
        if self._log is None:
            return
        when = "before step 1" if step == 0 else f"after step {step}"
        # The traceback with the first failure only: later ones are most likely the same cause.
        self._log.warning(
            f"The evaluation {when} failed ({type(error).__name__}: {error}). eval.on_error=skip: training "
            f"goes on without it (no val/ metrics at step {step}; it counts neither for the best checkpoint "
            f"nor towards eval.early_stop_patience). Evaluations failed so far: {self.failed}.",
            exc_info=(type(error), error, error.__traceback__) if self.failed == 1 else None)

    @torch.no_grad()
    def evaluate(self, step: int) -> Dict[str, float]:
        """The ``val/`` metrics of the policy now, over every process's prompts, set after set."""
        metrics: Dict[str, float] = {}
        warm_up = contextlib.nullcontext() if self._warmed else self._warm_up()
        with warm_up, eval_mode(*self.models), distributed.gathered(*self.models):
            for prompts in self.prompts:
                prefix = "val/" if prompts.name is None else f"val/{prompts.name}/"
                metrics.update({prefix + k[len("val/"):]: v for k, v in self._evaluate_set(prompts, step).items()})
        self._warmed = True
        return metrics

    def _evaluate_set(self, prompts: EvalPrompts, step: int) -> Dict[str, float]:
        rank, world = distributed.rank(), distributed.world_size()
        gen = self.generator
        rows = prompt_shard(len(prompts.prompt_lens), rank, world)
        tokens, lens = prompts.tokens[rows.start:rows.stop], prompts.prompt_lens[rows.start:rows.stop]
        tokens, lens, refs = repeat_prompts(tokens, lens, prompts.references[rows.start:rows.stop], self.num_samples)
        rng = torch.Generator(gen.device).manual_seed(eval_seed(self.seed, step, rank, prompts.name))
        scores: List[torch.Tensor] = []
        lengths: List[torch.Tensor] = []
        episodes: List[EpisodeStats] = []
        parts: Dict[str, List[torch.Tensor]] = {name: [] for name in self.scorer.parts}
        for i in range(0, len(lens), gen.batch_size):
            chunk = slice(i, i + gen.batch_size)
            p, n = tokens[chunk].to(gen.device), lens[chunk].to(gen.device)
            if self.turns is None:
                out = gen.generate(p, n, rng=rng)
                s, length, part = self.scorer(out.query_responses, n, refs[chunk])
            else:  # multi-turn episodes, the environment seeded as the evaluation's stream
                seeds = [eval_seed(self.seed, step, rank, prompts.name) + i for i in range(i, i + len(n))]
                out = self.turns.generate(p, n, rng, refs[chunk], seeds)
                s, length, part = self.scorer(out.query_responses, n, refs[chunk], episodes=out)
                episodes.append(out.stats)
            scores.append(s)
            lengths.append(length)
            for name, v in part.items():
                parts[name].append(v)
        empty = torch.zeros(0, device=gen.device)
        sums = tally(torch.cat(scores) if scores else empty, torch.cat(lengths) if lengths else empty,
                     num_samples=self.num_samples, correct_threshold=self.correct_threshold,
                     parts={k: torch.cat(v) if v else empty for k, v in parts.items()})
        metrics = eval_metrics(sum_over_processes(sums, distributed.all_reduce_sum, gen.device), self.num_samples)
        if self.turns is not None:  # val/turns/...: the episodes' turns and tool calls
            stats = EpisodeStats(*([x for e in episodes for x in getattr(e, f)] for f in EpisodeStats._fields))
            reduce = ((lambda x: distributed.all_reduce_sum(x.to(gen.device)).cpu())
                      if distributed.world_size() > 1 else None)
            metrics.update({f"val/{k}": v for k, v in stats.metrics(reduce).items()})
        return metrics


def reward_parts(reward: Union[FunctionReward, ModelReward], tokenizer) -> Dict[str, FunctionReward]:
    """The parts of a ``WeightedSum`` function reward by metric name; none for anything else."""
    fn = getattr(reward, "fn", None)
    if not isinstance(fn, WeightedSum):
        return {}
    names = part_names([getattr(f, "__name__", type(f).__name__) for f in fn.rewards])
    return {name: FunctionReward(f, tokenizer) for name, f in zip(names, fn.rewards)}


def eval_prefix_len(prompt_sets: Sequence[EvalPrompts], minimum: int = MIN_SHARED_PREFIX) -> int:
    """The prefix the evaluation's generator computes once per call (``Generator(prefix_len=...)``):
    the fewest leading tokens the prompts of one set all share, over the sets (each call holds one
    set's prompts), kept below each set's shortest prompt; 0 where that is under ``minimum``."""
    shared = []
    for p in prompt_sets:
        P, lens = p.prompt_len, p.prompt_lens.tolist()
        rows = [row[P - n:] for row, n in zip(p.tokens.tolist(), lens)]
        shared.append(min(common_prefix_len(rows), min(lens, default=0) - 1))
    c = min(shared, default=0)
    return c if c >= minimum else 0


def build_evaluator(block: DictConfig, checked: Any, rollout: Rollout, steps: GenerationSteps, record: EvalRecord,
                    *, seed: int, warm_up: Callable[[], ContextManager] = contextlib.nullcontext,
                    log_dict: Optional[Callable] = None, keep_step: Optional[Callable[[int], None]] = None,
                    share_prefix: Optional[bool] = None) -> Evaluator:
    """The run's :class:`Evaluator` from its ``eval`` block, on the rollout's policy and reward.

    Args:
        block (DictConfig): the config's ``eval`` block.
        checked (Any): the preflight's result (:class:`~torchtune_ppo.run.preflight.Preflight`):
            its ``eval_prompts`` (None when evaluation is off) and ``tokenizer``.
        rollout (Rollout): the training rollout: its policy, reward, stop tokens and penalties.
        steps (GenerationSteps): the run's prefill and decode step (compiled or eager).
        record (EvalRecord): the run's record (``Progress.evaluation``), restored on resume.
        seed (int): the run's seed.
        warm_up, log_dict, keep_step: see :class:`Evaluator`.
        share_prefix (Optional[bool]): the config's ``share_prompt_prefix``. None or True: the
            leading tokens the prompts of each set all share (:func:`eval_prefix_len`, at least
            8) are computed once per generation call; False: every row's prompt is prefilled
            whole. Not with multi-turn episodes.

    Raises:
        ValueError: naming ``eval.max_generated_tokens`` when ``P + T`` exceeds a model's
            ``max_seq_len``, or ``eval.best_metric`` when it names a part the reward does not have.
    """
    if not record.enabled:
        return Evaluator(None, None, None, record)
    prompt_sets, tokenizer, train_gen = checked.eval_prompts, checked.tokenizer, rollout.generator
    prompt_sets = [prompt_sets] if isinstance(prompt_sets, EvalPrompts) else list(prompt_sets)
    width = prompt_sets[0].prompt_len
    if any(p.prompt_len != width for p in prompt_sets):
        raise ValueError(f"the evaluation's sets of prompts must have one width, got "
                         f"{[p.prompt_len for p in prompt_sets]} (eval_prompts pads them so).")
    reward = (FunctionReward(config.instantiate(block.reward), tokenizer) if block.reward is not None
              else rollout.reward)
    parts = reward_parts(reward, tokenizer)
    prefixes = [f"val/{p.name}/" if p.name is not None else "val/" for p in prompt_sets]
    names = [f"{prefix}reward/{name}" for prefix in prefixes for name in parts]
    if "/reward/" in block.best_metric and block.best_metric not in names:
        raise ValueError(f"eval.best_metric={block.best_metric!r} is not a part of the evaluation's reward "
                         f"{getattr(reward, 'fn', reward)!r}; its parts log {names or 'nothing (not a WeightedSum)'}.")
    T = block.max_generated_tokens or train_gen.max_generated_tokens
    models = [train_gen.model] + ([reward.model] if isinstance(reward, ModelReward) else [])
    for model in models:
        limit = getattr(model, "max_seq_len", None)
        if limit is not None and width + T > limit:
            raise ValueError(
                f"the evaluation prompts' width + eval.max_generated_tokens ({width} + {T}) exceeds "
                f"the model's max_seq_len ({limit}); lower eval.max_generated_tokens, or set max_prompt_len (with "
                "long_prompts=truncate each prompt keeps its last tokens).")
    turns = rollout.turns
    # rows a call: eval.batch_size (null: the training's), at most what one process's largest set
    # holds, so that a few prompts are not padded up to a large batch of filler rows
    most = max(-(-len(p.prompt_lens) // distributed.world_size()) for p in prompt_sets) * block.num_samples
    generator = Generator(
        train_gen.model, batch_size=max(1, min(block.batch_size or train_gen.batch_size, most)), max_prompt_len=width,
        max_generated_tokens=T, pad_id=train_gen.pad_id, stop_token_ids=train_gen.stop_token_ids,
        temperature=float(block.temperature), top_k=block.top_k, top_p=block.top_p, steps=steps,
        dtype=train_gen.dtype, device=train_gen.device,
        cache_tokens=None if turns is None else max(T, train_gen.cache_tokens * T // train_gen.max_generated_tokens),
        prefix_len=eval_prefix_len(prompt_sets) if share_prefix is not False and turns is None else 0,
    )
    if turns is not None:  # the training's environment and settings, on the evaluation's generator
        turns = TurnRunner(generator, turns.env, turns.renderer, turns.tokenizer, turns.settings)
    settings = rollout.settings._replace(prompt_len=width, temperature=float(block.temperature))
    scorer = EvalScorer(reward, settings, rollout.stop_token_ids, parts)
    log = utils.get_logger("INFO")
    if block.on_error == "skip" and distributed.world_size() > 1 and distributed.rank() == 0:
        log.warning(f"eval.on_error=skip applies to one process: with {distributed.world_size()} processes an "
                    "evaluation that fails stops the run (the other processes may be waiting in a collective "
                    "the failed one left); the checkpoint due at its step is written before it.")
    return Evaluator(generator, prompt_sets, scorer, record, num_samples=block.num_samples,
                     correct_threshold=float(block.correct_threshold), seed=seed, models=models,
                     warm_up=warm_up, log_dict=log_dict, keep_step=keep_step, log=log,
                     turns=turns, on_error=block.on_error)
