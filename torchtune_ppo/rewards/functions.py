"""The reward-function protocol: how a function of the decoded texts is called and checked.

A reward function scores a batch of decoded (prompt, response) pairs, one float per row::

    def my_reward(prompts: List[str], responses: List[str], *,
                  references: List[Optional[str]],
                  prompt_tokens: List[List[int]],
                  response_tokens: List[List[int]]) -> Sequence[float]: ...

``references`` are the dataset's reference answers (None where a row has none); the token
lists are the ids behind the texts (prompt without padding, response up to but excluding its
first stop token). A function may take ``**kwargs`` for the arguments it does not read.

Configs name one with ``reward: {_component_: ...}``; the component is *called* with the
block's other keys and must return the reward function. The built-ins
(:mod:`torchtune_ppo.rewards.builtins`) are classes whose instances are reward functions::

    reward:
      _component_: torchtune_ppo.rewards.ExactMatch
      extract: last_number

A plain function of your own goes through :func:`from_path`. :class:`FunctionReward` turns
token tensors into texts, calls the function and checks what it returns.
"""

import functools
import inspect
import math
import numbers
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "FunctionReward",
    "RewardFunction",
    "RewardFunctionError",
    "call_reward_fn",
    "check_reward_fn",
    "from_path",
]

# fn(prompts, responses, *, references, prompt_tokens, response_tokens) -> Sequence[float]
RewardFunction = Callable[..., Sequence[float]]

_SHOW = 80  # characters of a prompt or response quoted in an error


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than one finite float per row."""


# --------------------------------------------------------------------------- calling and checks


def _name(fn: Any) -> str:
    """Qualified name of a reward function for messages, e.g. ``my_pkg.rewards.correct``."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_name(fn.func)}, ...)"
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{getattr(fn, '__module__', '?')}.{qualname}"
    cls = type(fn)
    # Built-ins are named by the package that exports them, as configs name them.
    module = "torchtune_ppo.rewards" if cls.__module__.startswith("torchtune_ppo.rewards.") else cls.__module__
    name = f"{module}.{cls.__qualname__}"
    # Built-ins print their settings; a bare object repr only adds an address.
    return f"{module}.{fn!r}" if cls.__repr__ is not object.__repr__ else name


def _quote(text: str) -> str:
    return repr(text if len(text) <= _SHOW else text[:_SHOW] + "...")


def check_reward_fn(fn: Any) -> None:
    """Check that ``fn`` can be called as a reward function, before any batch reaches it.

    Raises:
        TypeError: ``fn`` is not callable, or its signature cannot take
            ``(prompts, responses, *, references, prompt_tokens, response_tokens)``.
    """
    if not callable(fn):
        raise TypeError(
            f"a reward function must be callable, got {fn!r} ({type(fn).__name__}); a config's "
            "reward._component_ must return one (e.g. torchtune_ppo.rewards.ExactMatch)."
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        sig.bind([], [], references=[], prompt_tokens=[], response_tokens=[])
    except TypeError as e:
        raise TypeError(
            f"reward function {_name(fn)}{sig} cannot be called as fn(prompts, responses, *, "
            f"references, prompt_tokens, response_tokens): {e}. Add **kwargs to ignore the "
            "arguments it does not use."
        ) from None


def _as_list(fn: Any, scores: Any, n: int) -> List[Any]:
    if isinstance(scores, torch.Tensor) or type(scores).__module__ == "numpy":
        if getattr(scores, "ndim", None) != 1:
            raise RewardFunctionError(
                f"reward function {_name(fn)} returned an array of shape "
                f"{tuple(scores.shape)}; it must return {n} floats, one per row."
            )
        return scores.tolist()
    if isinstance(scores, (str, bytes, Mapping)) or not isinstance(scores, Sequence):
        raise RewardFunctionError(
            f"reward function {_name(fn)} returned {scores!r} ({type(scores).__name__}); it must "
            f"return a sequence of {n} floats, one per row (list, tuple or 1-D tensor)."
        )
    return list(scores)


def _check_scores(fn: Any, scores: Any, prompts: Sequence[str], responses: Sequence[str]) -> List[float]:
    """One finite float per row, or a :class:`RewardFunctionError` naming ``fn`` and the row."""
    n = len(prompts)
    values = _as_list(fn, scores, n)
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {_name(fn)} returned {len(values)} scores for {n} rows; it must "
            "return one float per row, in the order of the rows."
        )
    out = []
    for i, v in enumerate(values):
        where = f"row {i} (prompt {_quote(prompts[i])}, response {_quote(responses[i])})"
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        # bool is a number in Python: `[answer == ref for ...]` is a fine reward function.
        if not isinstance(v, numbers.Real):
            raise RewardFunctionError(
                f"reward function {_name(fn)} returned {v!r} ({type(v).__name__}) for {where}; "
                "every score must be a number."
            )
        if not math.isfinite(v):
            raise RewardFunctionError(
                f"reward function {_name(fn)} returned {v!r} for {where}; every score must be finite."
            )
        out.append(float(v))
    return out


