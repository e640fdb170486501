"""Function rewards: answer extraction and comparison, the built-ins, building them from YAML,
and FunctionReward's decoding and error messages."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config

import torchtune_ppo.rewards as rewards
from torchtune_ppo.rewards import (
    ExactMatch,
    FormatMatch,
    FunctionReward,
    RewardFunctionError,
    WeightedSum,
    answers_match,
    extract_answer,
)

BOS, EOS, PAD = 1, 2, 0


class CharTokenizer:
    """ids 3.. are characters; decode drops BOS/EOS like SentencePiece's control pieces."""

    chars = "0123456789+-=. abcdefghijklmnopqrstuvwxyz#"

    def encode(self, text, add_bos=True, add_eos=False):
        return [BOS] * add_bos + [3 + self.chars.index(c) for c in text] + [EOS] * add_eos

    def decode(self, ids):
        return "".join(self.chars[i - 3] for i in ids if i >= 3)


TOK = CharTokenizer()


def _call(fn, responses, references=None, prompts=None):
    n = len(responses)
    return fn(prompts or ["p"] * n, responses, references=references or [None] * n,
              prompt_tokens=[[]] * n, response_tokens=[[]] * n)


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text,expected", [
    ("19", "19"),
    ("the answer is 42.", "42"),
    ("12-5=7", "7"),
    ("3-4", "4"),          # a minus after a digit is subtraction, not a sign
    ("-5", "-5"),
    ("x = -5", "-5"),
    ("=-12", "-12"),
    ("007", "007"),
    ("1,000 apples", "1,000"),
    ("it costs 2.5 now", "2.5"),
    ("first 3 then 8", "8"),
    ("no digits here", None),
    ("", None),
])
def test_last_number(text, expected):
    assert extract_answer(text, "last_number") == expected


def test_after_marker_and_regex():
    assert extract_answer("so 5 + 3 #### 8", "after_marker") == "8"
    assert extract_answer("#### 1\n#### 2 \nmore", "after_marker") == "2"  # the last marker, its line
    assert extract_answer("Answer: forty two", "after_marker", marker="Answer:") == "forty two"
    assert extract_answer("no marker 7", "after_marker") is None
    assert extract_answer(r"\boxed{3} then \boxed{ 4 }", "regex", pattern=r"\\boxed\{([^}]*)\}") == "4"
    assert extract_answer("a1 b22", "regex", pattern=r"b\d+") == "b22"  # no group: whole match
    assert extract_answer("nothing", "regex", pattern=r"\d") is None


@pytest.mark.parametrize("answer,reference,match", [
    ("007", "7", True),
    ("7.0", "7", True),
    ("7.", "7", True),
    ("-7", "7", False),
    ("-0", "0", True),
    ("1,000", "1000", True),
    ("+3", "3", True),
    (None, "7", False),
    ("7", None, False),
    ("forty  two ", "forty two", True),
    ("Forty two", "forty two", False),
    ("7", "seven", False),
])
def test_answers_match(answer, reference, match):
    assert answers_match(answer, reference) is match


def test_tolerance():
    assert answers_match("3.14", "3.14159", tolerance=0.01)
    assert not answers_match("3.14", "3.14159")


# --------------------------------------------------------------------------- built-ins


def test_exact_match_last_number():
    fn = ExactMatch()
    responses = ["19", "the sum is 19.", "18", "", "-7", "7", "019", "19 or 20"]
    refs = ["19", "19", "19", "19", "-7", "-7", "19", "19"]
    assert _call(fn, responses, refs) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_exact_match_marker_regex_and_values():
    fn = ExactMatch("after_marker", reward=2.0, penalty=-1.0)
    assert _call(fn, ["x #### 072", "x #### 71", "72"], ["72", "72", "72"]) == [2.0, -1.0, -1.0]
    fn = ExactMatch("regex", pattern=r"answer is (\S+)")
    assert _call(fn, ["the answer is 5", "the answer is 6", "5"], ["5", "5", "5"]) == [1.0, 0.0, 0.0]


def test_exact_match_needs_references():
    with pytest.raises(ValueError, match=r"rows \[1\] have none.*reference_column"):
        _call(ExactMatch(), ["1", "2"], ["1", None])


@pytest.mark.parametrize("kwargs,match", [
    (dict(extract="last_numbr"), "extract must be one of"),
    (dict(extract=r"\d+"), "extract=regex and pattern"),
    (dict(extract="regex"), "pattern is needed"),
    (dict(pattern=r"\d"), "pattern is needed"),
    (dict(extract="regex", pattern="(unclosed"), "not a valid regular expression"),
    (dict(extract="after_marker", marker=""), "non-empty marker"),
])
def test_exact_match_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExactMatch(**kwargs)


def test_format_match():
    assert _call(FormatMatch(r"^-?\d+$"), ["19", "19 apples", "-3", ""]) == [1.0, 0.0, 1.0, 0.0]
    assert _call(FormatMatch(r"\d+", fullmatch=True, reward=0.5, penalty=-0.5), ["12", "a12"]) == [0.5, -0.5]
    # without fullmatch the pattern is searched for anywhere, not only at the start
    assert _call(FormatMatch(r"<answer>\d+</answer>"), ["so <answer>7</answer>", "<answer>7</answer>", "7"]) == [
        1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="FormatMatch: pattern '\\[' is not a valid"):
        FormatMatch("[")


