"""Exact speculative rollouts: a response sampled before for the same prompt is a draft that one
teacher-forced forward checks, and the tokens kept are the ones plain decoding would sample.

**Position-keyed noise.** The sampler is the exponential race (``argmax(p / E)``,
:func:`~torchtune_ppo.rollout.sampling.sample`). With ``noise_keys`` the draws ``E`` of a row at
response position ``t`` come from a generator seeded by ``mix(key, t)`` alone
(:func:`keyed_noise`), not by how many draws came before. The token plain decoding picks at
``t`` is then a function of that position's logits only, and a draft of ``k`` tokens is
verified by one forward over them: at each position take the race's winner with that
position's noise, keep it while it equals the draft's next token, and at the first difference
the winner is the next token, as plain decoding would have sampled it. Whatever the draft, the
response is plain decoding's, token for token, up to the float rounding of the logits (a chunk
forward and a one-token forward round differently): a wrong draft costs time, never correctness.

**The key of a row** (:func:`row_keys`): the run's seed, a round (the step by default, so
each visit of a prompt draws afresh; ``noise: per_prompt`` keeps one round for the whole run,
so an unchanged policy gives a prompt's last response back and the draft is accepted whole),
the prompt's tokens (its identity, whatever its index or the process that holds it) and the
row's sample index among the rows of the call with that prompt (a group's ``n`` samples).

**Verification in the static KV cache** (:func:`verify`): every row writes its chunk at its own
cache columns (``P + n - 1 ...``, :meth:`StaticKVCache.row_writes`), the columns its plain
decoding would write, so a rejected column is simply written again by the next chunk; the mask
opens a row's columns up to each query. Shapes are fixed by the chunk width, so a compiled
region compiles once whatever the acceptance.

**Drafts** (:class:`DraftStore`): the last response sampled for each (prompt, sample index),
bounded in prompts, saved in the checkpoint; or a user's drafter (:class:`Speculation`'s
``drafter``), whose drafts are checked against the model like any other.
"""

import collections
import hashlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torchtune.modules import TransformerDecoder

from torchtune_ppo._patches.torchtune_modules import final_hidden_states
from torchtune_ppo.rollout.sampling import sample

__all__ = ["DraftStore", "Speculation", "SpeculativeStats", "speculative_args", "keyed_noise", "mix64", "row_keys", "verify", "verify_one"]

_MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64's finaliser over each value in turn)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def prompt_digest(tokens: Sequence[int]) -> int:
    """A prompt's identity: 64 bits of the sha256 of its real tokens."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def real_prompts(prompts: torch.Tensor, prompt_lens: torch.Tensor) -> List[List[int]]:
    """Each left-padded row's prompt tokens, padding left out."""
    P = prompts.shape[1]
    return [row[P - int(n):] if n else [] for row, n in zip(prompts.tolist(), prompt_lens.tolist())]


