"""Steps 1-6 of a PPO step: generate responses, then score them into a :class:`Trajectory`.

:class:`Rollout` is what the recipe calls; it picks one of two implementations:

- split (default): :meth:`Generator.generate` (compiled prefill + decode step, early stop),
  then, for a function reward, the function on the decoded texts (eager, phase "reward"), then
  the scoring (one compiled region when ``compile.trajectory`` is on). The scoring runs on
  real tokens only (:func:`~torchtune_ppo.packed_score_trajectory`): each
  chunk's prompt lengths and valid response lengths are read to the host in one sync (the
  generation has synced already), its sequences packed into rows, and the results gathered
  back into the padded :class:`Trajectory`. That covers a reward model wrapped in
  :class:`~torchtune_ppo.rollout.trajectory.ModelReward` and a function reward; any other
  :data:`RewardFn` callable sees padded rows, so it is scored by the padded
  :func:`score_trajectory`, as is everything when ``packed_scoring`` is off;
- fused (``compile.rollout``): :func:`fused_rollout`, the generation unrolled into
  straight-line code by :func:`generate_unrolled` and the padded scoring, as one compiled
  region (the RFC's option 2). No early stop: every row runs all ``T`` steps; no packing
  either, which needs the lengths on the host, mid-region.
"""

import contextlib
from typing import Callable, ContextManager, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from torchtune_ppo.ppo import rlhf
from torchtune_ppo.compile import maybe_compile
from torchtune_ppo.rollout.generation import Generator, generate_next_token, prefill
from torchtune_ppo.rollout.scoring import (
    PackedScoring, mark_dynamic, packed_score_trajectory, plan_scoring, scoring_chunks,
)
from torchtune_ppo.rewards import FunctionReward
from torchtune_ppo.rollout.trajectory import ModelReward, RewardFn, Trajectory, score_trajectory