def test_weighted_sum():
    fn = WeightedSum([ExactMatch(), FormatMatch(r"^-?\d+$")], [1.0, 0.25])
    assert _call(fn, ["19", "the sum is 19", "18", "x"], ["19"] * 4) == [1.25, 1.0, 0.25, 0.0]
    for rewards_, weights in (([ExactMatch()], [1.0, 2.0]), ([], [])):
        with pytest.raises(ValueError, match="as many weights as rewards"):
            WeightedSum(rewards_, weights)
    with pytest.raises(ValueError, match="finite numbers"):
        WeightedSum([ExactMatch()], [math.nan])
    with pytest.raises(TypeError, match="must be callable"):
        WeightedSum(["ExactMatch"], [1.0])


def test_weighted_sum_names_the_component_that_fails():
    def short(prompts, responses, **kwargs):
        return [1.0]

    fn = WeightedSum([ExactMatch(), short], [1.0, 1.0])
    with pytest.raises(RewardFunctionError, match=r"short returned 1 scores for 2 rows"):
        FunctionReward(fn, TOK)([[BOS]] * 2, [TOK.encode("1", False)] * 2, ["1", "1"])


def test_built_from_yaml():
    """torchtune's instantiate builds the class; WeightedSum builds its nested components."""
    cfg = OmegaConf.create("""
    reward:
      _component_: torchtune_ppo.rewards.WeightedSum
      rewards:
        - {_component_: torchtune_ppo.rewards.ExactMatch, extract: last_number}
        - {_component_: torchtune_ppo.rewards.FormatMatch, pattern: '^-?\\d+$'}
      weights: [1.0, 0.1]
    """)
    fn = config.instantiate(cfg.reward)
    assert isinstance(fn.rewards[0], rewards.ExactMatch) and isinstance(fn.rewards[1], rewards.FormatMatch)
    assert _call(fn, ["7", "it is 7"], ["7", "7"]) == [1.1, 1.0]
    single = config.instantiate(OmegaConf.create({"_component_": "torchtune_ppo.rewards.ExactMatch"}))
    assert _call(single, ["7"], ["007"]) == [1.0]


def test_package_exports_the_protocol_and_the_built_ins():
    from torchtune_ppo.rewards import builtins, functions

    assert set(rewards.__all__) >= set(builtins.__all__) | set(functions.__all__)
    assert all(hasattr(rewards, name) for name in rewards.__all__)
    # The deprecated factory names resolve (tests/test_component_paths.py) but are not exported.
    assert not {"exact_match", "format_match", "weighted_sum"} & set(rewards.__all__)


def length_reward(prompts, responses, *, scale=1.0, **kwargs):
    return [scale * len(r) for r in responses]


def test_from_path():
    fn = rewards.from_path(f"{__name__}.length_reward", scale=2.0)
    assert _call(fn, ["ab", ""]) == [4.0, 0.0]
    assert rewards.from_path(f"{__name__}.length_reward") is length_reward
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.fn'"):
        rewards.from_path("no_such_pkg.fn")
    with pytest.raises(ValueError, match="cannot import"):
        rewards.from_path(f"{__name__}.no_such_fn")
    with pytest.raises(TypeError, match=r"math.sqrt|cannot be called"):
        rewards.from_path("math.sqrt")


# --------------------------------------------------------------------------- FunctionReward


def test_function_reward_decodes_and_passes_everything():
    seen = {}

    def fn(prompts, responses, *, references, prompt_tokens, response_tokens):
        seen.update(prompts=prompts, responses=responses, references=references,
                    prompt_tokens=prompt_tokens, response_tokens=response_tokens)
        return [1, True, 0.5]  # ints and bools are numbers

    prompts = [TOK.encode(p) for p in ("1+2=", "3+4=", "5-9=")]  # with BOS
    responses = [TOK.encode(r, add_bos=False) for r in ("3", "7", "-4")]
    out = FunctionReward(fn, TOK)(prompts, responses, ["3", "7", None])
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 1.0, 0.5]
    assert seen["prompts"] == ["1+2=", "3+4=", "5-9="] and seen["responses"] == ["3", "7", "-4"]
    assert seen["references"] == ["3", "7", None]
    assert seen["prompt_tokens"] == prompts and seen["response_tokens"] == responses
    # No references at all: every row gets None.
    FunctionReward(fn, TOK)(prompts, responses)
    assert seen["references"] == [None, None, None]