def call_reward_fn(
    fn: RewardFunction,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    references: Sequence[Optional[str]],
    prompt_tokens: Sequence[Sequence[int]],
    response_tokens: Sequence[Sequence[int]],
) -> List[float]:
    """Call ``fn`` on a batch and return its checked scores, one float per row.

    When ``fn`` raises, it is called again on its first row alone, then on halves of the
    failing rows (the first half first) down to one row, to find the first row that fails
    alone, so the error can show that row: at most ``1 + 2 * ceil(log2(b))`` more calls, only
    on the error path. A function that
    fails only on several rows together (its batch size, say) is reported as such, with the
    smallest failing run of rows found, instead of being retried once per row.

    Raises:
        RewardFunctionError: naming ``fn``, the row and the exception or offending value. An
            error that already is a :class:`RewardFunctionError` (from a nested reward such as
            :class:`~torchtune_ppo.rewards.builtins.WeightedSum`) passes through unchanged: it
            names the innermost function.
    """
    args = dict(references=list(references), prompt_tokens=list(prompt_tokens),
                response_tokens=list(response_tokens))
    try:
        scores = fn(list(prompts), list(responses), **args)
    except RewardFunctionError:
        raise
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {_name(fn)} raised {type(e).__name__} "
            f"{_failing_row(fn, prompts, responses, args)}: {e}"
        ) from e
    return _check_scores(fn, scores, prompts, responses)


def _failing_row(fn, prompts, responses, args) -> str:
    """Where a batch that raised fails: the first row that raises alone, found by halving.

    The first row is tried alone first (a function that fails on every row costs one call).
    Then ``[lo, hi)`` is always a run of rows seen to raise; of its two halves the first that
    raises is kept. One row left: that row raises alone. Both halves pass: the rows raise
    only together, and the search stops there.
    """
    n = len(prompts)

    def raises(lo: int, hi: int) -> bool:
        try:
            fn(list(prompts[lo:hi]), list(responses[lo:hi]), **{k: v[lo:hi] for k, v in args.items()})
        except Exception:
            return True
        return False

    if n == 0:
        return "on an empty batch"
    lo, hi = 0, 1 if raises(0, 1) else n  # a function that fails on every row: 1 call
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if raises(lo, mid):
            hi = mid
        elif raises(mid, hi):
            lo = mid
        elif hi - lo == n == 2:
            return f"on a batch of {n} rows (no row raises when scored alone)"
        else:
            rows = f"rows {lo} and {hi - 1}" if hi - lo == 2 else f"rows {lo} to {hi - 1}"
            alone = "neither alone" if hi - lo == 2 else "neither half of them alone"
            return (f"on a batch of {n} rows ({rows} raise together, {alone}: the failure depends on "
                    "the batch, not on one row)")
    return f"at row {lo} (prompt {_quote(prompts[lo])}, response {_quote(responses[lo])})"


# --------------------------------------------------------------------------- FunctionReward


