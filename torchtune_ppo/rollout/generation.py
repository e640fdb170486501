"""KV-cached batched generation with a compiled prefill and a compiled decode step.

gpt-fast style: :func:`prefill` and :func:`generate_next_token` are plain functions that
sample inside the step (no host sync); :class:`Generator` runs them as it is given them
(:class:`GenerationSteps`: eager, or compiled by :func:`torchtune_ppo.compile.generation_steps`
at the top of a run). Every shape is fixed by ``batch_size``,
``max_prompt_len`` and ``max_generated_tokens``; the KV cache, masks and positions live in
buffers allocated once and updated in place, so each region compiles once.

Layout of one row, ``S = P + T`` cache columns::

    [pad ... pad | prompt tokens | response tokens]
     0             P - n          P               S

Padding is told by each prompt's length ``n``, never by a token value: a prompt may hold the
pad id as a real token (``<unk>`` is 0 in Llama-2 tokenizers, and so is their pad id).
Positions count from each row's first real token, as in
:func:`torchtune.generation.get_position_ids_from_padding_mask`.

With ``group_size = n > 1`` the rows come in groups of ``n`` copies of one prompt (GRPO-style
sampling): the prompt of each group is prefilled once, in rows ``0, n, 2n, ...`` of the
cache, whose first ``P`` columns are then copied into the group's other rows; the first token
of each row is sampled from the group's shared last-position logits with the row's own noise.

With ``prefix_len = c > 0``, a call whose prompts all begin with the same ``c`` tokens (a chat
template's system turn) computes them once: :func:`prefill_prefix` runs them as one row into
cache columns ``[0, c)``, which are copied into every row, and :func:`extend` runs each row's
other prompt tokens, right-aligned in columns ``[c, P)``, and samples its first token::

    [prefix | pad ... pad | rest of the prompt | response tokens]
     0        c             P - n + c            P               S

Attention reads the columns the mask opens and positions are each token's own, so the layout
changes no result beyond rounding. A call whose prompts do not share the prefix is prefilled whole.
"""

import contextlib
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torchtune.modules import TransformerDecoder

from torchtune_ppo._patches.dynamo import skip_guard_checks
from torchtune_ppo._patches.torchtune_modules import StaticKVCache, final_hidden_states
from torchtune_ppo.config import check_sampling, check_whole_groups
from torchtune_ppo.rlhf import truncate_after_stop_token
from torchtune_ppo.rollout.sampling import exponential_noise, sample
from torchtune_ppo.rollout.speculative import SpeculativeStats, keyed_noise, verify, verify_one

__all__ = ["GenerationInputs", "GenerationOutput", "GenerationSteps", "Generator", "extend",
           "generate_next_token", "prefill", "prefill_group", "prefill_prefix"]


class GenerationOutput(NamedTuple):
    """What :meth:`Generator.generate` returns.

    Attributes:
        query_responses (torch.Tensor): ``[b, P + T]`` int64, the prompt as given, then the
            response; after a row's first stop token every position holds ``pad_id``.
        logprobs (torch.Tensor): ``[b, T]`` float32, ``log_softmax(logits / temperature)`` of each
            sampled token under the full (unfiltered) distribution; finite but meaningless after
            the stop token.
        logits (Optional[torch.Tensor]): ``[b, T, V]`` float32 when ``return_logits=True``, else
            None. Rows after an early stop hold zeros.
    """

    query_responses: torch.Tensor
    logprobs: torch.Tensor
    logits: Optional[torch.Tensor]


class GenerationInputs(NamedTuple):
    """The per-batch inputs of the prefill and decode steps, in the Generator's own buffers.

    Attributes:
        tokens (torch.Tensor): ``[B, P]`` left-padded prompts.
        prefill_pos (torch.Tensor): ``[B, P]`` position ids of the prompt tokens.
        prefill_mask (torch.Tensor): ``[B, P, S]`` bool, the cache columns each prompt token attends.
        decode_pos (torch.Tensor): ``[B, 1]`` position id of the first response token.
        decode_mask (torch.Tensor): ``[B, 1, S]`` bool, the prompt's real columns.
        prompt_lens (torch.Tensor): ``[B]`` real tokens of each prompt (0 for filler rows).
    """

    tokens: torch.Tensor
    prefill_pos: torch.Tensor
    prefill_mask: torch.Tensor
    decode_pos: torch.Tensor
    decode_mask: torch.Tensor
    prompt_lens: torch.Tensor


