"""torchtune module internals (written for torchtune 0.6.1, its last release).

Every patch of torchtune internals that generation needs is owned by one context manager.

torchtune 0.6.1's ``TransformerDecoder`` has no notion of "a static KV cache used only while
generating": ``setup_caches`` leaves caches on for every later forward, and its attention
call copies the whole expanded cache for a one-token query. :class:`StaticKVCache` allocates
the caches once, keeps them detached between generation calls (so training and scoring see
the plain model, where ``mask=None`` still means causal), and :meth:`StaticKVCache.decoding`
applies, then undoes, every change: caches attached, the decode attention swapped in, plain
``[B, s, V]`` logits, eval mode. A torchtune upgrade that moves these attributes breaks here
and nowhere else.

:func:`final_hidden_states` is the other reach into ``TransformerDecoder``: its ``forward``
up to the final norm, for the loss step, which projects only the positions it reads.
"""

import contextlib
import functools
from typing import Callable, Iterator, List, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtune.modules import MultiHeadAttention, TransformerDecoder

from torchtune_ppo._patches.dynamo import dynamic_dims, mark_dynamic_dims

# Builders and helpers torchtune does not export: kept here so an upgrade breaks one place.
from torchtune.data._utils import truncate  # noqa: F401
from torchtune.models.llama3._component_builders import llama3_mlp, lora_llama3_mlp  # noqa: F401
from torchtune.utils._device import is_npu_available  # noqa: F401  (needs the torch_npu plugin)

TESTED_WITH = "torchtune 0.6.1"

_NO_HIDDEN_STATES: List[int] = []  # one object, so dynamo's guards on it never change


def decode_attention(
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
        return sdpa(q, k, v, mask, dropout_p, is_causal)
    return in_place_attention(q, k, v, mask, dropout_p, is_causal)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """SDPA as torchtune calls it, except that bf16 inputs on CPU are computed in fp32 (the
    output cast back to bf16).

    On CPU, torch 2.13's flash-attention backward in bf16 is ~4x slower than in fp32 (SmolLM2's
    loss step, 8 packed rows of 43 tokens: 5.7 ms a call against 1.4 ms, for each of 30 layers of
    two models a micro-step); the casts cost less than the difference, and round less. The
    generator's prefill and the trainer then compute attention alike. q/k/v: [b, H, s, D].
    """
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
    out = nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
    )
    return out.to(q.dtype)


def _fp32_attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    # torchtune's SDPA branch of _sdpa_or_flex_attention (a bool mask [b, s, s] or None), via sdpa
    return sdpa(q, k, v, None if mask is None else mask[:, None], dropout_p, is_causal)


def _attention_modules(root: nn.Module) -> List[nn.Module]:
    """Every torchtune attention module under ``root`` (those with a swappable attention call)."""
    return [m for m in root.modules() if hasattr(m, "_attention_call") and hasattr(m, "kv_cache")]


def use_fp32_attention(model: nn.Module) -> int:
    """Every torchtune attention module of ``model`` computes bf16 attention on CPU in fp32
    (:func:`sdpa`); the recipe's masks are bool tensors, never flex attention's ``BlockMask``.
    Generation's :class:`StaticKVCache` keeps this as the call it restores. Returns how many
    modules were changed."""
    attns = _attention_modules(model)
    for attn in attns:
        attn._attention_call = _fp32_attention_call
    return len(attns)