class FunctionReward:
    """Scores from a reward function of decoded text, as a float32 tensor.

    Args:
        fn (RewardFunction): the reward function (see the module docstring).
        tokenizer (Any): has ``decode(ids: List[int]) -> str``; control tokens such as BOS
            are dropped by the tokenizer's own decode.

    Raises:
        TypeError: ``fn`` cannot be called as a reward function (:func:`check_reward_fn`).
    """

    def __init__(self, fn: RewardFunction, tokenizer: Any) -> None:
        check_reward_fn(fn)
        self.fn, self.tokenizer = fn, tokenizer

    def __call__(
        self,
        prompt_tokens: Sequence[Sequence[int]],
        response_tokens: Sequence[Sequence[int]],
        references: Optional[Sequence[Optional[str]]] = None,
        device: Union[str, torch.device] = "cpu",
    ) -> torch.Tensor:
        """Score ``b`` rows given as token lists (no padding, no stop token).

        Args:
            prompt_tokens (Sequence[Sequence[int]]): each prompt's real tokens.
            response_tokens (Sequence[Sequence[int]]): each response's tokens before its first
                stop token.
            references (Optional[Sequence[Optional[str]]]): reference answers; None: none at all.
            device (Union[str, torch.device]): where the scores go.

        Returns:
            torch.Tensor: float32 scores ``[b]`` on ``device``.

        Raises:
            RewardFunctionError: the function raised or returned bad scores (see :func:`call_reward_fn`).
            ValueError: the three lists differ in length.
        """
        b = len(prompt_tokens)
        references = [None] * b if references is None else list(references)
        if len(response_tokens) != b or len(references) != b:
            raise ValueError(
                f"FunctionReward: {b} prompts, {len(response_tokens)} responses and "
                f"{len(references)} references; give one of each per row."
            )
        prompt_tokens = [list(map(int, t)) for t in prompt_tokens]
        response_tokens = [list(map(int, t)) for t in response_tokens]
        scores = call_reward_fn(
            self.fn,
            [self.tokenizer.decode(t) for t in prompt_tokens],
            [self.tokenizer.decode(t) for t in response_tokens],
            references=references,
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
        )
        return torch.tensor(scores, dtype=torch.float32, device=device)

    def score_batch(
        self,
        query_responses: torch.Tensor,
        prompt_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        references: Optional[Sequence[Optional[str]]],
        *,
        prompt_len: int,
        stop_token_ids: Union[torch.Tensor, Sequence[int]],
    ) -> torch.Tensor:
        """Score the rows of a truncated batch, as in :class:`~torchtune_ppo.rlhf.trajectory.Trajectory`.

        Args:
            query_responses (torch.Tensor): left-padded prompts then truncated responses ``[b, P + T]``.
            prompt_lens (torch.Tensor): real tokens of each prompt ``[b]``.
            seq_lens (torch.Tensor): valid response tokens of each row, stop token included ``[b]``.
            references (Optional[Sequence[Optional[str]]]): one per row, or None.
            prompt_len (int): ``P``.
            stop_token_ids (Union[torch.Tensor, Sequence[int]]): a row's last valid token is
                dropped from its response when it is one of these.

        Returns:
            torch.Tensor: float32 scores ``[b]`` on ``query_responses.device``.
        """
        stops = set(torch.as_tensor(stop_token_ids).tolist())
        rows = query_responses.tolist()  # one device sync for the whole batch
        prompt_lens, seq_lens = prompt_lens.tolist(), seq_lens.tolist()
        prompts = [row[prompt_len - n : prompt_len] for row, n in zip(rows, prompt_lens)]
        responses = []
        for row, n in zip(rows, seq_lens):
            response = row[prompt_len : prompt_len + n]
            responses.append(response[:-1] if response and response[-1] in stops else response)
        return self(prompts, responses, references, device=query_responses.device)


# --------------------------------------------------------------------------- from_path


def from_path(path: str, **kwargs: Any) -> RewardFunction:
    """Reward function given by its import path, with ``kwargs`` bound by ``functools.partial``.

    A config's ``_component_`` is called to build the object, so it cannot name a reward
    function directly (that would call it with no batch). Name it here instead::

        reward:
          _component_: torchtune_ppo.rewards.from_path
          path: my_project.rewards.correct_and_short
          max_words: 20   # passed to correct_and_short on every call

    Args:
        path (str): ``"package.module.function"`` (or a class method, ``module.Class.method``).
        **kwargs (Any): bound to every call.

    Returns:
        RewardFunction: the function, or a partial of it.

    Raises:
        ValueError: nothing importable at ``path`` (the module or name missing, and the names
            close to it).
        TypeError: the function cannot be called as a reward function.
    """
    from torchtune_ppo.config.components import import_component

    obj = import_component(path, "from_path's path")
    fn = functools.partial(obj, **kwargs) if kwargs else obj
    check_reward_fn(fn)
    return fn
