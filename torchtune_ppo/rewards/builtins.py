"""Built-in reward functions: answer extraction and comparison, exact match, format match and
a weighted sum of rewards.

Each built-in is a class whose instances are reward functions (see
:mod:`torchtune_ppo.rewards.functions`), so a config names the class as its component::

    reward:
      _component_: torchtune_ppo.rewards.ExactMatch
      extract: last_number
"""

import math
import numbers
import re
from decimal import Decimal, InvalidOperation
from typing import Any, List, Mapping, Optional, Sequence

from torchtune_ppo.rewards.functions import call_reward_fn, check_reward_fn

__all__ = ["EXTRACTORS", "ExactMatch", "FormatMatch", "WeightedSum", "answers_match", "extract_answer"]

EXTRACTORS = ("last_number", "after_marker", "regex")

# A number as written in text: optional thousands separators and decimals. A minus sign counts
# only when it is not preceded by a word character, so "12-5" reads as 12 and 5, "= -5" as -5.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?:(?<![\w.])-)?\.\d+")
_NUMBER_TEXT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")


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
    """Reward function: is the final answer in the response the dataset's reference answer?

    Scores ``reward`` where the extracted answer matches the row's reference (comparison rules:
    :func:`answers_match`), else ``penalty``. A row without a reference raises (the error
    names the rows).

    Args:
        extract (str): how to find the answer in the response, see :func:`extract_answer`:
            ``"last_number"``, ``"after_marker"`` or ``"regex"``. Default: ``"last_number"``
        marker (str): text that precedes the answer, for ``"after_marker"``. Default: ``"####"``
        pattern (Optional[str]): a regular expression, for ``"regex"`` (group 1 if it has one).
        tolerance (float): numbers within this distance match. Default: 0.0
        reward (float): score of a match. Default: 1.0
        penalty (float): score of a mismatch or of a response with no answer. Default: 0.0

    Raises:
        ValueError: an unknown ``extract``, or ``pattern`` given without ``extract="regex"``
            (or missing with it), an empty ``marker`` with ``"after_marker"``, or a pattern
            that does not compile.
    """

    def __init__(self, extract: str = "last_number", marker: str = "####", pattern: Optional[str] = None,
                 tolerance: float = 0.0, reward: float = 1.0, penalty: float = 0.0) -> None:
        if extract not in EXTRACTORS:
            raise ValueError(
                f"ExactMatch: extract must be one of {list(EXTRACTORS)}, got {extract!r} "
                "(for a regular expression use extract=regex and pattern=...)."
            )
        if (extract == "regex") != (pattern is not None):
            raise ValueError(
                f"ExactMatch: pattern is needed with extract=regex and only then; got "
                f"extract={extract!r}, pattern={pattern!r}."
            )
        if extract == "after_marker" and not marker:
            raise ValueError("ExactMatch: extract=after_marker needs a non-empty marker.")
        if pattern is not None:
            _compile(pattern, "ExactMatch")
        self.extract, self.marker, self.pattern = extract, marker, pattern
        self.tolerance, self.reward, self.penalty = float(tolerance), float(reward), float(penalty)

    def __call__(self, prompts: List[str], responses: List[str], *,
                 references: List[Optional[str]], **unused: Any) -> List[float]:
        missing = [i for i, r in enumerate(references) if r is None]
        if missing:
            raise ValueError(
                f"ExactMatch needs a reference answer for every row; rows {missing[:10]} have "
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
    """Reward function: does the response have the expected form?

    Scores ``reward`` where ``pattern`` is found in the response (matches all of it with
    ``fullmatch``), else ``penalty``.

    Args:
        pattern (str): a regular expression searched for in the response.
        reward (float): score when it is found. Default: 1.0
        penalty (float): score otherwise. Default: 0.0
        fullmatch (bool): the whole response must match, not just part of it. Default: False

    Raises:
        ValueError: the pattern does not compile.
    """

    def __init__(self, pattern: str, reward: float = 1.0, penalty: float = 0.0,
                 fullmatch: bool = False) -> None:
        self.pattern, self.regex = pattern, _compile(pattern, "FormatMatch")
        self.reward, self.penalty, self.fullmatch = float(reward), float(penalty), bool(fullmatch)

    def __call__(self, prompts: List[str], responses: List[str], **unused: Any) -> List[float]:
        match = self.regex.fullmatch if self.fullmatch else self.regex.search
        return [self.reward if match(r) else self.penalty for r in responses]

    def __repr__(self) -> str:
        return f"FormatMatch(pattern={self.pattern!r}, fullmatch={self.fullmatch})"


class WeightedSum:
    """Reward function: ``sum_i weights[i] * rewards[i](...)``, each component's scores checked
    on its own (an error names the component that failed).

    torchtune's ``config.instantiate`` does not build nested components, so each entry of
    ``rewards`` may be a reward function or a ``{_component_: ..., ...}`` mapping, built here::

        reward:
          _component_: torchtune_ppo.rewards.WeightedSum
          rewards:
            - {_component_: torchtune_ppo.rewards.ExactMatch}
            - {_component_: torchtune_ppo.rewards.FormatMatch, pattern: '^-?\\d+$'}
          weights: [1.0, 0.1]

    Args:
        rewards (Sequence[Any]): reward functions or component mappings.
        weights (Sequence[float]): one finite weight per reward.

    Raises:
        ValueError: lengths differ, or a weight is not a finite number.
        TypeError: a component is not a usable reward function.
    """

    def __init__(self, rewards: Sequence[Any], weights: Sequence[float]) -> None:
        rewards, weights = list(rewards), list(weights)
        if not rewards or len(rewards) != len(weights):
            raise ValueError(
                f"WeightedSum: needs as many weights as rewards (at least one); got "
                f"{len(rewards)} rewards and {len(weights)} weights {weights}."
            )
        if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
                   for w in weights):
            raise ValueError(f"WeightedSum: weights must be finite numbers, got {weights}.")
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