class SegmentLayout(NamedTuple):
    """Packed rows' attention as one block per packed sequence, handed to the layers as their
    ``mask`` (built by :func:`torchtune_ppo.rlhf.segments.segment_layout`).

    A block-diagonal mask over a row of ``L`` slots costs ``L * L`` scores however few of them
    it keeps; here each of the ``S`` sequences attends only its own slots and its prefix's
    (``Lq`` queries, ``Lk`` keys), so rows holding several sequences compute what the mask
    keeps and little more. Every slot's output is what the mask :func:`block_causal_masks`
    builds would give, except unused slots (one-token segments no read depends on), whose
    output is some used slot's.

    Attributes:
        q_index (torch.Tensor): ``[S, Lq]`` flat slot (into ``R * L``) of each sequence's
            queries in order; slot 0 past its length.
        kv_index (torch.Tensor): ``[S, Lk]`` its keys: its prefix's slots from column 0, its own
            from a fixed column on; slot 0 where unused.
        mask (torch.Tensor): bool ``[S, Lq, Lk]``, the keys each query sees (padded queries see
            column 0 only, so no row of scores is empty).
        out_index (torch.Tensor): ``[R, L]`` flat index into the ``S * Lq`` outputs of each
            slot's (0 for unused slots).
    """

    q_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor
    out_index: torch.Tensor


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SegmentLayout, dropout_p: float
) -> torch.Tensor:
    """Attention of packed rows by sequence (:class:`SegmentLayout`), through :func:`sdpa`.
    q/k/v: [R, H, L, D] -> [R, H, L, D]."""
    b, h, s, d = q.shape

    def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # -> [S, H, l, D]
        return x.transpose(1, 2).reshape(b * s, h, d)[index].transpose(1, 2)

    kv = layout.kv_index
    out = sdpa(gather(q, layout.q_index), gather(k, kv), gather(v, kv), layout.mask[:, None], dropout_p, False)
    return out.transpose(1, 2).flatten(0, 1)[layout.out_index].transpose(1, 2)


def _segments_or(inner, q, k, v, mask, dropout_p, is_causal):
    if isinstance(mask, SegmentLayout):
        return segment_attention(q, k, v, mask, dropout_p)
    return inner(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def use_segment_attention(model: nn.Module) -> int:
    """Every torchtune attention module of ``model`` takes a :class:`SegmentLayout` as its mask
    (:func:`segment_attention`) besides what its attention call took before (a mask tensor or
    None), which it still gets. Generation's :class:`StaticKVCache` keeps this as the call it
    restores. Idempotent; returns how many modules were changed."""
    changed = 0
    for attn in _attention_modules(model):
        if not _takes_layouts(attn._attention_call):
            attn._attention_call = functools.partial(_segments_or, attn._attention_call)
            changed += 1
    return changed


def _takes_layouts(call) -> bool:
    return isinstance(call, functools.partial) and call.func is _segments_or


def accepts_segment_layouts(model: nn.Module) -> bool:
    """Whether every attention module of ``model`` takes a :class:`SegmentLayout` as its mask
    (:func:`use_segment_attention`); False for a model without attention modules. A model whose
    ``layers`` are not its submodules (``lora.SharedBaseReward``) is judged by its layers."""
    layers = getattr(model, "layers", None)
    root = layers if isinstance(layers, nn.Module) else model
    attns = _attention_modules(root)
    return bool(attns) and all(_takes_layouts(m._attention_call) for m in attns)


def final_hidden_states(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    *,
    mask: torch.Tensor,
    input_pos: torch.Tensor,
) -> torch.Tensor:
    """``model``'s hidden states after its final norm, just before the output projection.

    Mirrors ``TransformerDecoder.forward`` of torchtune 0.6.1 (embeddings, layers, norm), which
    has no switch to skip the output layer: the caller applies ``model.output`` only where it
    reads a logprob or a value. Decoder-only models; with KV caches enabled the layers fill
    them as the decoder's forward would (the generator's prefill); layers wrapped for
    activation checkpointing are called the same way.
    tokens: [b, s], mask: bool [b, s, s] or a :class:`SegmentLayout` (models prepared with
    :func:`use_segment_attention`), input_pos: [b, s] -> [b, s, D].
    """
    if tokens.shape[1] > model.max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} is longer than the model's max_seq_len "
            f"({model.max_seq_len})"
        )
    if isinstance(model, FSDPModule):
        return _hidden_states_through_root(model, tokens, mask=mask, input_pos=input_pos)
    use = _layer_use(model, tokens)
    if use is not None:  # compile.layers: a compiled region's graph breaks here
        return _through_layer_steps(model, tokens, mask, input_pos, use)
    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        h = layer(h, mask=mask, input_pos=input_pos)
    return model.norm(h)