def row_keys(prompts: torch.Tensor, prompt_lens: torch.Tensor, *, seed: int, round: int
             ) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Each row's noise key and its draft key ``(prompt digest, sample index)``.

    The sample index counts the earlier rows of the call that hold the same prompt, so a group's
    ``n`` copies get ``0 .. n-1`` wherever the group sits.
    """
    seen: Dict[int, int] = collections.Counter()
    keys, ids = [], []
    for tokens in real_prompts(prompts, prompt_lens):
        digest = prompt_digest(tokens)
        index = seen[digest]
        seen[digest] += 1
        ids.append((digest, index))
        keys.append(mix64(seed, round, digest, index))
    return keys, ids


def keyed_noise(out: torch.Tensor, keys: Sequence[int], positions: Sequence[Sequence[int]],
                generator: torch.Generator) -> torch.Tensor:
    """Fills ``out [B, K, W]`` (float32) with Exponential(1) draws: row ``b``, chunk column ``j``
    from ``generator`` seeded with ``mix64(keys[b], positions[b][j])``.

    ``generator`` is scratch (its state is overwritten), on ``out``'s device. The draws are
    ``-log1p(-u)`` of float64 uniforms, as :func:`~torchtune_ppo.rollout.sampling.exponential_noise`
    draws them on the CPU (0 only when ``u == 0``, 2**-53). torch's CPU generator keeps 32 bits
    of a seed, its CUDA generator 64: the same key draws differently on the two devices.
    """
    u = torch.empty(out.shape, dtype=torch.float64, device=out.device)
    for b, key in enumerate(keys):
        for j, t in enumerate(positions[b]):
            generator.manual_seed(mix64(key, t))
            u[b, j].uniform_(generator=generator)
    return out.copy_(torch.log1p(u.neg_(), out=u)).neg_()


def verify(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One forward over a chunk of ``K`` tokens per row and the race's winner at every position.

    Run inside :meth:`StaticKVCache.row_writes`: each row's chunk goes to its own columns, and
    attention reads every column the mask opens.

    Args:
        model (TransformerDecoder): model with KV caches enabled.
        tokens (torch.Tensor): ``[B, K]``: each row's last sampled token, then its draft.
        input_pos (torch.Tensor): ``[B, K]`` position ids.
        mask (torch.Tensor): ``[B, K, S]`` bool, the cache columns each chunk token attends.
        noise (Optional[torch.Tensor]): ``[B, K, W]`` the Exponential(1) draws of the positions
            the chunk's logits predict; None when greedy.
        temperature, top_k, top_p: see :func:`~torchtune_ppo.rollout.sampling.sample`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``[B, K]`` winners and their ``[B, K]`` logprobs.
    """
    return _winners(model, tokens, input_pos, mask, noise, temperature=temperature, top_k=top_k, top_p=top_p)


