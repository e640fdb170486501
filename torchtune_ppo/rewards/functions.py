"""Rewards computed by Python functions of the decoded text (verifiable rewards).

A reward function scores a batch of decoded (prompt, response) pairs, one float per row::

    def my_reward(prompts: List[str], responses: List[str], *,
                  references: List[Optional[str]],
                  prompt_tokens: List[List[int]],
                  response_tokens: List[List[int]]) -> Sequence[float]: ...

``references`` are the dataset's reference answers (None where a row has none); the token
lists are the ids behind the texts (prompt without padding, response up to but excluding its
first stop token). A function may take ``**kwargs`` for the arguments it does not read.

Configs name one with ``reward: {_component_: ...}``; the component is *called* with the
block's other keys and must return the reward function, so the built-ins are factories::

    reward:
      _component_: torchtune_ppo.rewards.exact_match
      extract: last_number

A plain function of your own goes through :func:`from_path`. :class:`FunctionReward` turns
token tensors into texts, calls the function and checks what it returns.
"""

import functools
import importlib
import inspect
import math
import numbers
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "EXTRACTORS",
    "ExactMatch",
    "FormatMatch",
    "FunctionReward",
    "RewardFunction",
    "RewardFunctionError",
    "WeightedSum",
    "answers_match",
    "call_reward_fn",
    "check_reward_fn",
    "exact_match",
    "extract_answer",
    "format_match",
    "from_path",
    "weighted_sum",
]

# fn(prompts, responses, *, references, prompt_tokens, response_tokens) -> Sequence[float]
RewardFunction = Callable[..., Sequence[float]]

EXTRACTORS = ("last_number", "after_marker", "regex")