LAYER_STEPS_ATTR = "_torchtune_ppo_layer_steps"


class LayerSteps(NamedTuple):
    """One transformer layer's call ``(layer, h, mask, input_pos) -> h``, compiled once per use
    (:func:`torchtune_ppo.compile.layer_steps`), each its own function so that each keeps its
    own graphs and guards; None for a use whose region is not compiled (its layers run as
    written, unrolled in eager).

    Attributes:
        decode (Optional[Callable]): one token per row, written to the KV cache.
        prefill (Optional[Callable]): several tokens per row written to the KV cache (prefill, extend).
        infer (Optional[Callable]): no KV cache, no grad (scoring).
        train (Optional[Callable]): with grad (the loss step).
    """

    decode: Optional[Callable]
    prefill: Optional[Callable]
    infer: Optional[Callable]
    train: Optional[Callable]


def use_layer_steps(model: nn.Module, steps: Optional[LayerSteps]) -> None:
    """:func:`final_hidden_states` on ``model`` runs its trunk through ``steps`` for each use
    that has one (None: every layer in the caller's graph, or eager, as before).

    An attention module that never had a KV cache holds ``kv_cache = None`` as a plain
    attribute, one whose cache was detached holds it as a registered child; the compiled
    layer's guards tell the two apart, so every attention module here gets the registered form
    and the policy's and value model's layers share one training graph.
    """
    object.__setattr__(model, LAYER_STEPS_ATTR, steps)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention) and "kv_cache" not in module._modules and module.kv_cache is None:
            del module.kv_cache
            module.register_module("kv_cache", None)


def _layer_use(model: nn.Module, tokens: torch.Tensor) -> Optional[str]:
    # Which of LayerSteps' uses this call of final_hidden_states is, if the model has a step for
    # it. Decided by the call, not by whether a region is being traced: a trunk that dynamo runs
    # as a frame of its own (a graph break bubbles up through the functions that call it) keeps
    # its compiled layers even where that frame falls back to eager.
    steps = getattr(model, LAYER_STEPS_ATTR, None)
    if steps is None:
        return None
    if getattr(model.layers[0], "caches_are_enabled", lambda: False)():
        use = "decode" if tokens.shape[1] == 1 else "prefill"
    else:
        use = "train" if torch.is_grad_enabled() else "infer"
    return use if getattr(steps, use) is not None else None


@torch.compiler.disable
def _through_layer_steps(model: nn.Module, tokens: torch.Tensor, mask, input_pos: torch.Tensor,
                         use: str) -> torch.Tensor:
    # The whole trunk, eagerly between the region's graphs: the embedding, a Python loop over
    # compiled layer calls (one layer traced and compiled once per use for every layer of every
    # model), the final norm. A tensor crossing a graph break reaches the next graph without the
    # dynamic marks of the region's inputs, so the sizes the region has dynamic (its
    # ``input_pos``'s) are marked here on what crosses: the tokens and masks the next trunk reads
    # again, and the hidden states returned. A region must make no other tensor of dynamic size
    # before a trunk and use it after (the loss step and scoring run their trunks first).
    step = getattr(getattr(model, LAYER_STEPS_ATTR), use)
    cached = use in ("decode", "prefill")
    dims = dynamic_dims(input_pos)
    h = model.tok_embeddings(_marked(tokens, dims))
    if not cached and isinstance(mask, torch.Tensor) and mask.dim() == 3:  # [b, s, s], made in the region
        _marked(mask, dims | ({2} if 1 in dims else set()))
    for layer in model.layers:  # each layer's output is a new tensor: marked before the next call
        h = step(layer, _marked(h, dims), mask, input_pos)
    return _marked(model.norm(h), dims)


def _marked(t: torch.Tensor, dims: "frozenset[int]") -> torch.Tensor:
    return mark_dynamic_dims(t, dims) if dims else t


