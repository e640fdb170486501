"""An environment's observation cut to ``turns.max_observation_tokens``: a huge one (megabytes of
a tool's output) is cut by characters before it is tokenized, and one within that bound is cut
as it always was, from its end until its tokens fit."""

from types import SimpleNamespace

from torchtune_ppo.rollout.turns import TurnRunner, TurnSettings


class Counting:
    """Renders an observation of digits as the ids 10 + digit, recording the length of each
    text it is given."""

    def __init__(self):
        self.lengths = []

    def tokens(self, observation):
        self.lengths.append(len(observation))
        return [10 + int(c) for c in observation]


def _render(observation, limit=5):
    runner = SimpleNamespace(settings=TurnSettings(max_observation_tokens=limit), renderer=Counting())
    return TurnRunner._render(runner, observation), runner.renderer.lengths


def test_a_huge_observation_is_never_tokenized_whole():
    (text, ids, cut), lengths = _render("7" * 4_000_000)  # 4 MB
    assert 0 < len(ids) <= 5 and ids == [17] * len(text) and set(text) == {"7"} and cut == 1
    assert max(lengths) <= 5 * 1000  # a bound in characters, far below the 4 MB


def _as_before(observation, limit):
    """The cut before the bound: from its end, to 3/4 of its length at a time, until it fits."""
    ids, cut = Counting().tokens(observation), 0
    while len(ids) > limit and observation:
        cut, observation = 1, observation[: len(observation) * 3 // 4]
        ids = Counting().tokens(observation)
    return observation, ids, cut


def test_an_observation_within_the_bound_is_cut_as_before():
    (text, ids, cut), lengths = _render("1234567890")  # 10 -> 7 -> 5 characters
    assert (text, ids, cut) == ("12345", [11, 12, 13, 14, 15], 1) and lengths == [10, 7, 5]
    assert _render("123") == (("123", [11, 12, 13], 0), [3])
    for n, limit in ((20_000, 100), (999, 32), (32, 32), (33, 32)):
        text = "".join(str(i % 10) for i in range(n))
        assert _render(text, limit)[0] == _as_before(text, limit), (n, limit)
