"""Steps 1-6 of a PPO step: generate responses, then score them into a :class:`Trajectory`.

:class:`Rollout` is what the recipe calls. By default it runs the split rollout:
:meth:`Generator.generate` (compiled prefill + decode step, early stop), then, for a function
reward, the function on the decoded texts (eager, phase "reward"), then the scoring on real
tokens only (:func:`~torchtune_ppo.rollout.scoring.packed_score_trajectory`, one compiled
region when ``compile.trajectory`` is on): each chunk's prompt lengths and valid response
lengths are read to the host in one sync (the generation has synced already), its sequences
packed into rows, and the results gathered back into the padded :class:`Trajectory`. A
generator that prefills once per group (``group_size = n`` > 1) has whole groups in every
chunk, and the scoring then packs each group's prompt once per row before its responses
(:mod:`torchtune_ppo.rollout.scoring`).

With ``compile.rollout`` it runs the experimental fused region instead
(:func:`~torchtune_ppo.rollout.fused.fused_rollout`: generation unrolled and padded scoring
traced as one graph, no early stop, no packing).

Under FSDP the rollout gathers what its forwards need: the policy whole while it generates
(each decode step would otherwise all-gather every layer), the scoring models whole while a
compiled scoring region runs (one graph cannot cross FSDP's hooks), and frees what eager
scoring left gathered. With one process that is all a no-op.
"""

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from torchtune_ppo import distributed
from torchtune_ppo.rewards.functions import FunctionReward
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rlhf import ScoringSettings, Trajectory, concat_trajectories, truncate_after_stop_token
from torchtune_ppo.rlhf.packing import logprob_chunks, prefix_row_len, prompt_prefix, shared_row_len
from torchtune_ppo.rlhf.segments import check_segment_models
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.rollout.scoring import PackedScoring, packed_score_trajectory, plan_scoring
from torchtune_ppo.rollout.speculative import Speculation, real_prompts
from torchtune_ppo.rollout.turns import EpisodeOutput, EpisodeStats, TurnRunner, episode_texts