def test_score_batch_reads_the_truncated_rows():
    """Left-padded prompts of width P, responses cut after the first stop token (kept in
    seq_lens, dropped from the text); a row without a stop token keeps all its tokens."""
    P, T = 6, 4
    rows = [("1+2=", "3", True), ("10+20=", "30", True), ("9-9=", "0000", False)]
    query_responses = torch.full((3, P + T), PAD)
    prompt_lens, seq_lens = [], []
    for i, (p, r, stop) in enumerate(rows):
        pt, rt = TOK.encode(p)[-P:], TOK.encode(r, add_bos=False, add_eos=stop)
        query_responses[i, P - len(pt) : P] = torch.tensor(pt)
        query_responses[i, P : P + len(rt)] = torch.tensor(rt)
        prompt_lens.append(len(pt))
        seq_lens.append(len(rt))
    seen = {}

    def fn(prompts, responses, *, references, prompt_tokens, response_tokens):
        seen.update(prompts=prompts, responses=responses, response_tokens=response_tokens)
        return [0.0] * len(prompts)

    out = FunctionReward(fn, TOK).score_batch(
        query_responses, torch.tensor(prompt_lens), torch.tensor(seq_lens), None,
        prompt_len=P, stop_token_ids=torch.tensor([EOS]),
    )
    assert out.shape == (3,) and out.device == query_responses.device
    assert seen["prompts"] == ["1+2=", "10+20=", "9-9="]  # the second prompt fills P exactly
    assert seen["responses"] == ["3", "30", "0000"]
    assert all(EOS not in t and PAD not in t for t in seen["response_tokens"])


def _raise_on_minus(prompts, responses, **kwargs):
    return [float(r) if not r.startswith("-") else 1 / 0 for r in responses]


def _batch_only_failure(prompts, responses, **kwargs):
    if len(prompts) > 1:
        raise RuntimeError("needs one row at a time")
    return [0.0]


def _score(fn, responses):
    reward = FunctionReward(fn, TOK)
    return reward([TOK.encode("1+1=")] * len(responses), [TOK.encode(r, add_bos=False) for r in responses])


def test_error_names_function_row_and_exception():
    with pytest.raises(RewardFunctionError) as err:
        _score(_raise_on_minus, ["1", "2", "-3", "-4"])
    msg = str(err.value)
    assert f"{__name__}._raise_on_minus" in msg and "ZeroDivisionError" in msg
    assert "at row 2" in msg and "'-3'" in msg
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_error_when_no_single_row_fails():
    with pytest.raises(RewardFunctionError, match="no row raises when scored alone"):
        _score(_batch_only_failure, ["1", "2"])


@pytest.mark.parametrize("returned,match", [
    ([1.0, 2.0], r"returned 2 scores for 3 rows"),
    ([1.0, "abc", 2.0], r"returned 'abc' \(str\) for row 1 .*must be a number"),
    ([1.0, None, 2.0], r"returned None \(NoneType\) for row 1"),
    ([1.0, 2.0, math.nan], r"returned nan for row 2 .*finite"),
    ([math.inf, 2.0, 3.0], r"returned inf for row 0"),
    (torch.tensor([1.0, math.nan, 0.0]), r"returned nan for row 1"),
    (0.5, r"returned 0.5 \(float\); it must return a sequence of 3 floats"),
    ("1.0", r"returned '1.0' \(str\)"),
    ({"a": 1.0}, r"\(dict\)"),
    (torch.zeros(3, 1), r"array of shape \(3, 1\)"),
])
def test_bad_scores(returned, match):
    def bad(prompts, responses, **kwargs):
        return returned

    with pytest.raises(RewardFunctionError, match=match) as err:
        _score(bad, ["1", "2", "3"])
    assert "test_bad_scores.<locals>.bad" in str(err.value)


def test_tensor_and_tuple_scores_are_accepted():
    for returned in (torch.tensor([1.0, 0.0]), (1.0, 0.0), [torch.tensor(1.0), 0]):
        assert _score(lambda p, r, **k: returned, ["1", "2"]).tolist() == [1.0, 0.0]


def test_signature_checked_at_construction():
    with pytest.raises(TypeError, match=r"cannot be called as fn\(prompts, responses.*\*\*kwargs"):
        FunctionReward(lambda prompts, responses, references: [0.0], TOK)
    with pytest.raises(TypeError, match="must be callable"):
        FunctionReward("ExactMatch", TOK)


def test_built_in_names_in_errors():
    with pytest.raises(RewardFunctionError, match=r"torchtune_ppo.rewards.ExactMatch\(extract='last_number'\)"
                       r" raised ValueError.*at row 0"):
        FunctionReward(ExactMatch(), TOK)([[BOS]], [TOK.encode("1", False)], [None])


def test_real_tokenizer_drops_bos_from_the_prompt():
    from torchtune.models.llama2 import llama2_tokenizer

    from torchtune_ppo import asset_path

    tok = llama2_tokenizer(asset_path("tiny_sentiment/tokenizer.model"))
    prompt = tok.encode("the movie was", add_bos=True, add_eos=False)
    response = tok.encode(" truly great", add_bos=False, add_eos=False)
    seen = {}

    def fn(prompts, responses, **kwargs):
        seen.update(prompts=prompts, responses=responses)
        return [0.0]

    FunctionReward(fn, tok)([prompt], [response])
    assert seen["prompts"] == ["the movie was"] and seen["responses"] == ["truly great"]
