"""A calculator tool: the policy writes an expression in its turn, the environment answers its value.

The expression is parsed with :mod:`ast` and evaluated node by node over a fixed set of
operators on int and float literals; nothing of the policy's text is ever passed to
``eval``. A bad expression is not an exception but an observation (``"error: ..."``), so the
policy sees it and can try again.
"""

import ast
import math
import operator
import re
from typing import Callable, Dict, Type, Union

from torchtune_ppo.envs.base import Conversation, EnvStep

__all__ = ["Calculator", "evaluate"]

Number = Union[int, float]

MAX_EXPRESSION_CHARS = 1000  # bounds the parse and the evaluator's recursion
DECIMALS = 6  # float results are rounded to this many decimals
_LITERAL = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")  # no 0x, 1_000 or 1j

_BINARY: Dict[Type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Dict[Type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED = {  # what the policy is told for the nodes it is most likely to try
    ast.Name: "names are not allowed", ast.Call: "function calls are not allowed",
    ast.Attribute: "attributes are not allowed", ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "boolean operators are not allowed", ast.Subscript: "indexing is not allowed",
    ast.Tuple: "write one expression (no commas)",
}


def _check_size(value: Number, max_digits: int) -> Number:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result too large")
    if abs(value) >= 10 ** max_digits:
        raise ValueError(f"too large: more than {max_digits} digits")
    return value


def _power(base: Number, exponent: Number, max_digits: int) -> Number:
    """``base ** exponent``, refused before computing when the result would be too long."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= max_digits:
        raise ValueError(f"too large: more than {max_digits} digits")
    return base ** exponent


def _eval(node: ast.AST, source: str, max_digits: int) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body, source, max_digits)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("only numbers are allowed")
        if not _LITERAL.fullmatch(ast.get_source_segment(source, node) or ""):
            raise ValueError(f"not a plain number: {ast.get_source_segment(source, node)}")
        return _check_size(value, max_digits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_eval(node.operand, source, max_digits)), max_digits)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, source, max_digits), _eval(node.right, source, max_digits)
        try:
            if isinstance(node.op, ast.Pow):
                value = _power(left, right, max_digits)
            else:
                value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        return _check_size(value, max_digits)
    reason = next((r for t, r in _REFUSED.items() if isinstance(node, t)), None)
    raise ValueError(reason or f"{type(node).__name__} is not allowed")


def _format(value: Number) -> str:
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    text = f"{value:.{DECIMALS}f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def evaluate(expression: str, max_digits: int = 64) -> str:
    """The value of an arithmetic expression, as text.

    Numbers are int and decimal literals; the operators ``+ - * / // % **``, unary ``+`` and
    ``-``, and parentheses. Integers stay exact; a float is written rounded to 6 decimals
    without trailing zeros, and as an integer when it is one (``"12.0"`` -> ``"12"``).

    Args:
        expression (str): e.g. ``"(12 + 7) * -3"``.
        max_digits (int): refuse any value (the result or a step to it) with more digits than
            this; a power is refused before it is computed.

    Returns:
        str: e.g. ``"-57"``.

    Raises:
        ValueError: a short reason: a syntax error, anything but numbers and those operators
            (names, calls, attributes, strings, comparisons), division by zero, a result too
            large.
    """
    source = " ".join(expression.split())  # a call may span lines; whitespace means nothing here
    if not source:
        raise ValueError("empty expression")
    if len(source) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None
    try:
        return _format(_eval(tree, source, max_digits))
    except RecursionError:
        raise ValueError("expression nested too deeply") from None


class Calculator:
    """An environment that evaluates the last calculator call of each assistant turn.

    A turn with no call is the answer: the episode is done. A turn with calls gets the value of
    the last one as the next tool turn's text (or ``"error: <reason>"``, which the policy can
    read and retry), truncated to ``max_result_chars``. No reward: score the final answer
    with the run's reward.

    For a chat model (the default pattern): ``"...so I need <calc>347 * 29</calc>"`` -> ``"10063"``.

    For the tiny arithmetic task, whose policy writes only digits, ``+``, ``-`` and ``=``, a
    turn that is a bare expression (two numbers or more, no ``=``) is the call and the
    observation is written back as ``=<value>`` (the rollout's ``turns.observation_template``,
    which replaces the chat template), so that ``12+7`` reads ``12+7=19``::

        Calculator(call_pattern=r"^(-?[0-9]+(?:[-+][0-9]+)+)$")
        turns.observation_template: "={observation}"

    A turn of one number (``19``, ``-7``) has no operator, is no call, and ends the episode as
    the answer.

    Args:
        call_pattern (str): a regular expression (matched with ``re.DOTALL``) whose first
            group is the expression. Default: ``<calc>(.*?)</calc>``
        max_digits (int): see :func:`evaluate`. Default: 64
        max_result_chars (int): the observation is cut to this many characters. Default: 64

    Raises:
        ValueError: ``call_pattern`` is not a valid regular expression or has no group;
            ``max_digits`` or ``max_result_chars`` is not positive.
    """

    def __init__(self, call_pattern: str = r"<calc>(.*?)</calc>", max_digits: int = 64,
                 max_result_chars: int = 64):
        try:
            self._pattern = re.compile(call_pattern, re.DOTALL)
        except (re.error, TypeError) as e:
            raise ValueError(f"call_pattern={call_pattern!r} is not a regular expression: {e}") from None
        if self._pattern.groups < 1:
            raise ValueError(f"call_pattern={call_pattern!r} has no capture group: put the expression "
                             r"in one, e.g. '<calc>(.*?)</calc>'.")
        for key, value in (("max_digits", max_digits), ("max_result_chars", max_result_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: must be a positive integer.")
        self.call_pattern = call_pattern
        self.max_digits = max_digits
        self.max_result_chars = max_result_chars

    def step(self, conversation: Conversation, turn: str) -> EnvStep:
        """See :class:`Calculator`."""
        calls = list(self._pattern.finditer(turn))
        if not calls:
            return EnvStep(None)
        expression = calls[-1].group(1) or ""
        try:
            text = evaluate(expression, self.max_digits)
        except ValueError as e:
            text = f"error: {e}"
        return EnvStep(text[: self.max_result_chars])