# A separate function on purpose: compiled, each of verify and verify_one keeps its own graph
# ([B, K] chunks and [B, 1] tokens), so neither recompiles for the other.
def verify_one(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    input_pos: torch.Tensor,
    mask: torch.Tensor,
    noise: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` of one token per row (``tokens [B, 1]``): a decode step at each row's own
    cache column, once no row has a draft left."""
    return _winners(model, tokens, input_pos, mask, noise, temperature=temperature, top_k=top_k, top_p=top_p)


def _winners(model, tokens, input_pos, mask, noise, **sampling) -> Tuple[torch.Tensor, torch.Tensor]:
    B, K = tokens.shape
    h = final_hidden_states(model, tokens, mask=mask, input_pos=input_pos)  # [B, K, D]
    logits = model.output(h).float().flatten(0, 1)  # [B * K, V]
    token, logprob = sample(logits, None if noise is None else noise.flatten(0, 1), **sampling)
    return token.view(B, K), logprob.view(B, K)


class SpeculativeStats:
    """What speculation did in the calls since :meth:`reset`, for the metric log."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.draft_tokens = 0  # draft tokens offered to a verification forward
        self.accepted = 0  # of them, kept
        self.verify_forwards = 0  # chunk forwards (K > 1)
        self.decode_forwards = 0  # one-token forwards
        self.tokens = 0  # response tokens the forwards produced, rows still going
        self.rows_with_draft = 0
        self.rows = 0
        self.forwards_saved = 0  # decode forwards plain decoding would have run, less those run

    def count_plain(self, tokens: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """Counts a call of plain decoding: ``tokens [b, T]`` as sampled, stop tokens and after."""
        stop = torch.isin(tokens, stop_ids)
        lengths = torch.where(stop.any(-1), stop.float().argmax(-1) + 1, tokens.shape[1])  # through the stop
        longest = int(lengths.max())
        self.rows += tokens.shape[0]
        self.decode_forwards += longest - 1
        self.tokens += int(lengths.sum()) - tokens.shape[0]

    def metrics(self) -> Dict[str, float]:
        forwards = self.verify_forwards + self.decode_forwards
        return {
            "spec/acceptance": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "spec/rows_with_draft": self.rows_with_draft / self.rows if self.rows else 0.0,
            "spec/forwards": float(forwards),
            "spec/verify_forwards": float(self.verify_forwards),
            "spec/tokens_per_forward": self.tokens / forwards if forwards else 0.0,
            "spec/forwards_saved": float(self.forwards_saved),
        }


class DraftStore:
    """The last response sampled for each (prompt, sample index): bounded in prompts (the oldest
    entries go first), part of the checkpoint.

    Args:
        max_entries (int): (prompt, sample index) pairs kept.
    """

    def __init__(self, max_entries: int = 65536) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"speculative.max_stored={max_entries!r} is invalid; expected an int >= 1.")
        self.max_entries = max_entries
        self._entries: "collections.OrderedDict[Tuple[int, int], torch.Tensor]" = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Tuple[int, int]) -> Optional[torch.Tensor]:
        return self._entries.get(key)

    def put(self, key: Tuple[int, int], response: torch.Tensor) -> None:
        """Stores ``response`` (1-D, the valid tokens) as ``key``'s draft, the newest entry."""
        self._entries.pop(key, None)
        self._entries[key] = response.detach().to("cpu", torch.int32).clone()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def state_dict(self) -> Dict[str, Any]:
        keys = list(self._entries)
        lens = [len(v) for v in self._entries.values()]
        flat = torch.cat(list(self._entries.values())) if keys else torch.zeros(0, dtype=torch.int32)
        signed = [[_signed(d), i] for d, i in keys]  # 64-bit digests as int64 (two's complement)
        return {"keys": torch.tensor(signed, dtype=torch.long).view(-1, 2),
                "lens": torch.tensor(lens, dtype=torch.long), "tokens": flat}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._entries.clear()
        keys = state["keys"].tolist()
        for key, tokens in zip(keys, state["tokens"].split(state["lens"].tolist())):
            self._entries[(int(key[0]) & _MASK64, int(key[1]))] = tokens.clone()


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def speculative_args(cfg: Any) -> Dict[str, Any]:
    """The generator's ``draft_tokens`` (``speculative.max_draft_tokens`` when drafts are on,
    else 0) and ``min_draft_rows`` for the config."""
    block = cfg.speculative
    on = block.enabled and block.draft != "none"
    return dict(draft_tokens=int(block.max_draft_tokens) if on else 0, min_draft_rows=float(block.min_draft_rows))


class Speculation:
    """What a :class:`~torchtune_ppo.rollout.rollout.Rollout` needs for speculative rollouts:
    each row's noise key and draft, and the store of last responses.

    Args:
        seed (int): the run's seed.
        draft (str): ``previous`` (the store's drafts), ``ngram`` (prompt lookup: what followed
            the row's last tokens earlier in its prompt and response), ``drafter`` (``drafter``'s)
            or ``none`` (keyed noise only).
        noise (str): ``per_step`` (the round is the step) or ``per_prompt`` (round 0 always).
        max_stored (int): the store's bound, see :class:`DraftStore`.
        drafter (Optional[Callable]): with ``draft="drafter"``: called as ``drafter(prompts,
            sample_indices)`` (each row's prompt tokens, a list of int lists, and its sample index
            among the step's rows with that prompt), it returns one draft per row: a sequence of
            token ids, or None. Optional methods: ``record(prompts, sample_indices, responses)``
            (each row's sampled response tokens, stop token included) and ``state_dict()`` /
            ``load_state_dict(state)`` (saved with the run's checkpoints).
    """

    def __init__(self, *, seed: int, draft: str = "previous", noise: str = "per_step",
                 max_stored: int = 65536, drafter: Optional[Any] = None) -> None:
        if draft not in ("previous", "ngram", "drafter", "none") or noise not in ("per_step", "per_prompt"):
            raise ValueError(f"Speculation: draft={draft!r} must be previous, ngram, drafter or none, "
                             f"noise={noise!r} per_step or per_prompt.")
        if (draft == "drafter") != (drafter is not None):
            raise ValueError("Speculation: a drafter is given with draft='drafter' and only then.")
        if drafter is not None and not callable(drafter):
            raise TypeError(f"speculative.drafter: {type(drafter).__name__} is not callable; a drafter is called "
                            "as drafter(prompts, sample_indices) and returns one draft (token ids or None) per row.")
        self.seed, self.draft, self.noise, self.drafter = int(seed), draft, noise, drafter
        self.store = DraftStore(max_stored)

    @classmethod
    def from_config(cls, cfg: Any, seed: int) -> Optional["Speculation"]:
        """From the ``speculative`` block; None when it is off."""
        block = cfg.speculative
        if not block.enabled:
            return None
        drafter = None
        if block.get("drafter") is not None:
            from torchtune import config as tt_config

            drafter = tt_config.instantiate(block.drafter)
        return cls(seed=seed, draft=block.draft, noise=block.noise, max_stored=block.max_stored, drafter=drafter)

    def keys(self, prompts: torch.Tensor, prompt_lens: torch.Tensor, step: int
             ) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Noise keys and draft keys of a step's rows (the whole batch at once, so that repeated
        prompts get their sample indices however the batch is chunked)."""
        return row_keys(prompts, prompt_lens, seed=self.seed, round=step if self.noise == "per_step" else 0)

    def drafts(self, ids: Sequence[Tuple[int, int]], prompts: Optional[Sequence[List[int]]] = None,
               vocab_size: Optional[int] = None) -> Optional[List[Optional[List[int]]]]:
        """Each row's draft (None: none), or None when drafts are off. ``prompts`` (each row's
        prompt tokens) and ``vocab_size`` (what a drafter's tokens are checked against) are for
        ``draft="drafter"``."""
        if self.draft == "none":
            return None
        if self.draft == "ngram":  # no stored drafts: the generator looks the row's own tokens up
            return [None] * len(ids)
        if self.draft == "drafter":
            if prompts is None:
                raise ValueError("Speculation.drafts: draft='drafter' needs each row's prompt tokens.")
            return _checked_drafts(self.drafter(list(prompts), [i for _, i in ids]), len(ids), vocab_size)
        found = [self.store.get(i) for i in ids]
        return [None if d is None else d.tolist() for d in found]

    def record(self, ids: Sequence[Tuple[int, int]], responses: torch.Tensor, valid: torch.Tensor,
               prompts: Optional[Sequence[List[int]]] = None) -> None:
        """Keeps each row's valid response tokens as its next draft (``previous``), or shows them
        to a drafter that has a ``record`` method (with each row's prompt tokens)."""
        if self.draft == "drafter":
            record = getattr(self.drafter, "record", None)
            if record is not None:
                record(list(prompts), [i for _, i in ids],
                       [row[:n].tolist() for row, n in zip(responses.cpu(), valid.tolist())])
            return
        if self.draft != "previous":
            return
        for i, row, n in zip(ids, responses.cpu(), valid.tolist()):
            self.store.put(i, row[:n])

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"store": self.store.state_dict()}
        if hasattr(self.drafter, "state_dict"):
            state["drafter"] = self.drafter.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.store.load_state_dict(state["store"])
        if state.get("drafter") is not None and hasattr(self.drafter, "load_state_dict"):
            self.drafter.load_state_dict(state["drafter"])


def _checked_drafts(drafts: Any, rows: int, vocab_size: Optional[int]) -> List[Optional[List[int]]]:
    """A drafter's answer as lists of token ids, one per row, or a message naming what is wrong."""
    what = "speculative.drafter must return one draft per row (a sequence of token ids, or None)"
    if isinstance(drafts, (str, bytes, torch.Tensor)) or not isinstance(drafts, Sequence) or len(drafts) != rows:
        got = (f"{len(drafts)} items" if isinstance(drafts, Sequence) and not isinstance(drafts, (str, bytes))
               else type(drafts).__name__)
        raise ValueError(f"{what}: {rows} rows, got {got}.")
    out: List[Optional[List[int]]] = []
    for r, d in enumerate(drafts):
        if d is None:
            out.append(None)
            continue
        tokens = d.tolist() if hasattr(d, "tolist") else d  # a tensor or an array
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{what}: row {r}'s draft is {type(d).__name__} {str(d)[:60]}, not token ids.")
        bad = [t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(f"{what}: row {r}'s draft has token id {bad[0]}, outside the vocabulary "
                             f"(0 .. {vocab_size - 1 if vocab_size else 'n'}).")
        out.append(list(tokens))
    return out
