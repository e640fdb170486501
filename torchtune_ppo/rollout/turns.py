"""Multi-turn episodes with an environment, token in, token out.

An episode is the policy's assistant turn (ending with a stop token), the environment's
observation, the next assistant turn, and so on until the environment says done, ``max_turns``
turns are written, or the budget runs out. Every token the policy reads is either sampled by it
or rendered once from an observation (:class:`~torchtune_ppo.envs.ObservationRenderer`) and
appended as tokens: the history is never decoded and encoded again, so the tokens trained on
are the tokens sampled.

The :class:`~torchtune_ppo.rollout.generation.Generator`'s static KV cache holds the whole
episode. All rows decode in lockstep, one cache column per step; a row that finished its turn
waits (its later columns stay closed to it, so they are gaps it never attends). When every row
has finished its turn, the rows whose environment answered get their observation written into
the cache by one :func:`extend` call of fixed width ``W = max_observation_tokens + 1`` (the
row's unfed stop token, then the observation), at their own positions, and the first token of
their next turn is sampled from the observation's last position; the other rows' chunk columns
are gaps too. Shapes never change: prefill ``[B, P]``, decode ``[B, 1]``, extend ``[B, W]``,
each against ``S = P + cache_tokens`` columns, so each region compiles once.

The output is compact, as if each row had been generated alone: ``[b, T]`` responses holding the
row's turns and observations in order, ``observation_masks`` True on the observation tokens (no
loss, KL or value loss on them; they are attended), logprobs 0 there, and ``episode_lens``. The
positions a row's tokens were generated at count its own tokens only, so scoring the compact
row gives the logprobs generation sampled them with.
"""

import contextlib
import logging
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torchtune_ppo._patches.dynamo import skip_guard_checks
from torchtune_ppo.envs import ISOLATIONS, Conversation, EnvStep, ObservationRenderer, safe_step
from torchtune_ppo.rollout.generation import Generator, extend

__all__ = ["EpisodeOutput", "EpisodeStats", "TurnSettings", "TurnRunner", "cache_tokens", "episode_texts"]

_log = logging.getLogger(__name__)


def cache_tokens(cfg) -> Optional[int]:
    """The generator's KV cache columns after the prompt for the config: ``turns.cache_tokens``,
    by default ``2 * max_generated_tokens``, with ``env``; None (``T``) without."""
    if cfg.get("env") is None:
        return None
    return cfg.turns.cache_tokens or 2 * cfg.max_generated_tokens


def episode_texts(output: "EpisodeOutput", prompt_lens: torch.Tensor, prompt_len: int
                  ) -> Tuple[List[List[int]], List[List[int]]]:
    """What a function reward scores of each episode: its prompt's real tokens and its final
    assistant turn (stop token dropped), as token lists."""
    prompts = output.query_responses[:, :prompt_len].tolist()
    return [row[prompt_len - n:] for row, n in zip(prompts, prompt_lens.tolist())], output.final_turns


class TurnSettings(NamedTuple):
    """The ``turns`` block of the config.

    Attributes:
        max_turns (int): assistant turns per episode at most; an observation after the last one
            is not written and the episode counts as truncated.
        max_observation_tokens (int): an observation's rendered tokens at most (longer ones are
            cut, counted); the extend chunk is one wider.
        timeout_s (Optional[float]): an environment step running longer ends the row's episode;
            None: the step is called directly, for as long as it takes.
        isolation (str): where a step with a timeout runs: ``"process"``, a worker process
            killed (and replaced) when a step overruns, or ``"thread"``, a worker thread that is
            abandoned instead (see :func:`~torchtune_ppo.envs.safe_step`).
        max_env_failures (Optional[int]): a PPO step whose episodes (over every process) have
            more failed environment steps (raised, timed out, bad return) stops the run
            (:meth:`TurnRunner.check_failures`); None: never, each only ends its episode.
        stop_strings (Tuple[str, ...]): a turn also ends once its text contains one of these (a
            tool call's closing tag): its tokens after the one that completes it are dropped, as
            if never sampled (checked every ``stop_check_every`` decode steps).
    """

    max_turns: int = 4
    max_observation_tokens: int = 32
    timeout_s: Optional[float] = 10.0
    isolation: str = "process"
    max_env_failures: Optional[int] = None
    stop_strings: Tuple[str, ...] = ()