class Rollout:
    """Steps 1-6 for a batch of prompts, in chunks of the generator's ``batch_size``.

    Args:
        generator (Generator): the policy's generator.
        ref_policy_model (nn.Module): frozen reference policy.
        value_model (Optional[nn.Module]): value model, a ``[D, 1]`` output layer; None for a
            critic-free run.
        reward (Union[ModelReward, FunctionReward]): a reward model, scored in the graph, or a
            function of the decoded texts.
        stop_token_ids (torch.Tensor): ``[n_stop]`` on the models' device.
        settings (ScoringSettings): the scoring's scalars; ``prompt_len`` and ``temperature``
            must be the generator's.
        score (Callable): steps 2-6 on packed rows, eager or compiled (``regions.score`` of
            :func:`torchtune_ppo.compile.regions`).
        fused_rollout (Optional[Callable]): steps 1-6 as one region, instead of generation then
            ``score`` (``compile.rollout``); None: off.
        whole_scoring_models (bool): the scoring runs as one graph, which cannot cross FSDP's
            hooks: sharded scoring models are gathered whole around it.
        reference (Optional[Callable[[], ContextManager]]): entered around each scoring call, to
            make ``ref_policy_model`` the reference: for a LoRA policy that is the policy itself
            and this switches its adapters off (:func:`torchtune_ppo.lora.adapters_off`).
            Outside any compiled region, so each region always sees the adapters one way.
        recompute_logprobs (bool): the scoring also runs the policy's forward, and its logprobs
            of the sampled tokens are the trajectory's ``logprobs`` (PPO's old ones); the
            generator's go to ``rollout_logprobs`` (``rollout_correction``). Not with a LoRA
            policy's ``reference`` (the scoring runs with its adapters off) or ``fused_rollout``.
        turns (Optional[TurnRunner]): multi-turn episodes with an environment
            (:mod:`torchtune_ppo.rollout.turns`) instead of one response per prompt: each row is
            scored whole, observation tokens masked out of everything but attention, and the
            environment's step rewards added to its score. Not with ``fused_rollout``.
        share_prefix (bool): without groups, the tokens every prompt of a scoring chunk begins
            with are packed once per row (:func:`~torchtune_ppo.rollout.scoring.plan_scoring`'s
            ``common_prefix``; ``share_prompt_prefix``). Ignored with groups or ``fused_rollout``.
        segment_attention (bool): the scoring's packed rows attend by sequence
            (:mod:`~torchtune_ppo.rlhf.segments`; ``segment_attention``); every scoring model
            must take layouts (:func:`~torchtune_ppo._patches.torchtune_modules.use_segment_attention`).
            Ignored with ``fused_rollout`` (padded rows).
        speculation (Optional[Speculation]): position-keyed noise and drafts
            (:mod:`~torchtune_ppo.rollout.speculative`); the generator needs ``draft_tokens`` > 0
            for drafts to be checked. Not with ``turns`` or ``fused_rollout``.
    """

    def __init__(
        self,
        generator: Generator,
        ref_policy_model: nn.Module,
        value_model: Optional[nn.Module],
        reward: Union[ModelReward, FunctionReward],
        stop_token_ids: torch.Tensor,
        settings: ScoringSettings,
        *,
        score: Callable = packed_score_trajectory,
        fused_rollout: Optional[Callable] = None,
        whole_scoring_models: bool = False,
        reference: Optional[Callable[[], ContextManager]] = None,
        recompute_logprobs: bool = False,
        turns: Optional[TurnRunner] = None,
        share_prefix: bool = False,
        segment_attention: bool = False,
        speculation: Optional[Speculation] = None,
    ) -> None:
        if not isinstance(reward, (ModelReward, FunctionReward)):
            raise TypeError(f"Rollout: reward must be a ModelReward or a FunctionReward, got {type(reward).__name__}.")
        if (settings.prompt_len, settings.temperature) != (generator.max_prompt_len, generator.sampling["temperature"]):
            raise ValueError(f"Rollout: settings {settings} disagree with the generator's prompt length "
                             f"{generator.max_prompt_len} and temperature {generator.sampling['temperature']}.")
        self.generator = generator
        self.ref_policy_model, self.value_model = ref_policy_model, value_model
        self.reward, self.stop_token_ids, self.settings = reward, stop_token_ids, settings
        self._score, self._fused = score, fused_rollout
        if reference is not None and self._fused is not None:
            raise ValueError("compile.rollout traces generation (adapters on) and the reference "
                             "(adapters off) into one region; with a LoRA policy use compile.generate "
                             "and compile.trajectory instead.")
        if recompute_logprobs and (reference is not None or self._fused is not None):
            raise ValueError("recompute_logprobs: the policy's forward would run inside the scoring with a LoRA "
                             "policy's adapters off, or not at all in the fused region.")
        if turns is not None and self._fused is not None:
            raise ValueError("compile.rollout unrolls a single-turn generation; multi-turn episodes (env) run "
                             "with compile.generate and compile.trajectory instead.")
        if speculation is not None and (turns is not None or self._fused is not None):
            raise ValueError("speculative rollouts run in the single-turn generator: not with multi-turn episodes "
                             "(env) or compile.rollout.")
        self.speculation = speculation
        self.recompute_logprobs = recompute_logprobs
        self.turns = turns
        # the last call's extra metrics: turns/* with an environment, spec/* with speculation
        self.episode_metrics: Dict[str, float] = {}
        self._reference = reference or contextlib.nullcontext
        self._compiled_scoring = whole_scoring_models
        scoring = (ref_policy_model, value_model, self._reward_model, generator.model if recompute_logprobs else None)
        self._scoring_models = [m for m in scoring if m is not None]
        check_segment_models("Rollout", segment_attention, dict(zip(("reference", "value", "reward", "policy"),
                                                                    scoring)))
        self._segments = segment_attention
        self._num_chunks = logprob_chunks(generator.batch_size * generator.max_generated_tokens)
        # one prompt copy per row for a group's responses, in rows the scoring models can take
        self._group_size = max(1, generator.group_size)
        limits = [getattr(m, "max_seq_len", None) for m in self._scoring_models]
        max_seq_len = min((x for x in limits if isinstance(x, int)), default=None)
        self._share_prefix = share_prefix and self._group_size == 1  # or one copy of the prefix all prompts share
        self._row_len = (prefix_row_len(settings.prompt_len, generator.max_generated_tokens, max_seq_len)
                         if self._share_prefix else
                         shared_row_len(settings.prompt_len, generator.max_generated_tokens, self._group_size,
                                        max_seq_len))

    @property
    def _reward_model(self) -> Optional[nn.Module]:
        return self.reward.model if isinstance(self.reward, ModelReward) else None

    def __call__(
        self,
        prompts: torch.Tensor,
        prompt_lens: torch.Tensor,
        rng: Optional[torch.Generator],
        timer,
        references: Optional[Sequence[Optional[str]]] = None,
        seeds: Optional[Sequence[int]] = None,
        step: int = 0,
    ) -> Trajectory:
        """Generates and scores ``prompts [b, P]`` of real lengths ``prompt_lens [b]``.

        ``timer(phase)`` is a context manager timing each phase ("generate", "reward" for a
        function reward, "score"); the fused region is timed as "generate".
        ``references`` (one per row, or None) go to a function reward, and with ``turns`` to the
        environment with ``seeds`` (one per row; None: ``turns.episode_seeds(step, rows)``).
        """
        n = self.generator.batch_size
        chunks = list(zip(prompts.split(n), prompt_lens.split(n)))
        scoring_whole = (distributed.gathered(*self._scoring_models) if self._compiled_scoring
                         else contextlib.nullcontext())
        if self._fused is not None:
            with timer("generate"), torch.no_grad(), distributed.gathered(self.generator.model), scoring_whole:
                trajectories = [self._fused_chunk(p, lens, rng) for p, lens in chunks]
        else:
            with timer("generate"), distributed.gathered(self.generator.model):
                if self.speculation is not None:
                    outputs = self._speculative(prompts, prompt_lens, rng, step)
                elif self.turns is None:
                    outputs = [self.generator.generate(p, lens, rng=rng) for p, lens in chunks]
                else:
                    seeds = self.turns.episode_seeds(step, len(prompt_lens)) if seeds is None else seeds
                    outputs = self._episodes(chunks, rng, references, seeds)
            scores = [None] * len(outputs)
            if isinstance(self.reward, FunctionReward):
                with timer("reward"):
                    scores = self._function_scores(outputs, prompt_lens, references)
            with timer("score"), torch.no_grad(), scoring_whole, self._reference():
                plans = self._plans(outputs, [lens for _, lens in chunks])
                trajectories = [self._score_chunk(out, lens, chunk_scores, plan)
                                for out, (_, lens), chunk_scores, plan in zip(outputs, chunks, scores, plans)]
        distributed.reshard(*self._scoring_models)  # what eager scoring's forwards left gathered
        return concat_trajectories(trajectories)

    def _speculative(self, prompts: torch.Tensor, prompt_lens: torch.Tensor, rng, step: int) -> list:
        """Each chunk generated with position-keyed noise and the store's drafts; the responses
        then become the drafts of the prompts' next visit."""
        gen, spec, n = self.generator, self.speculation, self.generator.batch_size
        keys, ids = spec.keys(prompts, prompt_lens, step)
        real = real_prompts(prompts, prompt_lens) if spec.draft == "drafter" else None
        drafts = spec.drafts(ids, real, vocab_size=getattr(getattr(gen.model, "tok_embeddings", None),
                                                           "num_embeddings", None))
        gen.spec_stats.reset()
        outputs = []
        for start in range(0, len(prompt_lens), n):
            end = start + n
            out = gen.generate(prompts[start:end], prompt_lens[start:end], rng=rng, noise_keys=keys[start:end],
                               drafts=None if drafts is None or not gen.draft_tokens else drafts[start:end],
                               prompt_lookup=spec.draft == "ngram")
            spec.record(ids[start:end], out.query_responses[:, self.settings.prompt_len:], self._valid_counts(out),
                        None if real is None else real[start:end])
            outputs.append(out)
        self.episode_metrics = gen.spec_stats.metrics()
        return outputs

    def _episodes(self, chunks, rng, references, seeds) -> List[EpisodeOutput]:
        """Multi-turn episodes of every chunk, and their metrics in ``episode_metrics``."""
        n, outputs = self.generator.batch_size, []
        for i, (p, lens) in enumerate(chunks):
            refs = None if references is None else list(references[i * n: i * n + len(p)])
            row_seeds = None if seeds is None else list(seeds[i * n: i * n + len(p)])
            outputs.append(self.turns.generate(p, lens, rng, refs, row_seeds))
        stats = EpisodeStats(*([x for out in outputs for x in getattr(out.stats, f)] for f in EpisodeStats._fields))
        device = self.generator.device
        reduce = (lambda x: distributed.all_reduce_sum(x.to(device)).cpu()) if distributed.world_size() > 1 else None
        self.episode_metrics = stats.metrics(reduce)
        self.turns.check_failures(self.episode_metrics["turns/env_failures"])  # turns.max_env_failures
        self.last_episodes = outputs
        return outputs

    def _valid_counts(self, output) -> torch.Tensor:
        """Tokens per row ``[b]`` the scoring packs: valid response tokens, stop token included,
        or a multi-turn episode's tokens."""
        if isinstance(output, EpisodeOutput):
            return output.episode_lens
        padding, _ = truncate_after_stop_token(
            output.query_responses[:, self.settings.prompt_len:], self.stop_token_ids, self.settings.pad_id
        )
        return (~padding).sum(-1)

    def _function_scores(self, outputs, prompt_lens: torch.Tensor,
                         references: Optional[Sequence[Optional[str]]]) -> List[torch.Tensor]:
        """Scores ``[b]`` per chunk from the function reward, on the generated (truncated) texts."""
        n, P = self.generator.batch_size, self.settings.prompt_len
        references = [None] * len(prompt_lens) if references is None else list(references)
        if self.turns is not None:  # an episode's reward reads its final assistant turn
            return [self.reward(*episode_texts(out, prompt_lens[i * n: (i + 1) * n], P),
                                references[i * n: (i + 1) * n], device=out.query_responses.device)
                    for i, out in enumerate(outputs)]
        return [
            self.reward.score_batch(
                out.query_responses, prompt_lens[i * n : (i + 1) * n], self._valid_counts(out),
                references[i * n : (i + 1) * n], prompt_len=P, stop_token_ids=self.stop_token_ids,
            )
            for i, out in enumerate(outputs)
        ]

    def _score_chunk(self, output, prompt_lens: torch.Tensor, scores: Optional[torch.Tensor],
                     plan: PackedScoring) -> Trajectory:
        """Scores one chunk packed along ``plan``: the reward model in the graph, or given scores."""
        query_responses, logprobs = output.query_responses, output.logprobs
        episodes = {}
        if isinstance(output, EpisodeOutput):
            episodes = dict(episode_lens=output.episode_lens, observation_masks=output.observation_masks)
        trajectory = self._score(
            query_responses, prompt_lens.to(query_responses.device),
            None if self.recompute_logprobs else logprobs, self.generator.model if self.recompute_logprobs else None,
            self.ref_policy_model, self.value_model, self._reward_model, self.stop_token_ids,
            plan, self.settings, scores=scores, **episodes,
        )
        if isinstance(output, EpisodeOutput):  # the environment's step rewards
            trajectory = trajectory._replace(scores=trajectory.scores + output.env_scores)
        if not self.recompute_logprobs:
            return trajectory
        # the trainer's own logprobs of the sampled tokens are the old ones; the generator's stay beside
        return trajectory._replace(rollout_logprobs=logprobs.float() * ~trajectory.response_padding_masks)

    def _plans(self, outputs, prompt_lens: List[torch.Tensor]) -> List[PackedScoring]:
        """Each chunk's packing, from its prompt lengths and valid response lengths (one sync)."""
        P, T = self.settings.prompt_len, self.generator.max_generated_tokens
        device = outputs[0].query_responses.device
        lengths = [torch.stack([lens.to(device, torch.long), self._valid_counts(out)])
                   for out, lens in zip(outputs, prompt_lens)]
        host = torch.cat(lengths, dim=1).tolist()  # [2, rows of every chunk]
        plans, start = [], 0
        for lens in prompt_lens:
            end = start + len(lens)
            prefix = (prompt_prefix(outputs[len(plans)].query_responses, host[0][start:end], P)
                      if self._share_prefix else None)
            plan = plan_scoring(host[0][start:end], host[1][start:end], prompt_len=P, response_len=T,
                                num_chunks=self._num_chunks, device=device, group_size=self._group_size,
                                row_len=self._row_len if self._group_size > 1 or self._share_prefix else None,
                                common_prefix=prefix, segment_attention=self._segments)
            plans.append(plan.mark_dynamic(length=self._share_prefix))  # eager scoring ignores the marks
            start = end
        return plans

    def _fused_chunk(self, prompts: torch.Tensor, prompt_lens: torch.Tensor,
                     rng: Optional[torch.Generator]) -> Trajectory:
        gen = self.generator
        if prompts.shape[0] != gen.batch_size:
            raise ValueError(f"compile.rollout needs full chunks of {gen.batch_size} prompts, "
                             f"got {prompts.shape[0]}.")
        with gen.kv_cache.decoding():
            inputs = gen.prepare(prompts, prompt_lens, rng)
            return self._fused(
                gen, gen.draw_noise(rng, steps=gen.max_generated_tokens), inputs.prompt_lens,
                self.ref_policy_model, self.value_model, self.reward, self.stop_token_ids, self.settings,
            )