# A number as written in text: optional thousands separators and decimals. A minus sign counts
# only when it is not preceded by a word character, so "12-5" reads as 12 and 5, "= -5" as -5.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?:(?<![\w.])-)?\.\d+")
_NUMBER_TEXT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
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
            "reward._component_ must return one (e.g. torchtune_ppo.rewards.exact_match)."
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

    When ``fn`` raises, it is called again on each row alone to find the first row that fails,
    so the error can show that row. This reruns the function only on the error path.

    Raises:
        RewardFunctionError: naming ``fn``, the row and the exception or offending value. An
            error that already is a :class:`RewardFunctionError` (from a nested reward such as
            :class:`WeightedSum`) passes through unchanged: it names the innermost function.
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
    for i in range(len(prompts)):
        try:
            fn([prompts[i]], [responses[i]], **{k: [v[i]] for k, v in args.items()})
        except Exception:
            return f"at row {i} (prompt {_quote(prompts[i])}, response {_quote(responses[i])})"
    return f"on a batch of {len(prompts)} rows (no row raises when scored alone)"


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
        """Score the rows of a truncated batch, as in :class:`~torchtune_ppo.rollout.trajectory.Trajectory`.

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


# --------------------------------------------------------------------------- answers


def extract_answer(
    text: str, extract: str = "last_number", *, marker: str = "####", pattern: Optional[str] = None
) -> Optional[str]:
    """The final answer written in ``text``, or None when there is none.

    Args:
        text (str): a response.
        extract (str): ``"last_number"``: the last number (``-3``, ``1,000``, ``2.5``);
            ``"after_marker"``: the rest of the line after the last ``marker``;
            ``"regex"``: the last match of ``pattern``, its first group if it has one.
        marker (str): for ``"after_marker"``.
        pattern (Optional[str]): for ``"regex"``.

    Returns:
        Optional[str]: the answer text, stripped.
    """
    if extract == "last_number":
        found = _NUMBER.findall(text)
        return found[-1] if found else None
    if extract == "after_marker":
        _, sep, rest = text.rpartition(marker)
        return rest.split("\n")[0].strip() if sep else None
    if extract == "regex":
        matches = list(re.finditer(pattern, text))
        if not matches:
            return None
        m = matches[-1]
        return (m.group(1) if m.re.groups else m.group(0)).strip()
    raise ValueError(f"extract must be one of {list(EXTRACTORS)}, got {extract!r}.")


def _number(text: str) -> Optional[Decimal]:
    text = text.strip().rstrip(".").replace(",", "")
    if not _NUMBER_TEXT.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def answers_match(answer: Optional[str], reference: Optional[str], tolerance: float = 0.0) -> bool:
    """Whether an extracted answer equals the reference.

    Both are stripped (and a trailing period dropped); when both read as numbers they are
    compared as numbers (``"007" == "7" == "7.0"``, within ``tolerance``), otherwise as text
    with runs of whitespace collapsed.
    """
    if answer is None or reference is None:
        return False
    a, r = _number(answer), _number(reference)
    if a is not None and r is not None:
        return abs(a - r) <= Decimal(str(tolerance))
    return " ".join(answer.split()).rstrip(".") == " ".join(str(reference).split()).rstrip(".")


# --------------------------------------------------------------------------- built-ins


class ExactMatch:
    """``reward`` where the extracted answer matches the row's reference, else ``penalty``.

    See :func:`exact_match` for the arguments.
    """

    def __init__(self, extract: str = "last_number", marker: str = "####", pattern: Optional[str] = None,
                 tolerance: float = 0.0, reward: float = 1.0, penalty: float = 0.0) -> None:
        if extract not in EXTRACTORS:
            raise ValueError(
                f"exact_match: extract must be one of {list(EXTRACTORS)}, got {extract!r} "
                "(for a regular expression use extract=regex and pattern=...)."
            )
        if (extract == "regex") != (pattern is not None):
            raise ValueError(
                f"exact_match: pattern is needed with extract=regex and only then; got "
                f"extract={extract!r}, pattern={pattern!r}."
            )
        if extract == "after_marker" and not marker:
            raise ValueError("exact_match: extract=after_marker needs a non-empty marker.")
        if pattern is not None:
            _compile(pattern, "exact_match")
        self.extract, self.marker, self.pattern = extract, marker, pattern
        self.tolerance, self.reward, self.penalty = float(tolerance), float(reward), float(penalty)

    def __call__(self, prompts: List[str], responses: List[str], *,
                 references: List[Optional[str]], **unused: Any) -> List[float]:
        missing = [i for i, r in enumerate(references) if r is None]
        if missing:
            raise ValueError(
                f"exact_match needs a reference answer for every row; rows {missing[:10]} have "
                "none. Set the dataset's reference_column."
            )
        out = []
        for response, reference in zip(responses, references):
            answer = extract_answer(response, self.extract, marker=self.marker, pattern=self.pattern)
            out.append(self.reward if answers_match(answer, reference, self.tolerance) else self.penalty)
        return out

    def __repr__(self) -> str:
        detail = {"after_marker": f", marker={self.marker!r}",
                  "regex": f", pattern={self.pattern!r}"}.get(self.extract, "")
        return f"ExactMatch(extract={self.extract!r}{detail})"


class FormatMatch:
    """``reward`` where the response matches a regular expression, else ``penalty``.

    See :func:`format_match` for the arguments.
    """

    def __init__(self, pattern: str, reward: float = 1.0, penalty: float = 0.0,
                 fullmatch: bool = False) -> None:
        self.pattern, self.regex = pattern, _compile(pattern, "format_match")
        self.reward, self.penalty, self.fullmatch = float(reward), float(penalty), bool(fullmatch)

    def __call__(self, prompts: List[str], responses: List[str], **unused: Any) -> List[float]:
        match = self.regex.fullmatch if self.fullmatch else self.regex.search
        return [self.reward if match(r) else self.penalty for r in responses]

    def __repr__(self) -> str:
        return f"FormatMatch(pattern={self.pattern!r}, fullmatch={self.fullmatch})"


class WeightedSum:
    """``sum_i weights[i] * rewards[i](...)``, each component's scores checked on its own.

    See :func:`weighted_sum` for the arguments.
    """

    def __init__(self, rewards: Sequence[Any], weights: Sequence[float]) -> None:
        rewards, weights = list(rewards), list(weights)
        if not rewards or len(rewards) != len(weights):
            raise ValueError(
                f"weighted_sum: needs as many weights as rewards (at least one); got "
                f"{len(rewards)} rewards and {len(weights)} weights {weights}."
            )
        if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
                   for w in weights):
            raise ValueError(f"weighted_sum: weights must be finite numbers, got {weights}.")
        self.rewards = [_instantiate(r) for r in rewards]
        for r in self.rewards:
            check_reward_fn(r)
        self.weights = [float(w) for w in weights]

    def __call__(self, prompts: List[str], responses: List[str], **kwargs: Any) -> List[float]:
        total = [0.0] * len(prompts)
        for fn, w in zip(self.rewards, self.weights):
            scores = call_reward_fn(fn, prompts, responses, **kwargs)
            total = [t + w * s for t, s in zip(total, scores)]
        return total

    def __repr__(self) -> str:
        return f"WeightedSum({', '.join(f'{w:g} * {r!r}' for r, w in zip(self.rewards, self.weights))})"


def exact_match(extract: str = "last_number", marker: str = "####", pattern: Optional[str] = None,
                tolerance: float = 0.0, reward: float = 1.0, penalty: float = 0.0) -> ExactMatch:
    """Reward function: is the final answer in the response the dataset's reference answer?

    Args:
        extract (str): how to find the answer in the response, see :func:`extract_answer`:
            ``"last_number"``, ``"after_marker"`` or ``"regex"``.
        marker (str): text that precedes the answer, for ``"after_marker"``. Default: ``"####"``
        pattern (Optional[str]): a regular expression, for ``"regex"`` (group 1 if it has one).
        tolerance (float): numbers within this distance match. Default: 0.0
        reward (float): score of a match. Default: 1.0
        penalty (float): score of a mismatch or of a response with no answer. Default: 0.0

    Returns:
        ExactMatch: the reward function. Comparison rules: :func:`answers_match`. A row
        without a reference raises (the error names the rows).

    Raises:
        ValueError: an unknown ``extract``, or ``pattern`` given without ``extract="regex"``
            (or missing with it), or a pattern that does not compile.
    """
    return ExactMatch(extract, marker, pattern, tolerance, reward, penalty)


def format_match(pattern: str, reward: float = 1.0, penalty: float = 0.0,
                 fullmatch: bool = False) -> FormatMatch:
    """Reward function: does the response have the expected form?

    Args:
        pattern (str): a regular expression searched for in the response.
        reward (float): score when it is found. Default: 1.0
        penalty (float): score otherwise. Default: 0.0
        fullmatch (bool): the whole response must match, not just part of it. Default: False

    Returns:
        FormatMatch: the reward function.

    Raises:
        ValueError: the pattern does not compile.
    """
    return FormatMatch(pattern, reward, penalty, fullmatch)


def weighted_sum(rewards: Sequence[Any], weights: Sequence[float]) -> WeightedSum:
    """Reward function: a weighted sum of other reward functions.

    torchtune's ``config.instantiate`` does not build nested components, so each entry of
    ``rewards`` may be a reward function or a ``{_component_: ..., ...}`` mapping, built here::

        reward:
          _component_: torchtune_ppo.rewards.weighted_sum
          rewards:
            - {_component_: torchtune_ppo.rewards.exact_match}
            - {_component_: torchtune_ppo.rewards.format_match, pattern: '^-?\\d+$'}
          weights: [1.0, 0.1]

    Args:
        rewards (Sequence[Any]): reward functions or component mappings.
        weights (Sequence[float]): one finite weight per reward.

    Returns:
        WeightedSum: the reward function.

    Raises:
        ValueError: lengths differ, or a weight is not a finite number.
        TypeError: a component is not a usable reward function.
    """
    return WeightedSum(rewards, weights)


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
        ValueError: nothing importable at ``path``.
        TypeError: the function cannot be called as a reward function.
    """
    parts = path.split(".")
    obj = None
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module + ".").startswith(e.name + "."):
                continue  # `module` is not a module: try a shorter prefix
            raise  # the module exists but fails to import: show its own error
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            obj = None
        break
    if obj is None:
        raise ValueError(f"from_path: cannot import {path!r}; give 'package.module.function'.")
    fn = functools.partial(obj, **kwargs) if kwargs else obj
    check_reward_fn(fn)
    return fn


def _compile(pattern: str, who: str) -> "re.Pattern":
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{who}: pattern {pattern!r} is not a valid regular expression: {e}.") from None


def _instantiate(reward: Any) -> Any:
    if isinstance(reward, Mapping) and "_component_" in reward:
        from omegaconf import OmegaConf
        from torchtune import config

        return config.instantiate(OmegaConf.create(dict(reward)))
    return reward