def prefill(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the prompts through the model (filling the KV cache) and samples the first token.

    Args:
        model (TransformerDecoder): model with KV caches enabled, reset to column 0.
        tokens (torch.Tensor): ``[B, P]`` left-padded prompts.
        input_pos (torch.Tensor): ``[B, P]`` position ids.
        mask (torch.Tensor): ``[B, P, S]`` bool, True where a query may attend a cache column.
        noise (Optional[torch.Tensor]): Exponential(1) draws, see :func:`sample`.
        temperature (float): see :func:`sample`.
        top_k (Optional[int]): see :func:`sample`.
        top_p (Optional[float]): see :func:`sample`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``[B]`` tokens, ``[B]`` logprobs and
        the ``[B, V]`` float32 logits they were sampled from.
    """
    logits = last_position_logits(model, tokens, input_pos, mask)  # [B, V]
    token, logprob = sample(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)
    return token, logprob, logits


def last_position_logits(
    model: TransformerDecoder, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The float32 logits ``[B, V]`` of the prompts' last position, filling the KV cache.

    Only the last position is projected to the vocabulary: ``model(tokens)[:, -1]`` would
    project all ``P`` (for SmolLM2, 49152 x 576 products per position, of which one is read).
    """
    h = final_hidden_states(model, tokens, mask=mask, input_pos=input_pos)[:, -1]  # [B, D]
    return model.output(h).float()


def prefill_group(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    group_size: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prefill` of ``G`` distinct prompts whose ``G * group_size`` rows share them.

    The model sees ``tokens [G, P]``; each prompt's last-position logits are repeated
    ``group_size`` times in a row and every row samples its first token with its own noise
    (``noise [G * group_size, W]``), as :func:`prefill` of the repeated prompts would.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``[G * group_size]`` tokens and
        logprobs, and the ``[G * group_size, V]`` float32 logits they were sampled from.
    """
    logits = last_position_logits(model, tokens, input_pos, mask)  # [G, V]
    logits = logits.repeat_interleave(group_size, dim=0)  # [G * n, V]
    token, logprob = sample(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)
    return token, logprob, logits


def prefill_prefix(
    model: TransformerDecoder, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Writes the prefix ``tokens [1, c]`` every prompt of a call begins with into the KV cache
    (the row :meth:`StaticKVCache.rows_every` shows), at columns ``[0, c)``; returns its last
    hidden state ``[1, D]``. Nothing is projected to the vocabulary nor sampled.

    Args:
        model (TransformerDecoder): model with KV caches enabled, reset to column 0.
        tokens (torch.Tensor): ``[1, c]`` the prefix.
        input_pos (torch.Tensor): ``[1, c]`` its positions, ``0 .. c - 1``.
        mask (torch.Tensor): ``[1, c, S]`` bool, causal over the first ``c`` columns.
    """
    return final_hidden_states(model, tokens, mask=mask, input_pos=input_pos)[:, -1]


# The same body as prefill, kept a separate function on purpose: each gets its own compiled
# graph and guards ([B, P] prompt vs [B, 1] token), so neither ever recompiles for the other.
def generate_next_token(
    model: TransformerDecoder,
    token: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step: feeds one token per row (appending to the KV cache) and samples the next.

    Args:
        model (TransformerDecoder): model with KV caches enabled.
        token (torch.Tensor): ``[B, 1]`` the latest token of each row.
        input_pos (torch.Tensor): ``[B, 1]`` its position id.
        mask (torch.Tensor): ``[B, 1, S]`` bool, the cache columns it may attend.
        noise (Optional[torch.Tensor]): Exponential(1) draws, see :func:`sample`.
        temperature (float): see :func:`sample`.
        top_k (Optional[int]): see :func:`sample`.
        top_p (Optional[float]): see :func:`sample`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``[B]`` tokens, ``[B]`` logprobs and
        the ``[B, V]`` float32 logits they were sampled from.
    """
    # the decoder's forward, through final_hidden_states so that compile.layers reaches it
    h = final_hidden_states(model, token, mask=mask, input_pos=input_pos)  # [B, 1, D]
    logits = model.output(h).float()[:, -1]  # [B, V]
    token, logprob = sample(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)
    return token, logprob, logits


def extend(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor,
    last: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Writes a chunk of tokens per row into the KV cache and samples from each row's last one.

    Args:
        model (TransformerDecoder): model with KV caches enabled; the chunk goes to the cache's
            next ``W`` columns.
        tokens (torch.Tensor): ``[B, W]`` each row's chunk, left-aligned (filler after it).
        input_pos (torch.Tensor): ``[B, W]`` position ids.
        mask (torch.Tensor): ``[B, W, S]`` bool, the cache columns each chunk token attends.
        last (torch.Tensor): ``[B]`` index in the chunk of the token to sample after.
        noise, temperature, top_k, top_p: see :func:`sample`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``[B]`` tokens, ``[B]`` logprobs and the
        ``[B, V]`` float32 logits they were sampled from.
    """
    h = final_hidden_states(model, tokens, mask=mask, input_pos=input_pos)  # [B, W, D]
    h = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]  # [B, D]
    logits = model.output(h).float()
    token, logprob = sample(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)
    return token, logprob, logits


class GenerationSteps(NamedTuple):
    """The step functions a :class:`Generator` runs: :func:`prefill`, :func:`prefill_group` and
    :func:`generate_next_token`, each eager or compiled (:func:`torchtune_ppo.compile.generation_steps`).

    Attributes:
        prefill (Callable): one prefill per row.
        prefill_group (Callable): one prefill per group of rows that share a prompt.
        decode (Callable): one decode step.
        compiled (bool): the steps are compiled, so the decode loop may skip guard evaluation
            after its first step.
        cudagraphs (bool): the decode step replays CUDA graphs, whose outputs the next replay
            overwrites.
        extend (Callable): a chunk written anywhere in the cache, for multi-turn episodes
            (:mod:`torchtune_ppo.rollout.turns`).
        verify (Callable): a draft checked in one forward (:func:`~torchtune_ppo.rollout.speculative.verify`).
        verify_one (Callable): the same for one token per row at each row's own column, once no
            row has a draft left.
        prefix (Callable): the prefix every prompt of a call shares, computed once
            (:func:`prefill_prefix`; ``Generator(prefix_len=...)``).
    """

    prefill: Callable
    prefill_group: Callable
    decode: Callable
    compiled: bool = False
    cudagraphs: bool = False
    extend: Callable = extend
    verify: Callable = verify
    verify_one: Callable = verify_one
    prefix: Callable = prefill_prefix


EAGER_STEPS = GenerationSteps(prefill, prefill_group, generate_next_token)


class Generator:
    """Batched sampling from a policy with a static KV cache, for PPO rollouts.

    The cache is allocated once here (see :class:`StaticKVCache`) and reused by every
    :meth:`generate` call; between calls the model carries no cache at all, so full-sequence
    forwards elsewhere (training, scoring, compiled or not) see the plain model.

    Args:
        model (TransformerDecoder): the policy; it must not have caches set up already.
        batch_size (int): rows per call; a smaller batch is padded up to it internally.
        max_prompt_len (int): ``P``, the width of the left-padded prompts.
        max_generated_tokens (int): ``T``, response tokens per row.
        pad_id (int): left padding of prompts, and filler after a row's stop token.
        stop_token_ids (Sequence[int]): a row is done after generating any of these.
        temperature (float): sampling temperature, > 0.
        top_k (Optional[int]): top-k filtering; 1 gives greedy decoding.
        top_p (Optional[float]): nucleus filtering, in (0, 1].
        steps (GenerationSteps): the prefill and decode step to run; eager by default.
        stop_check_every (int): decode steps between the host syncs that stop the loop early
            once every row is done.
        group_size (int): ``n``: the rows of every call come in groups of ``n`` identical
            prompts, each prefilled once (:func:`prefill_group`); ``batch_size`` must be a
            multiple of ``n``. 1: every row is prefilled (:func:`prefill`).
        dtype (Optional[torch.dtype]): KV cache dtype; defaults to the model's.
        device (Optional[torch.device]): defaults to the model's.
        cache_tokens (Optional[int]): KV cache columns after the prompt's ``P``; None: ``T``.
            Multi-turn episodes (:mod:`torchtune_ppo.rollout.turns`) leave gaps in the cache
            and take more.
        draft_tokens (int): the most draft tokens one verification forward checks
            (:mod:`~torchtune_ppo.rollout.speculative`); 0: no speculation. The cache takes
            ``draft_tokens`` more columns.
        min_draft_rows (float): a verification forward checks ``draft_tokens`` positions only
            while at least this share of the rows still going has draft tokens to offer (and at
            least one does), else one position: where a wider forward costs more than a narrow
            one (a CPU), rows without a draft should not pay for it.
        prefix_len (int): ``c``: a call whose prompts all begin with the same ``c`` tokens, and
            hold at least one more, computes those once (see the module's docstring); 0: off.
            Only with ``group_size`` 1 and below ``max_prompt_len``.

    Raises:
        ValueError: on an invalid argument, naming it and its value.
    """

    def __init__(
        self,
        model: TransformerDecoder,
        *,
        batch_size: int,
        max_prompt_len: int,
        max_generated_tokens: int,
        pad_id: int,
        stop_token_ids: Sequence[int],
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        steps: GenerationSteps = EAGER_STEPS,
        stop_check_every: int = 8,
        group_size: int = 1,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        cache_tokens: Optional[int] = None,
        draft_tokens: int = 0,
        min_draft_rows: float = 0.0,
        prefix_len: int = 0,
    ) -> None:
        param = next(model.parameters())
        # cache columns after the prompt: T, or more for multi-turn episodes (rollout/turns.py)
        self.cache_tokens = max_generated_tokens if cache_tokens is None else cache_tokens
        if not isinstance(draft_tokens, int) or draft_tokens < 0:
            raise ValueError(f"Generator: draft_tokens={draft_tokens!r} is invalid; expected an int >= 0.")
        self.draft_tokens = draft_tokens
        if not isinstance(min_draft_rows, (int, float)) or not 0 <= min_draft_rows <= 1:
            raise ValueError(f"Generator: min_draft_rows={min_draft_rows!r} is invalid; expected a number in [0, 1].")
        self.min_draft_rows = float(min_draft_rows)
        self.cache_tokens += draft_tokens  # a finished row's chunk still writes past its last token
        self.model = model
        self.batch_size, self.max_prompt_len = batch_size, max_prompt_len
        self.max_generated_tokens, self.pad_id = max_generated_tokens, pad_id
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.stop_check_every, self.group_size = stop_check_every, group_size
        if not isinstance(prefix_len, int) or not 0 <= prefix_len < max(1, max_prompt_len) or (
                prefix_len and group_size > 1):
            raise ValueError(f"Generator: prefix_len={prefix_len!r} is invalid; expected an int in [0, max_prompt_len="
                             f"{max_prompt_len}), and 0 with group_size > 1 (got {group_size}).")
        self.prefix_len = prefix_len
        self.prefix_shared = False  # whether the last call computed its prompts' prefix once
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype  # the KV cache's
        self.vocab_size = model.tok_embeddings.num_embeddings
        check_sampling(temperature, top_k, top_p, prefix="Generator: ")
        _check_sizes(self)
        top_k = None if top_k is None else min(top_k, self.vocab_size)
        top_p = None if top_p is None or top_p >= 1.0 else top_p
        self.sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
        self.greedy = top_k == 1
        self.noise_width = top_k if top_k is not None else self.vocab_size  # W

        self._steps = steps
        self._prefill = steps.prefill if group_size == 1 else steps.prefill_group
        self._decode, self._cudagraphs = steps.decode, steps.cudagraphs
        self.kv_cache = StaticKVCache(
            model, batch_size=batch_size, seq_len=max_prompt_len + self.cache_tokens,
            dtype=self.dtype, device=self.device,
        )
        self._setup_buffers()

    def _setup_buffers(self) -> None:
        B, P, T = self.batch_size, self.max_prompt_len, self.max_generated_tokens
        S, dev = P + self.cache_tokens, self.device
        self.inputs = GenerationInputs(
            tokens=torch.full((B, P), self.pad_id, dtype=torch.long, device=dev),
            prefill_pos=torch.zeros(B, P, dtype=torch.long, device=dev),
            prefill_mask=torch.zeros(B, P, S, dtype=torch.bool, device=dev),
            decode_pos=torch.zeros(B, 1, dtype=torch.long, device=dev),
            decode_mask=torch.zeros(B, 1, S, dtype=torch.bool, device=dev),
            prompt_lens=torch.zeros(B, dtype=torch.long, device=dev),
        )
        self._not_padding = torch.ones(B, S, dtype=torch.bool, device=dev)
        cols = torch.arange(S, device=dev)
        self._prompt_cols = cols[:P]
        self._causal = cols[None, :] <= torch.arange(P, device=dev)[:, None]  # [P, S]
        self._self_col = cols[None, :] == torch.arange(P, device=dev)[:, None]  # [P, S]
        self._is_prompt_col = cols < P  # [S]
        self._decode_mask_cols = self.inputs.decode_mask[:, 0].unbind(1)  # S views of [B]
        self._noise = torch.empty(B, self.noise_width, dtype=torch.float32, device=dev)
        self._tokens_out = torch.empty(B, T, dtype=torch.long, device=dev)
        self._logprobs_out = torch.empty(B, T, dtype=torch.float32, device=dev)
        self._token_cols = self._tokens_out.unbind(1)  # T views of [B]
        self._logprob_cols = self._logprobs_out.unbind(1)
        self._stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)
        # Group sharing: the prefill's inputs for one row of each group, [G, P] and [G, P, S].
        G = B // self.group_size if self.group_size > 1 else 0
        self._group_tokens = torch.empty(G, P, dtype=torch.long, device=dev)
        self._group_pos = torch.empty(G, P, dtype=torch.long, device=dev)
        self._group_mask = torch.empty(G, P, S, dtype=torch.bool, device=dev)
        # Position-keyed noise (generate's noise_keys) and speculative verification.
        self._keys: Optional[List[int]] = None
        self._key_rng = torch.Generator(device=dev)
        self.spec_stats = SpeculativeStats()
        self._verification_ran = False
        self._spec = {width: dict(tokens=torch.empty(B, width, dtype=torch.long, device=dev),
                                  pos=torch.empty(B, width, dtype=torch.long, device=dev),
                                  mask=torch.empty(B, width, S, dtype=torch.bool, device=dev),
                                  cols=torch.empty(B, width, dtype=torch.long, device=dev),
                                  noise=None if self.greedy else
                                  torch.empty(B, width, self.noise_width, dtype=torch.float32, device=dev))
                      for width in {1, self.draft_tokens + 1}} if self.draft_tokens else {}
        self._cols = cols
        # A prefix every prompt shares (prefix_len): [1, c] once, then each row's rest [B, P - c].
        c = self.prefix_len
        self._prefix_cols = torch.arange(c, device=dev)
        self._pfx_tokens = torch.empty(1, c, dtype=torch.long, device=dev)
        self._pfx_pos = self._prefix_cols[None].clone()
        self._pfx_mask = (self._causal[:c] & (cols < c))[None].clone()  # [1, c, S]
        self._rest_tokens = torch.empty(B, P - c, dtype=torch.long, device=dev)
        self._rest_pos = torch.empty(B, P - c, dtype=torch.long, device=dev)
        self._rest_mask = torch.empty(B, P - c, S, dtype=torch.bool, device=dev)
        self._rest_last = torch.full((B,), P - c - 1, dtype=torch.long, device=dev)

    def prepare(self, prompts: torch.Tensor, prompt_lens: torch.Tensor,
                rng: Optional[torch.Generator] = None) -> GenerationInputs:
        """Checks ``b <= batch_size`` prompts and loads them into the buffers in place.

        Rows ``b:`` become empty filler rows, sliced off the outputs. ``rng`` is only checked.
        Call inside ``kv_cache.decoding()``; :meth:`generate` does both.
        """
        b = _check_prompts(self, prompts, prompt_lens, rng)
        _check_groups(self, prompts, prompt_lens)
        inp, P = self.inputs, self.max_prompt_len
        inp.tokens[:b].copy_(prompts)
        inp.tokens[b:].fill_(self.pad_id)
        inp.prompt_lens[:b].copy_(prompt_lens)
        inp.prompt_lens[b:].zero_()
        not_padding = self._not_padding[:, :P]
        c = self.prefix_len
        self.prefix_shared = bool(c) and self._shares_prefix(b)
        if self.prefix_shared:  # the prefix in columns [0, c), each row's rest right-aligned after
            torch.ge(self._prompt_cols, P + c - inp.prompt_lens[:, None], out=not_padding)  # [B, P]
            not_padding[:, :c] = True
        else:
            torch.ge(self._prompt_cols, P - inp.prompt_lens[:, None], out=not_padding)  # [B, P]
        # Positions count real tokens: (cumsum - 1) on real ones, 0 on padding (torchtune's rule).
        torch.cumsum(not_padding, dim=-1, out=inp.prefill_pos)
        inp.prefill_pos.sub_(1).mul_(not_padding)
        # [B, P, S]: causal, no padded keys, but always self (no all-masked rows, no NaN).
        torch.logical_or(self._not_padding[:, None, :], self._self_col, out=inp.prefill_mask)
        inp.prefill_mask.logical_and_(self._causal)
        # [B, 1, S]: the prompt's real columns; decode opens one response column per step.
        torch.logical_and(self._not_padding, self._is_prompt_col, out=inp.decode_mask[:, 0])
        inp.decode_pos.copy_(inp.prompt_lens[:, None])
        if self.group_size > 1:  # the first row of each group; the decode buffers keep all B
            n = self.group_size
            self._group_tokens.copy_(inp.tokens[::n])
            self._group_pos.copy_(inp.prefill_pos[::n])
            self._group_mask.copy_(inp.prefill_mask[::n])
        if self.prefix_shared:  # columns [c, P) of each row, whose real tokens are the prompt's rest
            self._rest_tokens.copy_(inp.tokens[:, c:])
            self._rest_pos.copy_(inp.prefill_pos[:, c:])
            self._rest_mask.copy_(inp.prefill_mask[:, c:])
        return inp

    def _shares_prefix(self, b: int) -> bool:
        """Whether the ``b`` prompts in the buffers all begin with the same ``prefix_len`` tokens
        and hold at least one more (one host sync); if so, the prefix goes to its buffer."""
        inp, P = self.inputs, self.max_prompt_len
        lens = inp.prompt_lens[:b]
        starts = (P - lens)[:, None] + self._prefix_cols  # [b, c] each prompt's first columns
        prefixes = inp.tokens[:b].gather(1, starts.clamp(max=P - 1))
        if not bool((lens > self.prefix_len).all() & (prefixes == prefixes[:1]).all()):
            return False
        self._pfx_tokens.copy_(prefixes[:1])
        return True

    def draw_noise(self, rng: Optional[torch.Generator], steps: Optional[int] = None,
                   position: int = 0) -> Optional[torch.Tensor]:
        """Exponential(1) draws for one step ``[B, W]`` (in a reused buffer), or ``[steps, B, W]``;
        inside a call with ``noise_keys``, response ``position``'s keyed draws instead of ``rng``'s."""
        if self.greedy:
            return None
        if self._keys is not None and steps is None:
            keyed_noise(self._noise[:, None], self._keys, [[position]] * self.batch_size, self._key_rng)
            return self._noise
        if steps is None:
            return exponential_noise(self._noise, rng)
        return exponential_noise(torch.empty(steps, *self._noise.shape, device=self.device), rng)

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        prompt_lens: torch.Tensor,
        rng: Optional[torch.Generator] = None,
        return_logits: bool = False,
        noise_keys: Optional[Sequence[int]] = None,
        drafts: Optional[Sequence[Optional[Sequence[int]]]] = None,
        prompt_lookup: bool = False,
    ) -> GenerationOutput:
        """Samples ``max_generated_tokens`` tokens after each prompt.

        Args:
            prompts (torch.Tensor): ``[b, max_prompt_len]`` int64, left-padded, ``b <= batch_size``.
            prompt_lens (torch.Tensor): ``[b]`` real tokens of each prompt; the rest is padding,
                whatever its token ids.
            rng (Optional[torch.Generator]): on the model's device; the same seed gives the same
                tokens. None uses the global generator. Unused when greedy.
            return_logits (bool): also return the ``[b, T, V]`` logits (debugging; memory heavy).
            noise_keys (Optional[Sequence[int]]): one 64-bit key per row: the noise of response
                position ``t`` is drawn from ``mix64(key, t)`` alone, not from ``rng``
                (:mod:`~torchtune_ppo.rollout.speculative`).
            drafts (Optional[Sequence[Optional[Sequence[int]]]]): with ``noise_keys`` and
                ``draft_tokens``: each row's guess of its response (None or empty: none), checked
                ``draft_tokens`` at a time; the response is the one the call without drafts samples.
            prompt_lookup (bool): with ``drafts`` (its rows may all be None): where a row has no
                guess from its draft, the tokens that followed the row's last sampled tokens
                earlier in its prompt or response are the guess (prompt lookup).

        Returns:
            GenerationOutput: ``query_responses [b, P + T]``, ``logprobs [b, T]`` and
            ``logits [b, T, V]`` or None.

        Raises:
            ValueError: if ``prompts`` or ``prompt_lens`` has the wrong shape, dtype or values,
                or ``rng`` the wrong device.
        """
        b = prompts.shape[0]
        if noise_keys is not None and len(noise_keys) != b:
            raise ValueError(f"generate: noise_keys has {len(noise_keys)} keys for {b} prompts.")
        if drafts is not None and (noise_keys is None and not self.greedy or not self.draft_tokens
                                   or len(drafts) != b):
            raise ValueError("generate: drafts need noise_keys (unless greedy), a Generator with draft_tokens > 0 "
                             f"(got {self.draft_tokens}) and one entry per prompt ({b}).")
        self._keys = None if noise_keys is None else [int(k) for k in noise_keys] + [0] * (self.batch_size - b)
        try:
            with self.kv_cache.decoding():
                self.prepare(prompts, prompt_lens, rng)
                if drafts is not None and (any(drafts) or prompt_lookup) and not return_logits:
                    logits = self._speculative_loop(b, [list(d or ()) for d in drafts], prompt_lookup)
                else:
                    logits = self._decode_loop(b, rng, return_logits)
                    self.spec_stats.count_plain(self._tokens_out[:b], self._stop_ids)
                if drafts is not None and self.draft_tokens and not self._verification_ran:
                    self._run_verification_once()  # both widths compiled in this call, not a later one
        finally:
            self._keys = None
        _, responses = truncate_after_stop_token(self._tokens_out[:b], self._stop_ids, self.pad_id)
        query_responses = torch.cat([prompts.to(self.device, torch.long), responses], dim=1)
        return GenerationOutput(
            query_responses, self._logprobs_out[:b].clone(), None if logits is None else logits[:b]
        )

    def _decode_loop(self, b: int, rng: Optional[torch.Generator], return_logits: bool) -> Optional[torch.Tensor]:
        """Prefill, then decode until ``T`` tokens or every real row has stopped."""
        P, T, inp = self.max_prompt_len, self.max_generated_tokens, self.inputs
        self._tokens_out.fill_(self.pad_id)
        self._logprobs_out.zero_()
        logits_out = (torch.zeros(self.batch_size, T, self.vocab_size, device=self.device)
                      if return_logits else None)
        token = self._record(0, *self.first_token(rng), logits_out)
        with contextlib.ExitStack() as stack:
            for i in range(1, T):
                if self.stop_token_ids and i % self.stop_check_every == 0 and self._all_done(b, i):
                    break
                if i == 2:  # step 1 ran the full guard check; nothing they cover changes after it
                    stack.enter_context(skip_guard_checks(self._steps.compiled))
                self._decode_mask_cols[P + i - 1].fill_(True)  # the fed token's cache column
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                token, logprob, logits = self._decode(
                    self.model, token[:, None], inp.decode_pos, inp.decode_mask,
                    self.draw_noise(rng, position=i), **self.sampling,
                )
                inp.decode_pos.add_(1)
                token = self._record(i, token, logprob, logits, logits_out)
        return logits_out

    def _speculative_loop(self, b: int, drafts: List[List[int]], prompt_lookup: bool = False) -> None:
        """Prefill, then verification forwards until every real row has ``T`` tokens or a stop
        token: each row's chunk is its last token and its guess of the next ``draft_tokens``: its
        draft's next tokens while the draft agrees with what the row sampled so far, else what
        follows the row's last tokens in its draft (:func:`draft_lookup`). The forward is that wide
        while at least ``min_draft_rows`` of the rows still going have a guess, else one token per
        row (``verify_one``). Host syncs once per forward, to read what was accepted."""
        P, T, B, K = self.max_prompt_len, self.max_generated_tokens, self.batch_size, self.draft_tokens + 1
        stats, inp, stops = self.spec_stats, self.inputs, set(self.stop_token_ids)
        self._tokens_out.fill_(self.pad_id)
        self._logprobs_out.zero_()
        token, logprob, _ = self.first_token(None)
        self._record(0, token, logprob, None, None)
        out = [[t] for t in token.tolist()]  # each row's tokens so far, on the host
        drafts = drafts + [[]] * (B - b)
        lens = inp.prompt_lens.tolist()
        prompts = [row[P - n:] if n and prompt_lookup else [] for row, n in zip(inp.tokens.tolist(), lens)]
        done = [r >= b or out[r][0] in stops for r in range(B)]
        aligned = [bool(d) and d[:1] == out[r] for r, d in enumerate(drafts)]  # draft[:n] == what was sampled
        stats.rows += b
        stats.rows_with_draft += sum(1 for d in drafts[:b] if d)
        prompt_cols = inp.decode_mask[:, 0].clone()  # [B, S] each row's real prompt columns
        response_cols = self._cols >= P  # [S]
        max_pos = self.model.max_seq_len - 1
        forwards = 0
        while not all(done):
            live = [r for r in range(B) if not done[r]]
            n = [len(o) for o in out]  # the chunk starts with token n - 1, at column P + n - 1
            guess = [[] if done[r] else drafts[r][n[r]:n[r] + K - 1] if aligned[r] else
                     draft_lookup(drafts[r], out[r], K - 1) or
                     (draft_lookup(prompts[r] + out[r], out[r], K - 1, near=len(prompts[r]) + len(out[r]))
                      if prompt_lookup else [])
                     for r in range(B)]
            guessing = sum(1 for r in live if guess[r])
            width = K if guessing and guessing >= self.min_draft_rows * len(live) else 1
            buf = self._spec[width]
            chunk = [[o[-1]] + guess[r][:width - 1] for r, o in enumerate(out)]
            chunk = [c + [self.pad_id] * (width - len(c)) for c in chunk]
            buf["tokens"].copy_(torch.tensor(chunk))
            first = torch.tensor(n, device=self.device)[:, None] - 1 + torch.arange(width, device=self.device)  # [B, w]
            torch.add(first, P, out=buf["cols"])
            torch.add(first, inp.prompt_lens[:, None], out=buf["pos"]).clamp_(max=max_pos)
            # a query at column c attends the prompt and the response columns up to c
            torch.logical_and(response_cols, self._cols <= buf["cols"][..., None], out=buf["mask"])
            buf["mask"].logical_or_(prompt_cols[:, None, :])
            if buf["noise"] is not None:
                keyed_noise(buf["noise"], self._keys, [range(k, k + width) for k in n], self._key_rng)
            with self.kv_cache.row_writes(buf["cols"]):
                verify_fn = self._steps.verify if width > 1 else self._steps.verify_one
                winners, logprobs = verify_fn(self.model, buf["tokens"], buf["pos"], buf["mask"], buf["noise"],
                                              **self.sampling)
            won = winners.tolist()
            stats.verify_forwards += width > 1
            stats.decode_forwards += width == 1
            for r in live:
                kept, offered = 1, len(guess[r]) if width > 1 else 0
                while kept <= offered and won[r][kept - 1] == chunk[r][kept]:
                    kept += 1
                stats.draft_tokens += offered
                stats.accepted += kept - 1
                if aligned[r]:
                    aligned[r] = kept - 1 == offered and n[r] + kept < len(drafts[r]) \
                        and won[r][kept - 1] == drafts[r][n[r] + kept - 1]
                kept = min(kept, T - n[r])
                new = won[r][:kept]
                self._tokens_out[r, n[r]:n[r] + kept] = torch.tensor(new, device=self.device)
                self._logprobs_out[r, n[r]:n[r] + kept] = logprobs[r, :kept]
                out[r].extend(new)
                stats.tokens += kept
                done[r] = len(out[r]) >= T or any(t in stops for t in new)
            forwards += 1
        # plain decoding would have run a decode step for every token of the longest real row after the first
        stats.forwards_saved += max(len(o) for o in out[:b]) - 1 - forwards

    def _run_verification_once(self) -> None:
        """Runs both verification regions once on filler (after a call's responses are out), so
        that a run whose first step has no drafts compiles them in that step, not in the first
        step that has drafts. What they write lands past the responses and is never read."""
        P, T = self.max_prompt_len, self.max_generated_tokens
        for width, buf in self._spec.items():
            buf["tokens"].fill_(self.pad_id)
            buf["cols"].copy_(torch.arange(width, device=self.device) + (P + T - 1))  # [B, w]
            buf["pos"].copy_(buf["cols"] - P).clamp_(max=self.model.max_seq_len - 1)
            buf["mask"].copy_(self._cols <= buf["cols"][..., None])
            if buf["noise"] is not None:
                buf["noise"].fill_(1.0)
            verify_fn = self._steps.verify if width > 1 else self._steps.verify_one
            with self.kv_cache.row_writes(buf["cols"]):
                verify_fn(self.model, buf["tokens"], buf["pos"], buf["mask"], buf["noise"], **self.sampling)
        self._verification_ran = True

    def first_token(self, rng: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill of the prepared prompts (once per group with ``group_size`` > 1), filling
        the cache's first ``P`` columns: the ``[B]`` first tokens, their logprobs, ``[B, V]`` logits."""
        inp = self.inputs
        if self.prefix_shared:  # the prefix once, into every row, then each row's rest as a chunk
            with self.kv_cache.rows_every(self.batch_size):  # cache row 0
                self._steps.prefix(self.model, self._pfx_tokens, self._pfx_pos, self._pfx_mask)
            self.kv_cache.copy_to_group(self.batch_size, self.prefix_len)
            with self.kv_cache.chunk_attention():
                return self._steps.extend(self.model, self._rest_tokens, self._rest_pos, self._rest_mask,
                                          self._rest_last, self.draw_noise(rng), **self.sampling)
        if self.group_size == 1:
            return self._prefill(
                self.model, inp.tokens, inp.prefill_pos, inp.prefill_mask, self.draw_noise(rng), **self.sampling
            )
        with self.kv_cache.rows_every(self.group_size):  # cache rows 0, n, 2n, ...
            token, logprob, logits = self._prefill(
                self.model, self._group_tokens, self._group_pos, self._group_mask,
                self.draw_noise(rng), group_size=self.group_size, **self.sampling,
            )
        self.kv_cache.copy_to_group(self.group_size, self.max_prompt_len)
        return token, logprob, logits

    def _record(self, i, token, logprob, logits, logits_out) -> torch.Tensor:
        """Writes step ``i``'s outputs; returns the token to feed next."""
        self._token_cols[i].copy_(token)
        self._logprob_cols[i].copy_(logprob)
        if logits_out is not None:
            logits_out[:, i] = logits
        # A CUDA-graph replay overwrites its outputs: feed the next step a copy.
        return token.clone() if self._cudagraphs else token

    def _all_done(self, b: int, i: int) -> bool:
        """Whether each real row has a stop token among its first ``i`` tokens (host sync)."""
        return bool(torch.isin(self._tokens_out[:b, :i], self._stop_ids).any(-1).all())


def draft_lookup(draft: List[int], sampled: List[int], k: int, match: Sequence[int] = (3, 2),
                 near: Optional[int] = None) -> List[int]:
    """Up to ``k`` tokens of ``draft`` that follow its occurrence of the last tokens ``sampled``
    (the last 3, else the last 2; of several, the one ending nearest ``near``, by default the
    row's own position ``len(sampled)``): a draft that one different token put out of step with
    the row is picked up again where it agrees. Over the row's own prompt and response
    (``near=len(draft)``: the latest occurrence) it is prompt lookup."""
    n = len(sampled) if near is None else near
    for m in match:
        if n < m:
            continue
        tail = sampled[-m:]
        ends = [j + m for j in range(len(draft) - m) if draft[j:j + m] == tail]  # ends before the draft's end
        if ends:
            end = min(ends, key=lambda e: abs(e - n))
            return draft[end:end + k]
    return []


# Argument checks, kept out of the class so that it reads as what it does.
def _check_sizes(gen: "Generator") -> None:
    for name in ("batch_size", "max_prompt_len", "max_generated_tokens", "stop_check_every", "group_size",
                 "cache_tokens"):
        value = getattr(gen, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Generator: {name}={value!r} is invalid; expected an int >= 1.")
    if gen.cache_tokens < gen.max_generated_tokens:
        raise ValueError(f"Generator: cache_tokens={gen.cache_tokens} is below max_generated_tokens="
                         f"{gen.max_generated_tokens}; the cache holds every response token.")
    seq_len = gen.max_prompt_len + gen.max_generated_tokens
    if seq_len > gen.model.max_seq_len:
        raise ValueError(
            f"Generator: max_prompt_len + max_generated_tokens = {seq_len} exceeds the "
            f"model's max_seq_len={gen.model.max_seq_len}."
        )
    check_whole_groups(gen.batch_size, gen.group_size, f"Generator: batch_size={gen.batch_size}")
    bad = [t for t in gen.stop_token_ids if not 0 <= t < gen.vocab_size]
    if bad:
        raise ValueError(
            f"Generator: stop_token_ids {bad} are outside the vocabulary [0, {gen.vocab_size})."
        )


def _check_prompts(gen: "Generator", prompts: torch.Tensor, prompt_lens: torch.Tensor,
                   rng: Optional[torch.Generator]) -> int:
    P = gen.max_prompt_len
    if not (isinstance(prompts, torch.Tensor) and prompts.ndim == 2 and prompts.shape[1] == P
            and 1 <= prompts.shape[0] <= gen.batch_size):
        got = tuple(prompts.shape) if isinstance(prompts, torch.Tensor) else type(prompts).__name__
        raise ValueError(
            f"generate: prompts must have shape [b, max_prompt_len] = [b, {P}] with "
            f"1 <= b <= batch_size={gen.batch_size}, left-padded; got {got}."
        )
    if prompts.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"generate: prompts must be int64 (or int32) token ids; got {prompts.dtype}.")
    b = prompts.shape[0]
    if not (isinstance(prompt_lens, torch.Tensor) and prompt_lens.shape == (b,)
            and not prompt_lens.is_floating_point()):
        got = tuple(prompt_lens.shape) if isinstance(prompt_lens, torch.Tensor) else prompt_lens
        raise ValueError(f"generate: prompt_lens must be an integer tensor of shape [{b}]; got {got}.")
    if bool((prompt_lens < 0).any() | (prompt_lens > P).any()):
        raise ValueError(
            f"generate: prompt_lens must be in [0, max_prompt_len={P}]; got {prompt_lens.tolist()}."
        )
    if rng is not None and rng.device.type != gen.device.type:
        raise ValueError(f"generate: rng is a {rng.device} generator but the model is on {gen.device}.")
    return b


def _check_groups(gen: "Generator", prompts: torch.Tensor, prompt_lens: torch.Tensor) -> None:
    n, b, P = gen.group_size, prompts.shape[0], gen.max_prompt_len
    if n == 1:
        return
    check_whole_groups(b, n, f"generate: a call of {b} prompts")
    lens = prompt_lens.view(-1, n)  # [g, n]
    real = torch.arange(P, device=prompts.device) >= P - prompt_lens.to(prompts.device)[:, None]  # [b, P]
    same = (prompts.view(-1, n, P) == prompts.view(-1, n, P)[:, :1]) | ~real.view(-1, n, P)
    if not bool((lens == lens[:, :1]).all()) or not bool(same.all()):
        raise ValueError(
            f"generate: with group_size={n} each run of {n} rows must hold one prompt "
            "(the same real tokens and length), as repeat_prompts lays them out."
        )
