"""KV-cached batched generation with a compiled prefill and a compiled decode step.

gpt-fast style: :func:`prefill` and :func:`generate_next_token` are plain functions that
sample inside the step (no host sync), and :class:`Generator` wraps them with
:func:`torchtune_ppo._compile.maybe_compile`. Every shape is fixed by ``batch_size``,
``max_prompt_len`` and ``max_generated_tokens``; the KV cache, masks and positions live in
buffers allocated once and updated in place, so each region compiles once.

Layout of one row, ``S = P + T`` cache columns::

    [pad ... pad | prompt tokens | response tokens]
     0             P - n_real      P               S

Cache column ``j`` holds sequence index ``j`` for every row; positions count from each row's
first real token, as in :func:`torchtune.generation.get_position_ids_from_padding_mask`.
"""

import contextlib
import inspect
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune.modules import TransformerDecoder
from torchtune.modules.kv_cache import KVCache

from torchtune_ppo._compile import maybe_compile

# torch >= 2.7: run only the guards that tell cache entries apart.
_HAS_SKIP_GUARD_EVAL = "skip_guard_eval_unsafe" in inspect.signature(
    torch.compiler.set_stance
).parameters

def _stance() -> str:
    """The current ``torch.compiler.set_stance`` stance (a user's "force_eager" is kept)."""
    return getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")


_NO_HIDDEN_STATES: List[int] = []  # one object, so guards on it never change

__all__ = ["GenerationOutput", "Generator", "generate_next_token", "prefill", "sample"]


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