def generate_unrolled(
    generator: Generator, noise: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill and every decode step as straight-line code with no early exit, for tracing.

    Call inside ``generator.kv_cache.decoding()`` after ``generator.prepare(...)`` with a full
    batch of ``batch_size`` prompts.

    Args:
        generator (Generator): holds the model, its prepared inputs and sampling settings.
        noise (Optional[torch.Tensor]): ``[T, B, W]`` Exponential(1) draws from
            ``generator.draw_noise(rng, steps=T)``; None when greedy.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``query_responses [B, P + T]`` (tokens after a
        stop token are kept, not padded) and ``logprobs [B, T]``.
    """
    inp, sampling = generator.inputs, generator.sampling
    P, T = generator.max_prompt_len, generator.max_generated_tokens
    cols = torch.arange(P + T, device=inp.tokens.device)
    token, logprob, _ = prefill(
        generator.model, inp.tokens, inp.prefill_pos, inp.prefill_mask,
        None if noise is None else noise[0], **sampling,
    )
    tokens, logprobs = [token], [logprob]
    for i in range(1, T):
        response_cols = (cols >= P) & (cols < P + i)  # [S]: the i tokens fed so far
        token, logprob, _ = generate_next_token(
            generator.model, token[:, None], inp.decode_pos + (i - 1), inp.decode_mask | response_cols,
            None if noise is None else noise[i], **sampling,
        )
        tokens.append(token)
        logprobs.append(logprob)
    query_responses = torch.cat([inp.tokens, torch.stack(tokens, dim=1)], dim=1)
    return query_responses, torch.stack(logprobs, dim=1)


def fused_rollout(
    generator: Generator,
    noise: Optional[torch.Tensor],
    prompt_lens: torch.Tensor,
    ref_policy_model: nn.Module,
    value_model: nn.Module,
    reward_fn: RewardFn,
    stop_token_ids: torch.Tensor,
    *,
    pad_id: int,
    penalise_no_eos: bool,
    min_response_length: Optional[int],
    reward_penalty: float,
) -> Trajectory:
    """Steps 1-6 as one function: :func:`generate_unrolled`, then :func:`score_trajectory`.

    Call as :func:`generate_unrolled`; ``prompt_lens`` ``[B]`` are those given to ``prepare``.
    The other arguments are :func:`score_trajectory`'s.
    """
    query_responses, logprobs = generate_unrolled(generator, noise)
    return score_trajectory(
        query_responses, prompt_lens, logprobs, None, ref_policy_model, value_model, reward_fn,
        stop_token_ids, prompt_len=generator.max_prompt_len, pad_id=pad_id,
        temperature=generator.sampling["temperature"],
        penalise_no_eos=penalise_no_eos, min_response_length=min_response_length,
        reward_penalty=reward_penalty,
    )


class Rollout:
    """Steps 1-6 for a batch of prompts, in chunks of the generator's ``batch_size``.

    Args:
        generator (Generator): the policy's generator.
        ref_policy_model (nn.Module): frozen reference policy.
        value_model (nn.Module): value model returning ``[b, S, 1]``.
        reward_fn (Union[RewardFn, FunctionReward]): a reward model in the graph (e.g.
            :class:`~torchtune_ppo.rollout.trajectory.ModelReward`), or a function of the decoded texts.
        stop_token_ids (torch.Tensor): ``[n_stop]`` on the models' device.
        pad_id (int): written after each row's first stop token.
        penalise_no_eos (bool): see :func:`score_trajectory`.
        min_response_length (Optional[int]): see :func:`score_trajectory`.
        reward_penalty (float): see :func:`score_trajectory`.
        compile_trajectory (bool): compile the scoring (split implementation): packed, one
            graph dynamic in the packed rows and reads; padded, one static graph.
        fused (bool): use :func:`fused_rollout`, compiled as one region.
        packed_scoring (bool): score on packed real tokens (split implementation, with a
            :class:`~torchtune_ppo.rollout.trajectory.ModelReward` or a function reward); False: the
            padded :func:`score_trajectory`, the reference the packed scoring is tested against.
        generation_context (Callable[[], ContextManager]): entered around generation (under
            FSDP: the policy gathered whole), ``scoring_context`` around scoring (the scoring
            models gathered whole for a compiled scoring region); both around the fused region.
    """

    def __init__(
        self,
        generator: Generator,
        ref_policy_model: nn.Module,
        value_model: nn.Module,
        reward_fn: Union[RewardFn, FunctionReward],
        stop_token_ids: torch.Tensor,
        *,
        pad_id: int,
        penalise_no_eos: bool,
        min_response_length: Optional[int],
        reward_penalty: float,
        compile_trajectory: bool,
        fused: bool,
        packed_scoring: bool = True,
        generation_context: Callable[[], ContextManager] = contextlib.nullcontext,
        scoring_context: Callable[[], ContextManager] = contextlib.nullcontext,
    ) -> None:
        if fused and isinstance(reward_fn, FunctionReward):
            raise ValueError("compile.rollout traces the reward into one region with generation; "
                             "a function reward runs eagerly, so use compile.generate and "
                             "compile.trajectory instead.")
        self.generator = generator
        self.ref_policy_model, self.value_model = ref_policy_model, value_model
        self.reward_fn, self.stop_token_ids = reward_fn, stop_token_ids
        self.pad_id, self.penalise_no_eos = pad_id, penalise_no_eos
        self.min_response_length, self.reward_penalty = min_response_length, float(reward_penalty)
        self.fused = fused
        self._generation_context, self._scoring_context = generation_context, scoring_context
        self.compile_trajectory = compile_trajectory
        # Packed when the reward reads only each row's last valid token (a classifier), or
        # comes from outside; a custom RewardFn is handed padded rows.
        self.packed = packed_scoring and not fused and isinstance(reward_fn, (ModelReward, FunctionReward))
        if self.packed:
            self._num_chunks = scoring_chunks(generator.batch_size, generator.max_generated_tokens)
            self._score = maybe_compile(packed_score_trajectory, enabled=compile_trajectory)
        else:
            self._score = maybe_compile(score_trajectory, enabled=compile_trajectory)
        self._fused = maybe_compile(fused_rollout, enabled=fused)

    def __call__(
        self,
        prompts: torch.Tensor,
        prompt_lens: torch.Tensor,
        rng: Optional[torch.Generator],
        timer: Callable,
        references: Optional[Sequence[Optional[str]]] = None,
    ) -> Trajectory:
        """Generates and scores ``prompts [b, P]`` of real lengths ``prompt_lens [b]``.

        ``timer(phase)`` is a context manager timing each phase ("generate", "reward" for a
        function reward, "score"); the fused implementation times all of it as "generate".
        ``references`` (one per row, or None) go to a function reward.
        """
        n = self.generator.batch_size
        chunks = list(zip(prompts.split(n), prompt_lens.split(n)))
        if self.fused:
            with timer("generate"), torch.no_grad(), self._generation_context(), self._scoring_context():
                trajectories = [self._fused_chunk(p, lens, rng) for p, lens in chunks]
        else:
            with timer("generate"), self._generation_context():
                outputs = [self.generator.generate(p, lens, rng=rng) for p, lens in chunks]
            scores = [None] * len(outputs)
            if isinstance(self.reward_fn, FunctionReward):
                with timer("reward"):
                    scores = self._function_scores(outputs, prompt_lens, references)
            with timer("score"), torch.no_grad(), self._scoring_context():
                plans = (self._plans(outputs, [lens for _, lens in chunks]) if self.packed
                         else [None] * len(outputs))
                trajectories = [self._score_chunk(out.query_responses, lens, out.logprobs, chunk_scores, plan)
                                for out, (_, lens), chunk_scores, plan in zip(outputs, chunks, scores, plans)]
        return Trajectory(*map(torch.cat, zip(*trajectories)))

    def _function_scores(self, outputs, prompt_lens: torch.Tensor,
                         references: Optional[Sequence[Optional[str]]]) -> List[torch.Tensor]:
        """Scores ``[b]`` per chunk from the function reward, on the generated (truncated) texts."""
        n, P = self.generator.batch_size, self.generator.max_prompt_len
        references = [None] * len(prompt_lens) if references is None else list(references)
        scores = []
        for i, out in enumerate(outputs):
            padding, _ = rlhf.truncate_after_stop_token(
                out.query_responses[:, P:], self.stop_token_ids, self.pad_id
            )
            scores.append(self.reward_fn.score_batch(
                out.query_responses, prompt_lens[i * n : (i + 1) * n], (~padding).sum(-1),
                references[i * n : (i + 1) * n], prompt_len=P, stop_token_ids=self.stop_token_ids,
            ))
        return scores

    def _score_chunk(self, query_responses: torch.Tensor, prompt_lens: torch.Tensor,
                     logprobs: torch.Tensor, scores: Optional[torch.Tensor],
                     plan: Optional[PackedScoring]) -> Trajectory:
        """Scores one chunk: packed along ``plan``, or padded when it is None."""
        if plan is None:  # score_trajectory: the reward callable in the graph, or given scores
            reward = None if isinstance(self.reward_fn, FunctionReward) else self.reward_fn
        else:  # packed_score_trajectory: the reward model itself, or given scores
            reward = self.reward_fn.model if isinstance(self.reward_fn, ModelReward) else None
        return self._score(
            query_responses,
            prompt_lens.to(query_responses.device),
            logprobs,
            None,
            self.ref_policy_model,
            self.value_model,
            reward,
            self.stop_token_ids,
            *(plan or ()),
            prompt_len=self.generator.max_prompt_len,
            pad_id=self.pad_id,
            temperature=self.generator.sampling["temperature"],
            penalise_no_eos=self.penalise_no_eos,
            min_response_length=self.min_response_length,
            reward_penalty=self.reward_penalty,
            scores=scores,
        )

    def _plans(self, outputs, prompt_lens: List[torch.Tensor]) -> List[PackedScoring]:
        """Each chunk's packing, from its prompt lengths and valid response lengths (one sync)."""
        P, T = self.generator.max_prompt_len, self.generator.max_generated_tokens
        device = outputs[0].query_responses.device
        lengths = []
        for out, lens in zip(outputs, prompt_lens):
            padding, _ = rlhf.truncate_after_stop_token(
                out.query_responses[:, P:], self.stop_token_ids, self.pad_id
            )
            lengths.append(torch.stack([lens.to(device, torch.long), (~padding).sum(-1)]))
        host = torch.cat(lengths, dim=1).tolist()  # [2, rows of every chunk]
        plans, start = [], 0
        for lens in prompt_lens:
            end = start + len(lens)
            plan = plan_scoring(
                host[0][start:end], host[1][start:end], prompt_len=P, response_len=T,
                num_chunks=self._num_chunks, device=device,
            )
            plans.append(mark_dynamic(plan) if self.compile_trajectory else plan)
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
                gen,
                gen.draw_noise(rng, steps=gen.max_generated_tokens),
                inputs.prompt_lens,
                self.ref_policy_model,
                self.value_model,
                self.reward_fn,
                self.stop_token_ids,
                pad_id=self.pad_id,
                penalise_no_eos=self.penalise_no_eos,
                min_response_length=self.min_response_length,
                reward_penalty=self.reward_penalty,
            )