class _Identity(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


def _hidden_states_through_root(
    model: TransformerDecoder, tokens: torch.Tensor, *, mask: torch.Tensor, input_pos: torch.Tensor
) -> torch.Tensor:
    # An FSDP2 root's forward hooks gather its own parameters (embeddings, norm, output) and
    # arrange their gradient reduction; calling the decoder's parts directly would skip both.
    # With the output layer swapped for an identity, forward returns norm(h). The root keeps
    # its parameters gathered after forward, so the caller's model.output(h) reads the gathered
    # weight and its gradient is reduced with the root's.
    output, chunks = model.output, model.num_output_chunks
    tied = not isinstance(output, nn.Module)  # TiedLinear is a plain attribute
    if tied:
        object.__setattr__(model, "output", _Identity())
    else:
        model.output = _Identity()
    model.num_output_chunks = 0
    try:
        h = model(tokens, mask=mask, input_pos=input_pos)
    finally:
        if tied:
            object.__setattr__(model, "output", output)
        else:
            model.output = output
        model.num_output_chunks = chunks
    # unembed casts to float32: back to the dtype the gathered root computes in (read after the
    # forward: with bf16 masters the sharded parameters are fp32, the gathered ones bf16)
    return h.to(model.tok_embeddings.weight.dtype)


def in_place_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """Attention as a multiply-and-sum over all ``S`` cache columns, for a decode query
    (:func:`decode_attention`) or ``s`` queries per row written anywhere in the cache (speculative
    verification, :meth:`StaticKVCache.row_writes`): the compiler reads the cache in place, where
    SDPA would need the KV heads' expansion copied, the whole cache, every layer, every call.
    q: [B, H, s, D], k/v: [B, H, S, D], mask: [B, s, S]."""
    scale = q.shape[-1] ** -0.5
    scores = (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale  # [B, H, s, S]
    scores = scores.masked_fill(~mask[:, None], -float("inf"))
    weights = torch.softmax(scores, dim=-1)
    out = (weights[..., None] * v.float()[:, :, None, :, :]).sum(-2)  # [B, H, s, D]
    return out.to(q.dtype)


def _update_at_row_columns(cache: nn.Module, cols: torch.Tensor, k_val: torch.Tensor,
                           v_val: torch.Tensor):
    """``KVCache.update`` writing row ``b``'s new columns at ``cols[b]``; ``cache_pos`` unused."""
    B, H, s, D = k_val.shape
    index = cols[:, None, :, None].expand(B, H, s, D)
    cache.k_cache.scatter_(2, index, k_val)
    cache.v_cache.scatter_(2, index, v_val)
    return cache.k_cache, cache.v_cache


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """:func:`decode_attention` for a chunk of ``s`` queries written anywhere in the cache (a
    multi-turn episode's observation, :func:`torchtune_ppo.rollout.turns.extend`): SDPA over
    all ``S`` columns, as the mask says. q: [B, H, s, D], k/v: [B, H, S, D], mask: [B, s, S]."""
    return sdpa(q, k, v, mask[:, None], dropout_p, False)


class StaticKVCache:
    """KV caches of ``batch_size`` rows and ``seq_len`` columns for ``model``, attached on demand.

    Args:
        model (TransformerDecoder): the policy; it must not have caches set up already.
        batch_size (int): rows of the cache.
        seq_len (int): columns of the cache, ``P + T``.
        dtype (torch.dtype): cache dtype.
        device (torch.device): cache device.

    Raises:
        ValueError: if ``model`` already has KV caches.
    """

    def __init__(
        self,
        model: TransformerDecoder,
        *,
        batch_size: int,
        seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if model.caches_are_setup():
            raise ValueError(
                "the model already has KV caches set up; generation owns its own. Call "
                "torchtune.modules.common_utils.delete_kv_caches(model) first."
            )
        self.model = model
        with device:
            model.setup_caches(batch_size, dtype, decoder_max_seq_len=seq_len)
        # Every attention module torchtune gave a cache to.
        self._attn = [m for m in model.modules() if hasattr(m, "kv_cache") and hasattr(m, "cache_enabled")]
        self._caches = [m.kv_cache for m in self._attn]
        self._attention_calls = [m._attention_call for m in self._attn]
        self._cache_pos0 = torch.arange(seq_len, device=device)
        self._detach()

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """The model in eval mode with caches attached, decode attention and plain logits.

        Everything is restored on exit, including each submodule's train/eval mode. Eval mode
        because generation never uses dropout, and a fixed mode keeps compiled guards fixed.
        """
        modes = [(m, m.training) for m in self.model.modules()]
        output_settings = (self.model.num_output_chunks, self.model.output_hidden_states)
        self.model.eval()
        # Plain [B, s, V] logits from forward: no chunked output (a graph break), no hidden states.
        self.model.num_output_chunks, self.model.output_hidden_states = 0, _NO_HIDDEN_STATES
        for attn, cache in zip(self._attn, self._caches):
            attn.kv_cache = cache
            attn.cache_enabled = True
            attn._attention_call = decode_attention
            cache.cache_pos.copy_(self._cache_pos0)  # back to column 0; stale K/V stay masked
        try:
            yield
        finally:
            self._detach()
            self.model.num_output_chunks, self.model.output_hidden_states = output_settings
            for m, training in modes:
                m.training = training

    @contextlib.contextmanager
    def rows_every(self, n: int) -> Iterator[None]:
        """Inside :meth:`decoding`: every cache shows rows ``0, n, 2n, ...`` only (strided views).

        torchtune's ``KVCache.update`` writes a whole ``[b, H, s, D]`` batch into the cache, so a
        prefill of ``B / n`` prompts needs a cache of ``B / n`` rows: these views, swapped in for
        the buffers and swapped back on exit. No memory is allocated.
        """
        full = [(c.k_cache, c.v_cache) for c in self._caches]
        for cache, (k, v) in zip(self._caches, full):
            cache.k_cache, cache.v_cache = k[::n], v[::n]
        try:
            yield
        finally:
            for cache, (k, v) in zip(self._caches, full):
                cache.k_cache, cache.v_cache = k, v

    @contextlib.contextmanager
    def chunk_attention(self) -> Iterator[None]:
        """Inside :meth:`decoding`: attention calls see every cache column
        (:func:`chunk_attention`), for a chunk that does not start at column 0. Only around the
        calls of one region, so each compiled region always sees the same attention."""
        for attn in self._attn:
            attn._attention_call = chunk_attention
        try:
            yield
        finally:
            for attn in self._attn:
                attn._attention_call = decode_attention

    @contextlib.contextmanager
    def row_writes(self, cols: torch.Tensor) -> Iterator[None]:
        """Inside :meth:`decoding`: each cache update writes row ``b``'s ``s`` new columns at
        ``cols[b]`` (``[B, s]``, read when the update runs, so one buffer serves every call),
        where torchtune's update writes every row at the same columns, and attention calls see
        every cache column as the mask says (:func:`in_place_attention`). Speculative verification
        (:mod:`torchtune_ppo.rollout.speculative`) keeps each row at its own length this way."""
        for cache in self._caches:
            cache.update = functools.partial(_update_at_row_columns, cache, cols)
        for attn in self._attn:
            attn._attention_call = in_place_attention
        try:
            yield
        finally:
            for cache in self._caches:
                del cache.update  # back to the class's
            for attn in self._attn:
                attn._attention_call = decode_attention

    def copy_to_group(self, n: int, cols: int) -> None:
        """Copies the first ``cols`` columns of rows ``0, n, 2n, ...`` into the other ``n - 1``
        rows of their group (in place: source and destination rows never overlap)."""
        for cache in self._caches:
            for buf in (cache.k_cache, cache.v_cache):
                groups = buf[:, :, :cols].unflatten(0, (-1, n))  # [G, n, H, cols, D]
                groups[:, 1:].copy_(groups[:, :1])

    def _detach(self) -> None:
        for attn, attention_call in zip(self._attn, self._attention_calls):
            attn.cache_enabled = False
            attn.kv_cache = None
            attn._attention_call = attention_call