class EpisodeStats(NamedTuple):
    """Per row, on the host: ``turns`` (assistant turns written), ``tool_calls`` (observations
    written), ``truncated`` (out of budget or ``max_turns`` with a call pending), ``failed``
    (the environment failed), ``observations_cut`` (observations cut to fit)."""

    turns: List[int]
    tool_calls: List[int]
    truncated: List[bool]
    failed: List[bool]
    observations_cut: List[int]

    def metrics(self, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict:
        """Means per episode (``turns/mean``, ``turns/tool_calls``, ``turns/episodes_with_tool``,
        ``turns/truncated``) and counts (``turns/env_failures``, ``turns/observations_cut``), over
        every process's rows when ``reduce`` sums a tensor over them."""
        sums = torch.tensor([float(len(self.turns)), sum(self.turns), sum(self.tool_calls),
                             sum(c > 0 for c in self.tool_calls), sum(self.truncated), sum(self.failed),
                             sum(self.observations_cut)], dtype=torch.float64)
        if reduce is not None:
            sums = reduce(sums)
        n, turns, calls, with_tool, truncated, failed, cut = sums.tolist()
        n = max(n, 1.0)
        return {"turns/mean": turns / n, "turns/tool_calls": calls / n, "turns/episodes_with_tool": with_tool / n,
                "turns/truncated": truncated / n, "turns/env_failures": failed, "turns/observations_cut": cut}


class EpisodeOutput(NamedTuple):
    """What :meth:`TurnRunner.generate` returns.

    Attributes:
        query_responses (torch.Tensor): ``[b, P + T]``: the prompt, then the episode compacted
            (turns and observations in order), ``pad_id`` after it.
        logprobs (torch.Tensor): ``[b, T]`` float32, the sampled tokens'; 0 on observation
            tokens and after the end.
        observation_masks (torch.Tensor): ``[b, T]`` bool, True on observation tokens.
        episode_lens (torch.Tensor): ``[b]`` tokens of each episode (turns and observations).
        env_scores (torch.Tensor): ``[b]`` float32, the sum of the environment's step rewards.
        stats (EpisodeStats): per row counts, on the host.
        conversations (List[Conversation]): each row's episode as text (for logs and tests).
        final_turns (List[List[int]]): each row's last assistant turn, its stop token dropped: what
            a reward function scores (the environment's step rewards score the rest).
    """

    query_responses: torch.Tensor
    logprobs: torch.Tensor
    observation_masks: torch.Tensor
    episode_lens: torch.Tensor
    env_scores: torch.Tensor
    stats: EpisodeStats
    conversations: List[Conversation]
    final_turns: List[List[int]]


class TurnRunner:
    """Runs multi-turn episodes on a :class:`Generator`'s model and cache (module docstring).

    Args:
        generator (Generator): its ``max_generated_tokens`` is ``T``, the episode's tokens at
            most; its ``cache_tokens`` (>= ``T``) the cache columns, gaps included.
        env: an :class:`~torchtune_ppo.envs.Environment`.
        renderer (ObservationRenderer): an observation's text to tokens.
        tokenizer: decodes turns and prompts for the environment.
        settings (TurnSettings): the ``turns`` block.
        seed (int): the run's seed, for :meth:`episode_seeds`.
    The extend step is the generator's (``GenerationSteps.extend``: eager, or compiled with the
    generation regions).
    """

    def __init__(self, generator: Generator, env, renderer: ObservationRenderer, tokenizer,
                 settings: TurnSettings, seed: int = 0) -> None:
        self.seed = seed
        self.gen, self.env, self.renderer, self.tokenizer = generator, env, renderer, tokenizer
        self.settings = settings
        if not isinstance(settings.max_turns, int) or settings.max_turns < 1:
            raise ValueError(f"turns.max_turns={settings.max_turns!r} is invalid; expected an int >= 1.")
        if not isinstance(settings.max_observation_tokens, int) or settings.max_observation_tokens < 1:
            raise ValueError(f"turns.max_observation_tokens={settings.max_observation_tokens!r} is invalid; "
                             "expected an int >= 1.")
        if settings.isolation not in ISOLATIONS:
            raise ValueError(f"turns.isolation={settings.isolation!r} is invalid; expected one of "
                             f"{', '.join(ISOLATIONS)}.")
        self._extend = generator._steps.extend
        self.failures, self.last_failure = 0, None  # environment steps that failed in this process
        g = generator
        B, P, T, dev = g.batch_size, g.max_prompt_len, g.max_generated_tokens, g.device
        self.S, W = P + g.cache_tokens, settings.max_observation_tokens + 1
        self.W = W
        self._stop_set = set(g.stop_token_ids)
        self._out_tokens = torch.empty(B, T, dtype=torch.long, device=dev)
        self._out_logprobs = torch.empty(B, T, dtype=torch.float32, device=dev)
        self._out_obs = torch.empty(B, T, dtype=torch.bool, device=dev)
        self._out_len = torch.empty(B, dtype=torch.long, device=dev)
        self._out_col = torch.empty(B, T, dtype=torch.long, device=dev)  # the cache column each token was fed at
        # the extend region's inputs, in buffers of fixed shapes
        self._ext_tokens = torch.empty(B, W, dtype=torch.long, device=dev)
        self._ext_pos = torch.empty(B, W, dtype=torch.long, device=dev)
        self._ext_mask = torch.empty(B, W, self.S, dtype=torch.bool, device=dev)
        self._ext_last = torch.empty(B, dtype=torch.long, device=dev)
        self._chunk = torch.arange(W, device=dev)
        self._chunk_causal = torch.tril(torch.ones(W, W, dtype=torch.bool, device=dev))
        self._eye = torch.eye(W, dtype=torch.bool, device=dev)
        self._cols = torch.arange(self.S, device=dev)
        self._t = torch.arange(T, device=dev)

    @classmethod
    def from_config(cls, cfg, generator: Generator, tokenizer, env=None) -> Optional["TurnRunner"]:
        """From the recipe config's ``env`` and ``turns`` blocks (``env``: instantiated here unless
        given), or None without ``env``. The generator must have been built with
        :func:`cache_tokens` columns."""
        from torchtune import config as tt_config

        from torchtune_ppo.envs import check_environment

        if cfg.get("env") is None and env is None:
            return None
        env = tt_config.instantiate(cfg.env) if env is None else env
        check_environment(env)
        t = cfg.turns
        renderer = ObservationRenderer(tokenizer, template=t.observation_template)
        settings = TurnSettings(max_turns=t.max_turns, max_observation_tokens=t.max_observation_tokens,
                                timeout_s=None if t.timeout_s is None else float(t.timeout_s),
                                isolation=t.get("isolation") or "process",
                                max_env_failures=t.max_env_failures,
                                stop_strings=tuple(t.get("stop_strings") or ()))
        return cls(generator, env, renderer, tokenizer, settings, seed=int(cfg.seed))

    def episode_seeds(self, step: int, rows: int) -> List[int]:
        """The environment's seed of each row of this process's batch at ``step``, from the run's
        seed: a resumed run gives each step's rows the same ones."""
        from torchtune_ppo import distributed

        base = (self.seed * 1_000_003 + step * 1_009) * 4_096 + distributed.rank() * rows
        return [(base + i) % (2**63) for i in range(rows)]

    def _record(self, token: torch.Tensor, logprob: torch.Tensor, write: torch.Tensor) -> None:
        """Appends the sampled ``token [B]`` of the rows in ``write [B]`` to their episodes."""
        T = self.gen.max_generated_tokens
        idx = self._out_len.clamp(max=T - 1)[:, None]
        self._out_tokens.scatter_(1, idx, torch.where(write, token, self._out_tokens.gather(1, idx)[:, 0])[:, None])
        self._out_logprobs.scatter_(1, idx, torch.where(write, logprob.float(),
                                                         self._out_logprobs.gather(1, idx)[:, 0])[:, None])
        self._out_len.add_(write)

    def _still_generating(self, token: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
        T = self.gen.max_generated_tokens
        return write & ~torch.isin(token, self.gen._stop_ids) & (self._out_len < T)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, prompt_lens: torch.Tensor, rng: Optional[torch.Generator],
                 references: Optional[Sequence[Optional[str]]] = None,
                 seeds: Optional[Sequence[int]] = None) -> EpisodeOutput:
        """Runs one episode per row of ``prompts [b, P]`` (``b <= batch_size``).

        ``references`` and ``seeds`` (one per row) go to the environment's
        :class:`~torchtune_ppo.envs.Conversation`; seeds default to the row index.
        """
        g, s = self.gen, self.settings
        P, T, S, W = g.max_prompt_len, g.max_generated_tokens, self.S, self.W
        b = prompts.shape[0]
        references = [None] * b if references is None else list(references)
        seeds = list(range(b)) if seeds is None else [int(x) for x in seeds]
        stats = EpisodeStats([0] * b, [0] * b, [False] * b, [False] * b, [0] * b)
        host_prompts = prompts.tolist()
        host_lens = prompt_lens.tolist()
        convs = [Conversation(self.tokenizer.decode(host_prompts[r][P - host_lens[r]:]), (), references[r], seeds[r])
                 for r in range(b)]
        env_scores = [0.0] * b
        with g.kv_cache.decoding():
            inp = g.prepare(prompts, prompt_lens, rng)
            B = g.batch_size
            self._out_tokens.fill_(g.pad_id)
            self._out_logprobs.zero_()
            self._out_obs.zero_()
            self._out_len.zero_()
            self._out_col.fill_(-1)
            decode_mask = inp.decode_mask[:, 0]  # [B, S]: the columns each row attends, opened as it goes
            n_real = inp.prompt_lens.clone()  # each row's next position
            real_rows = torch.arange(B, device=g.device) < b
            token, logprob, _ = g.first_token(rng)
            col = P  # the cache's next column
            self._record(token, logprob, real_rows)
            pending = real_rows.clone()  # rows whose latest token is not in the cache yet
            generating = self._still_generating(token, real_rows)
            alive = [True] * b  # the episode goes on after this turn
            turn_start = [0] * b
            for turn in range(s.max_turns):
                self._cut, self._unfed = set(), set()  # rows whose turn a stop string ended
                token, pending, col = self._decode_turn(token, pending, generating, n_real, decode_mask, col, rng,
                                                        turn_start, alive)
                host_len = self._out_len[:b].tolist()
                host_tokens = self._out_tokens[:b].tolist()
                host_pending = [p or r in self._unfed for r, p in enumerate(pending[:b].tolist())]
                chunks = [None] * b  # the tokens each continuing row's extend writes
                for r in range(b):
                    if not alive[r]:
                        continue
                    stats.turns[r] += 1
                    turn_tokens = host_tokens[r][turn_start[r]:host_len[r]]
                    text = self.tokenizer.decode(turn_tokens)
                    if not turn_tokens or (turn_tokens[-1] not in self._stop_set and r not in self._cut):
                        convs[r] = convs[r]._replace(turns=convs[r].turns + (("assistant", text),))
                        alive[r], stats.truncated[r] = False, True  # out of tokens or cache mid-turn
                        continue
                    step, cause = safe_step(self.env, convs[r], text, timeout_s=s.timeout_s, isolation=s.isolation)
                    convs[r] = convs[r]._replace(turns=convs[r].turns + (("assistant", text),))
                    if cause is not None:
                        self._fail(r, cause, stats)
                        alive[r] = False
                        continue
                    env_scores[r] += float(step.reward or 0.0)
                    if step.observation is None:
                        alive[r] = False  # done: this turn was the answer
                        continue
                    if turn + 1 >= s.max_turns:
                        alive[r], stats.truncated[r] = False, True
                        continue
                    obs, ids, cut = self._render(step.observation)
                    # room for the observation and at least one more policy token
                    if host_len[r] + len(ids) + 1 > T or col + W >= S:
                        alive[r], stats.truncated[r] = False, True
                        continue
                    stats.observations_cut[r] += cut
                    stats.tool_calls[r] += 1
                    convs[r] = convs[r]._replace(turns=convs[r].turns + (("tool", obs),))
                    chunks[r] = ([host_tokens[r][host_len[r] - 1]] if host_pending[r] else [], ids)
                if not any(c is not None for c in chunks):
                    break
                token, pending, generating, col = self._extend_rows(chunks, n_real, decode_mask, col, rng)
                host_len2 = self._out_len[:b].tolist()
                for r in range(b):
                    if chunks[r] is not None:
                        turn_start[r] = host_len2[r] - 1  # the next turn's first token is recorded
            lens = self._out_len[:b].clone()
            final_tokens = self._out_tokens[:b].tolist()
        final_turns = []
        for r, (row, end) in enumerate(zip(final_tokens, lens.tolist())):
            last = row[turn_start[r]:end]
            final_turns.append(last[:-1] if last and last[-1] in self._stop_set and r not in self._cut else last)
        responses = self._out_tokens[:b].clone()
        query_responses = torch.cat([prompts.to(g.device, torch.long), responses], dim=1)
        return EpisodeOutput(
            query_responses=query_responses,
            logprobs=self._out_logprobs[:b].clone(),
            observation_masks=self._out_obs[:b].clone(),
            episode_lens=lens,
            env_scores=torch.tensor(env_scores, dtype=torch.float32, device=g.device),
            stats=stats,
            conversations=convs,
            final_turns=final_turns,
        )

    def _decode_turn(self, token, pending, generating, n_real, decode_mask, col: int, rng,
                     turn_start: List[int], alive: List[bool]):
        """Decode steps until no row is generating (checked every ``stop_check_every`` steps) or
        the cache is full; returns the last token, the rows with an unfed token, the next column."""
        g = self.gen
        inp = g.inputs
        with contextlib.ExitStack() as stack:
            i = 0
            while col < self.S:
                if i % g.stop_check_every == 0:
                    if self.settings.stop_strings and i > 0:
                        pending, generating = self._stop_at_strings(pending, generating, n_real, decode_mask,
                                                                    turn_start, alive)
                    if not bool(generating.any()):
                        break
                if i == 2:  # the first steps ran the full guard check; nothing they cover changes
                    stack.enter_context(skip_guard_checks(g._steps.compiled))
                decode_mask[:, col].copy_(pending)  # the fed token's column, for rows feeding a real one
                fed = (self._out_len - 1).clamp(min=0)[:, None]
                self._out_col.scatter_(1, fed, torch.where(pending, col, self._out_col.gather(1, fed)[:, 0])[:, None])
                inp.decode_pos[:, 0].copy_(n_real)
                token, logprob, _ = g._decode(g.model, token[:, None], inp.decode_pos, inp.decode_mask,
                                              g.draw_noise(rng), **g.sampling)
                n_real.add_(pending)
                col += 1
                write = generating
                self._record(token, logprob, write)
                pending = write.clone()
                generating = self._still_generating(token, write)
                i += 1
        if self.settings.stop_strings:  # the last steps' tokens
            pending, generating = self._stop_at_strings(pending, generating, n_real, decode_mask, turn_start, alive)
        return token, pending, col

    def _stop_at_strings(self, pending, generating, n_real, decode_mask, turn_start: List[int], alive: List[bool]):
        """Ends the turn of each row whose text holds a stop string after the token that completes it
        (also a turn that went on to its stop token): the later tokens leave the episode and their
        cache columns close to the row (one sync)."""
        rows = [r for r, on in enumerate(alive) if on and r not in self._cut]
        if not rows:
            return pending, generating
        lens, tokens = self._out_len.tolist(), self._out_tokens.tolist()
        cut = {}
        for r in rows:
            turn = tokens[r][turn_start[r]:lens[r]]
            if not any(x in self.tokenizer.decode(turn) for x in self.settings.stop_strings):
                continue
            k = next(k for k in range(1, len(turn) + 1)
                     if any(x in self.tokenizer.decode(turn[:k]) for x in self.settings.stop_strings))
            cut[r] = turn_start[r] + k  # tokens kept
        if not cut:
            return pending, generating
        pending, generating = pending.clone(), generating.clone()
        cols = self._out_col.tolist()
        for r, keep in cut.items():
            dropped = [c for c in cols[r][keep:lens[r]] if c >= 0]
            if dropped:
                decode_mask[r, torch.tensor(dropped, device=decode_mask.device)] = False
            n_real[r] -= len(dropped)
            self._out_tokens[r, keep:] = self.gen.pad_id
            self._out_logprobs[r, keep:] = 0.0
            self._out_col[r, keep:] = -1
            self._out_len[r] = keep
            generating[r] = pending[r] = False
            self._cut.add(r)
            if cols[r][keep - 1] < 0:  # its last kept token is not in the cache yet: the extend feeds it
                self._unfed.add(r)
        return pending, generating

    def _render(self, observation: str) -> Tuple[str, List[int], int]:
        """The observation's tokens, the text cut (from its end) until they fit; 1 if cut."""
        limit = self.settings.max_observation_tokens
        # 256 characters is a generous bound on the text one token covers, so no more of the text
        # than limit times that can be kept: cut there first, so that a huge observation (megabytes
        # of a tool's output) is never tokenized whole. A text within the bound is read as before;
        # a token longer than the bound would only make a huge observation cut shorter.
        bound = limit * 256
        cut = int(len(observation) > bound)
        observation = observation[:bound]
        ids = self.renderer.tokens(observation)
        while len(ids) > limit and observation:
            cut = 1
            observation = observation[: len(observation) * 3 // 4]
            ids = self.renderer.tokens(observation)
        if len(ids) > limit:
            raise ValueError(f"turns.max_observation_tokens={limit}: the observation template alone takes "
                             f"{len(ids)} tokens; raise it.")
        return observation, ids, cut

    def _fail(self, r: int, cause: str, stats: EpisodeStats) -> None:
        stats.failed[r] = True
        self.failures += 1
        self.last_failure = cause
        _log.warning(f"environment step failed, episode ended (row {r}): {cause}")

    def check_failures(self, failed: float) -> None:
        """Raises once more than ``max_env_failures`` environment steps failed in one PPO step's
        episodes (``failed``: over every process, the same on each, so every rank stops)."""
        limit = self.settings.max_env_failures
        if limit is not None and failed > limit:
            raise RuntimeError(f"{int(failed)} environment steps failed in this step's episodes, more than "
                               f"turns.max_env_failures={limit}; the last here: {self.last_failure}")

    def _extend_rows(self, chunks, n_real, decode_mask, col: int, rng):
        """One :func:`extend` call writing each continuing row's chunk (its unfed stop token, then
        its observation) at columns ``[col, col + W)``; samples each such row's next token."""
        g, W, B = self.gen, self.W, self.gen.batch_size
        dev = g.device
        tokens = [[g.pad_id] * W for _ in range(B)]
        obs_tokens = [[g.pad_id] * W for _ in range(B)]
        m, n_obs = [0] * B, [0] * B
        for r, chunk in enumerate(chunks):
            if chunk is None:
                continue
            fed, ids = chunk
            row = fed + ids
            tokens[r][: len(row)] = row
            obs_tokens[r][: len(ids)] = ids
            m[r], n_obs[r] = len(row), len(ids)
        host = torch.tensor([*tokens, *obs_tokens], dtype=torch.long)
        counts = torch.tensor([m, n_obs], dtype=torch.long)
        host, counts = host.to(dev), counts.to(dev)
        m_dev, n_obs_dev = counts[0], counts[1]
        self._ext_tokens.copy_(host[:B])
        in_chunk = self._chunk[None, :] < m_dev[:, None]  # [B, W]
        # history columns for chunk tokens, the chunk causally within itself, filler sees itself only
        torch.logical_and(decode_mask[:, None, :], in_chunk[:, :, None], out=self._ext_mask)
        inner = self._chunk_causal[None] & in_chunk[:, None, :] & in_chunk[:, :, None]
        self._ext_mask[:, :, col:col + W] = inner | self._eye[None]
        torch.add(n_real[:, None], self._chunk[None, :], out=self._ext_pos)
        self._ext_pos.mul_(in_chunk)
        torch.clamp(m_dev - 1, min=0, out=self._ext_last)
        with g.kv_cache.chunk_attention():
            token, logprob, _ = self._extend(g.model, self._ext_tokens, self._ext_pos, self._ext_mask,
                                             self._ext_last, g.draw_noise(rng), **g.sampling)
        decode_mask[:, col:col + W] = in_chunk
        n_real.add_(m_dev)
        col += W
        # the observation tokens into the episodes: no logprob, marked
        T = g.max_generated_tokens
        idx = (self._out_len[:, None] + self._chunk[None, :]).clamp(max=T - 1)  # [B, W]
        is_obs = self._chunk[None, :] < n_obs_dev[:, None]
        self._out_tokens.scatter_(1, idx, torch.where(is_obs, host[B:], self._out_tokens.gather(1, idx)))
        self._out_obs.scatter_(1, idx, is_obs | self._out_obs.gather(1, idx))
        self._out_logprobs.scatter_(1, idx, torch.where(is_obs, 0.0, self._out_logprobs.gather(1, idx)))
        self._out_len.add_(n_obs_dev)
        extending = m_dev > 0
        self._record(token, logprob, extending)
        pending = extending.clone()
        generating = self._still_generating(token, extending)
        return token, pending, generating, col
