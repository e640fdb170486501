"""A reward function that raises on a batch is searched for its failing row by halving the
rows, not by calling it once per row: the calls are counted."""

import math

import pytest

from torchtune_ppo.rewards import RewardFunctionError
from torchtune_ppo.rewards.functions import call_reward_fn


class Counted:
    """A reward function that counts its calls and raises when ``fails(rows)`` says so."""

    def __init__(self, fails):
        self.fails, self.calls = fails, 0

    def __call__(self, prompts, responses, **kwargs):
        self.calls += 1
        if self.fails(responses):
            raise RuntimeError(f"cannot score {len(responses)} rows")
        return [0.0] * len(responses)


def _call(fn, n):
    responses = [f"r{i}" for i in range(n)]
    return call_reward_fn(fn, [f"p{i}" for i in range(n)], responses, references=[None] * n,
                          prompt_tokens=[[1]] * n, response_tokens=[[2]] * n)


def _most_calls(n):  # the batch, its first row, then two halves per halving
    return 2 + 2 * math.ceil(math.log2(n))


def test_a_function_that_fails_only_on_whole_batches_is_not_retried_per_row():
    fn = Counted(lambda rows: len(rows) > 1)
    with pytest.raises(RewardFunctionError) as err:
        _call(fn, 32)
    assert fn.calls <= _most_calls(32) < 32  # once per row would be 33 calls
    message = str(err.value)
    assert "raised RuntimeError on a batch of 32 rows" in message
    assert "rows 0 and 1 raise together, neither alone" in message
    assert "cannot score 32 rows" in message  # the batch's own error


def test_a_function_that_fails_only_on_the_full_batch_stops_after_its_halves():
    fn = Counted(lambda rows: len(rows) == 32)
    with pytest.raises(RewardFunctionError, match=r"rows 0 to 31 raise together, neither half of them alone"):
        _call(fn, 32)
    assert fn.calls == 4  # the batch, its first row, its two halves


@pytest.mark.parametrize("bad", [0, 19, 31])
def test_one_failing_row_is_named_in_a_few_calls(bad):
    fn = Counted(lambda rows: f"r{bad}" in rows)
    with pytest.raises(RewardFunctionError, match=rf"at row {bad} \(prompt 'p{bad}', response 'r{bad}'\)"):
        _call(fn, 32)
    assert fn.calls <= _most_calls(32)


def test_the_first_of_several_failing_rows_is_named():
    fn = Counted(lambda rows: "r5" in rows or "r20" in rows)
    with pytest.raises(RewardFunctionError, match=r"at row 5 "):
        _call(fn, 32)


def test_a_function_that_fails_on_every_row_is_called_twice():
    fn = Counted(lambda rows: True)
    with pytest.raises(RewardFunctionError, match=r"at row 0 "):
        _call(fn, 32)
    assert fn.calls == 2  # the batch, then its first row alone