def sample(
    logits: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row with the exponential race; no host sync.

    ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. is a draw from ``probs``.

    Args:
        logits (torch.Tensor): ``[B, V]`` next-token logits.
        noise (Optional[torch.Tensor]): ``[B, V]``, or ``[B, top_k]`` when ``top_k`` is set,
            Exponential(1) draws. Unused (may be None) when ``top_k == 1``.
        temperature (float): logits are divided by it; must be > 0.
        top_k (Optional[int]): sample among the ``top_k`` largest logits; 1 is greedy argmax.
        top_p (Optional[float]): then keep the smallest set of tokens whose probability
            (renormalised over the top-k, when set) sums to at least ``top_p``.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``[B]`` int64 tokens and their ``[B]`` float32
        log-probabilities under the full ``softmax(logits / temperature)``.
    """
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    if top_k == 1:
        token = torch.argmax(scaled, dim=-1)
    else:
        if top_k is not None:
            # Race among the top-k only: [B, k] instead of [B, V] noise and softmax.
            # Sorted (descending) only when top-p needs it.
            cand, cand_idx = torch.topk(scaled, top_k, dim=-1, sorted=top_p is not None)
        else:
            cand, cand_idx = scaled, None
        if top_p is not None and top_p < 1.0:
            cand = _top_p_filter(cand, top_p, is_sorted=top_k is not None)
        probs = torch.softmax(cand, dim=-1)
        # A zero draw would turn a filtered 0 into 0/0 = NaN, which argmax would pick.
        race = probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)
        choice = torch.argmax(race, dim=-1)  # [B]
        token = choice if cand_idx is None else cand_idx.gather(-1, choice[:, None])[:, 0]
    logprob = logprobs.gather(-1, token[:, None])[:, 0]
    return token, logprob


def _top_p_filter(scores: torch.Tensor, top_p: float, *, is_sorted: bool) -> torch.Tensor:
    """Sets to -inf the scores outside the top-p nucleus. ``scores``: [B, N]."""
    if is_sorted:
        sorted_scores, order = scores, None
    else:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first is always kept.
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    sorted_scores = sorted_scores.masked_fill(drop, -float("inf"))
    if order is None:
        return sorted_scores
    return torch.empty_like(scores).scatter_(-1, order, sorted_scores)


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
    logits = model(tokens, input_pos=input_pos, mask=mask)[:, -1]  # [B, V]
    token, logprob = sample(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)
    return token, logprob, logits


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
    logits = model(token, input_pos=input_pos, mask=mask)[:, -1]  # [B, V]
    token, logprob = sample(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)
    return token, logprob, logits


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """Stands in for torchtune's ``MultiHeadAttention._attention_call`` during generation.

    A decode query (one position) attends with a multiply-and-sum instead of SDPA: torchtune
    hands over K/V already expanded from the KV heads to all heads, which SDPA needs copied
    (the whole cache, every layer, every step); as reductions the compiler reads the cache in
    place. The prefill goes to SDPA as in torchtune, over the ``s`` cache columns it fills
    (it starts at column 0) rather than all ``S``.
    q: [B, H, s, D], k/v: [B, H, S, D], mask: [B, s, S].
    """
    s = q.shape[2]
    if s != 1 or mask is None:
        if mask is not None:
            k, v, mask = k[:, :, :s], v[:, :, :s], mask[:, None, :, :s]
        return nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
    scale = q.shape[-1] ** -0.5
    scores = (q.float() * k.float()).sum(-1) * scale  # [B, H, S]
    scores = scores.masked_fill(~mask, -float("inf"))  # mask [B, 1, S] broadcasts over heads
    weights = torch.softmax(scores, dim=-1)
    out = (weights[..., None] * v.float()).sum(-2)  # [B, H, D]
    return out[:, :, None].to(q.dtype)


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "cache_enabled")]


class Generator:
    """Batched sampling from a policy with a static KV cache, for PPO rollouts.

    The cache is allocated once here and reused by every :meth:`generate` call. Between calls
    the model carries no cache at all: each attention module's ``kv_cache`` is detached and
    ``cache_enabled`` is False, so full-sequence forwards elsewhere (training, scoring, compiled
    or not) see the plain model, and ``mask=None`` still means causal. ``generate`` attaches the
    caches on entry, runs the model in eval mode, and restores both on exit.

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
        compile (bool): compile the prefill and decode step.
        compile_mode (str): ``torch.compile`` mode. CUDA graphs (``"reduce-overhead"``,
            ``"max-autotune"``) apply to the decode step only; the prefill, run once per batch,
            is compiled without them.
        stop_check_every (int): decode steps between the host syncs that stop the loop early
            once every row is done.
        dtype (Optional[torch.dtype]): KV cache dtype; defaults to the model's.
        device (Optional[torch.device]): defaults to the model's.

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
        compile: bool = False,
        compile_mode: str = "default",
        stop_check_every: int = 8,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.batch_size = batch_size
        self.max_prompt_len = max_prompt_len
        self.max_generated_tokens = max_generated_tokens
        self.pad_id = pad_id
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.stop_check_every = stop_check_every
        self.dtype = dtype or param.dtype
        self.device = torch.device(device) if device is not None else param.device
        self.vocab_size = model.tok_embeddings.num_embeddings
        self._validate_args(temperature, top_k, top_p, compile_mode)
        if top_k is not None:
            top_k = min(top_k, self.vocab_size)
        if top_p is not None and top_p >= 1.0:
            top_p = None
        self._sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
        self._greedy = top_k == 1
        self._noise_width = top_k if top_k is not None else self.vocab_size

        self._skip_guards = compile and _HAS_SKIP_GUARD_EVAL
        graphs_mode = compile and compile_mode in ("reduce-overhead", "max-autotune")
        self._cudagraphs = graphs_mode and self.device.type == "cuda"
        if graphs_mode and self.device.type != "cuda":
            warnings.warn(f"compile_mode={compile_mode!r} uses CUDA graphs, which need a CUDA "
                          f"device; on {self.device.type} the steps run without them.")
        # CUDA graphs pay off for the decode step, run T - 1 times per batch, not the prefill.
        prefill_mode = {
            "reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"
        }.get(compile_mode, compile_mode)
        self._prefill = maybe_compile(prefill, enabled=compile, mode=prefill_mode, fullgraph=True)
        self._decode = maybe_compile(
            generate_next_token, enabled=compile, mode=compile_mode, fullgraph=True
        )
        self._setup_caches()
        self._setup_buffers()

    def _validate_args(self, temperature, top_k, top_p, compile_mode) -> None:
        checks = {
            "batch_size": (self.batch_size, self.batch_size >= 1, "an int >= 1"),
            "max_prompt_len": (self.max_prompt_len, self.max_prompt_len >= 1, "an int >= 1"),
            "max_generated_tokens": (
                self.max_generated_tokens, self.max_generated_tokens >= 1, "an int >= 1"),
            "stop_check_every": (self.stop_check_every, self.stop_check_every >= 1, "an int >= 1"),
            "temperature": (temperature, temperature > 0, "a float > 0 (use top_k=1 for greedy)"),
            "top_k": (top_k, top_k is None or top_k >= 1, "None or an int >= 1"),
            "top_p": (top_p, top_p is None or 0 < top_p <= 1, "None or a float in (0, 1]"),
            "compile_mode": (compile_mode, compile_mode in (
                "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                "one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
        }
        for name, (value, ok, valid) in checks.items():
            if not ok:
                raise ValueError(f"Generator: {name}={value!r} is invalid; expected {valid}.")
        seq_len = self.max_prompt_len + self.max_generated_tokens
        if seq_len > self.model.max_seq_len:
            raise ValueError(
                f"Generator: max_prompt_len + max_generated_tokens = {seq_len} exceeds the "
                f"model's max_seq_len={self.model.max_seq_len}."
            )
        bad = [t for t in self.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Generator: stop_token_ids {bad} are outside the vocabulary "
                f"[0, {self.vocab_size})."
            )

    def _setup_caches(self) -> None:
        if self.model.caches_are_setup():
            raise ValueError(
                "Generator: the model already has KV caches set up; the Generator owns its own. "
                "Call torchtune.modules.common_utils.delete_kv_caches(model) first."
            )
        seq_len = self.max_prompt_len + self.max_generated_tokens
        with self.device:
            self.model.setup_caches(self.batch_size, self.dtype, decoder_max_seq_len=seq_len)
        self._attn = _attention_modules(self.model)
        self._caches: List[KVCache] = [m.kv_cache for m in self._attn]
        self._sdpa_calls = [m._attention_call for m in self._attn]
        self._cache_pos0 = torch.arange(seq_len, device=self.device)
        self._detach_caches()

    def _attach_caches(self) -> None:
        # Plain [B, s, V] logits from forward: no chunked output (a graph break), no hidden states.
        self._output_settings = (self.model.num_output_chunks, self.model.output_hidden_states)
        self.model.num_output_chunks, self.model.output_hidden_states = 0, _NO_HIDDEN_STATES
        for attn, cache in zip(self._attn, self._caches):
            attn.kv_cache = cache
            attn.cache_enabled = True
            attn._attention_call = _attention
            cache.cache_pos.copy_(self._cache_pos0)  # back to column 0; stale K/V stay masked

    def _detach_caches(self) -> None:
        for attn, sdpa in zip(self._attn, self._sdpa_calls):
            attn.cache_enabled = False
            attn.kv_cache = None
            attn._attention_call = sdpa
        if hasattr(self, "_output_settings"):
            self.model.num_output_chunks, self.model.output_hidden_states = self._output_settings

    def _setup_buffers(self) -> None:
        B, P, T = self.batch_size, self.max_prompt_len, self.max_generated_tokens
        S, dev = P + T, self.device
        self._tokens = torch.full((B, P), self.pad_id, dtype=torch.long, device=dev)
        self._real = torch.ones(B, S, dtype=torch.bool, device=dev)  # not left padding
        self._prefill_pos = torch.zeros(B, P, dtype=torch.long, device=dev)
        self._prefill_mask = torch.zeros(B, P, S, dtype=torch.bool, device=dev)
        self._decode_pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self._decode_mask = torch.zeros(B, 1, S, dtype=torch.bool, device=dev)
        cols = torch.arange(S, device=dev)
        self._tril = cols[None, :] <= torch.arange(P, device=dev)[:, None]  # [P, S]
        self._diag = cols[None, :] == torch.arange(P, device=dev)[:, None]  # [P, S]
        self._is_prompt_col = cols < P  # [S]
        self._decode_mask_cols = self._decode_mask[:, 0].unbind(1)  # S views of [B]
        self._noise = torch.empty(B, self._noise_width, dtype=torch.float32, device=dev)
        self._tokens_out = torch.empty(B, T, dtype=torch.long, device=dev)
        self._logprobs_out = torch.empty(B, T, dtype=torch.float32, device=dev)
        self._token_cols = self._tokens_out.unbind(1)  # T views of [B]
        self._logprob_cols = self._logprobs_out.unbind(1)
        self._stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)

    def _validate_prompts(self, prompts: torch.Tensor, rng: Optional[torch.Generator]) -> int:
        P = self.max_prompt_len
        if (
            not isinstance(prompts, torch.Tensor)
            or prompts.ndim != 2
            or prompts.shape[1] != P
            or not 1 <= prompts.shape[0] <= self.batch_size
        ):
            got = (tuple(prompts.shape) if isinstance(prompts, torch.Tensor)
                   else type(prompts).__name__)
            raise ValueError(
                f"generate: prompts must have shape [b, max_prompt_len] = [b, {P}] with "
                f"1 <= b <= batch_size={self.batch_size}, left-padded with pad_id={self.pad_id}; "
                f"got {got}."
            )
        if prompts.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"generate: prompts must be int64 (or int32) token ids; got dtype {prompts.dtype}."
            )
        if rng is not None and rng.device.type != self.device.type:
            raise ValueError(
                f"generate: rng is a {rng.device} generator but the model is on {self.device}."
            )
        return prompts.shape[0]

    def _prepare(self, prompts: torch.Tensor) -> None:
        """Fills the per-batch buffers in place: tokens, positions, masks."""
        b, P = prompts.shape[0], self.max_prompt_len
        self._tokens[:b].copy_(prompts)
        if b < self.batch_size:
            self._tokens[b:].fill_(self.pad_id)  # all-pad filler rows, sliced off at the end
        real = self._real[:, :P]
        torch.ne(self._tokens, self.pad_id, out=real)
        # Positions count real tokens: (cumsum - 1) on real ones, 0 on padding (torchtune's rule).
        torch.cumsum(real, dim=-1, out=self._prefill_pos)
        self._prefill_pos.sub_(1).mul_(real)
        # [B, P, S]: causal, no padded keys, but always self (no all-masked rows, no NaN).
        torch.logical_or(self._real[:, None, :], self._diag, out=self._prefill_mask)
        self._prefill_mask.logical_and_(self._tril)
        # [B, 1, S]: the prompt's real columns; decode opens one response column per step.
        torch.logical_and(self._real, self._is_prompt_col, out=self._decode_mask[:, 0])
        torch.sum(real, dim=-1, keepdim=True, out=self._decode_pos)

    def _draw_noise(self, rng: Optional[torch.Generator]) -> Optional[torch.Tensor]:
        if self._greedy:
            return None
        return self._noise.exponential_(generator=rng)

    @contextlib.contextmanager
    def attached(self):
        """The policy in eval mode with its KV caches attached; both restored on exit."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()  # generation never uses dropout, and a fixed mode keeps the guards fixed
        self._attach_caches()
        try:
            yield
        finally:
            self._detach_caches()
            for m, training in modes:
                m.training = training

    def prepare_unrolled(
        self, prompts: torch.Tensor, rng: Optional[torch.Generator] = None
    ) -> Optional[torch.Tensor]:
        """Loads a full batch of prompts for :meth:`unrolled`; returns its ``[T, B, W]`` noise.

        Call inside :meth:`attached`. ``prompts`` must be ``[batch_size, max_prompt_len]``.
        """
        if self._validate_prompts(prompts, rng) != self.batch_size:
            raise ValueError(
                f"unrolled generation needs a full batch of {self.batch_size} prompts, "
                f"got {prompts.shape[0]}."
            )
        self._prepare(prompts)
        if self._greedy:
            return None
        shape = (self.max_generated_tokens, *self._noise.shape)
        return torch.empty(shape, device=self.device).exponential_(generator=rng)

    def unrolled(self, noise: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Prefill and every decode step as straight-line code with no early exit.

        Written for tracing: one enclosing ``torch.compile`` region can hold the whole
        generation (the RFC's "compile steps 1-6 as one region"). Call after
        :meth:`prepare_unrolled`, inside :meth:`attached`.

        Args:
            noise (Optional[torch.Tensor]): ``[T, B, W]`` from :meth:`prepare_unrolled`.

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: ``query_responses [B, P + T]`` (tokens after a
            stop token are kept, not padded) and ``logprobs [B, T]``.
        """
        P, T = self.max_prompt_len, self.max_generated_tokens
        cols = torch.arange(P + T, device=self.device)
        token, logprob, _ = prefill(
            self.model, self._tokens, self._prefill_pos, self._prefill_mask,
            None if noise is None else noise[0], **self._sampling,
        )
        tokens, logprobs = [token], [logprob]
        for i in range(1, T):
            response_cols = (cols >= P) & (cols < P + i)  # [S]: the i tokens fed so far
            mask = self._decode_mask | response_cols
            token, logprob, _ = generate_next_token(
                self.model, token[:, None], self._decode_pos + (i - 1), mask,
                None if noise is None else noise[i], **self._sampling,
            )
            tokens.append(token)
            logprobs.append(logprob)
        query_responses = torch.cat([self._tokens, torch.stack(tokens, dim=1)], dim=1)
        return query_responses, torch.stack(logprobs, dim=1)

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        rng: Optional[torch.Generator] = None,
        return_logits: bool = False,
    ) -> GenerationOutput:
        """Samples ``max_generated_tokens`` tokens after each prompt.

        Args:
            prompts (torch.Tensor): ``[b, max_prompt_len]`` int64, left-padded with ``pad_id``,
                ``b <= batch_size``.
            rng (Optional[torch.Generator]): on the model's device; the same seed gives the same
                tokens. None uses the global generator. Unused when greedy.
            return_logits (bool): also return the ``[b, T, V]`` logits (debugging; memory heavy).

        Returns:
            GenerationOutput: ``query_responses [b, P + T]``, ``logprobs [b, T]`` and
            ``logits [b, T, V]`` or None.

        Raises:
            ValueError: if ``prompts`` has the wrong shape or dtype, or ``rng`` the wrong device.
        """
        b = self._validate_prompts(prompts, rng)
        with self.attached():
            self._prepare(prompts)
            responses, logprobs, logits = self._generate(b, rng, return_logits)
        query_responses = torch.cat([prompts.to(self.device, torch.long), responses[:b]], dim=1)
        return GenerationOutput(
            query_responses, logprobs[:b], None if logits is None else logits[:b]
        )

    def _generate(
        self, b: int, rng: Optional[torch.Generator], return_logits: bool
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        P, T = self.max_prompt_len, self.max_generated_tokens
        self._tokens_out.fill_(self.pad_id)
        self._logprobs_out.zero_()
        logits_out = (
            torch.zeros(self.batch_size, T, self.vocab_size, device=self.device)
            if return_logits else None
        )
        token, logprob, logits = self._prefill(
            self.model, self._tokens, self._prefill_pos, self._prefill_mask,
            self._draw_noise(rng), **self._sampling,
        )
        token = self._record(0, token, logprob, logits, logits_out)
        with contextlib.ExitStack() as stack:
            for i in range(1, T):
                if self.stop_token_ids and i % self.stop_check_every == 0 and self._all_done(b, i):
                    break
                if i == 2 and self._skip_guards and _stance() == "default":
                    # Step 1 ran the full guard check; nothing the guards cover changes
                    # inside this loop, and evaluating them costs ~0.2 ms a step on CPU.
                    stack.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=True))
                self._decode_mask_cols[P + i - 1].fill_(True)  # the fed token's cache column
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                token, logprob, logits = self._decode(
                    self.model, token[:, None], self._decode_pos, self._decode_mask,
                    self._draw_noise(rng), **self._sampling,
                )
                self._decode_pos.add_(1)
                token = self._record(i, token, logprob, logits, logits_out)
        responses = self._tokens_out.clone()
        if self.stop_token_ids:
            is_stop = torch.isin(responses, self._stop_ids)
            responses.masked_fill_(is_stop.cumsum(-1) - is_stop.long() > 0, self.pad_id)
        return responses, self._logprobs_out.clone(), logits_out

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
