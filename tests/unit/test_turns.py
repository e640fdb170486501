"""Multi-turn episodes (torchtune_ppo/rollout/turns.py): token in, token out.

A scripted environment answers a seed-dependent number of turns; a stand-in tokenizer and
renderer keep the observation tokens known. The tiny random policy has eight stop tokens so that
its turns end after a few tokens.
"""

import copy

import pytest
import torch

from conftest import left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo.envs import EnvStep
from torchtune_ppo.rlhf import ScoringSettings
from torchtune_ppo.rollout import Rollout
from torchtune_ppo.rollout.generation import GenerationSteps, Generator, extend, generate_next_token, prefill, prefill_group
from torchtune_ppo.rollout.turns import TurnRunner, TurnSettings
from torchtune_ppo.rewards.model import ModelReward

P, T = 6, 40
STOPS = [2, 3, 4, 5, 6, 7, 8, 9]
LENS = [3, 6, 4, 5, 2, 6]


class Ids:
    """Decodes ids as text, so a turn's text tells its tokens."""

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class Digits:
    """Renders an observation of digits as the ids 10 + digit."""

    def tokens(self, observation):
        return [10 + int(c) for c in observation]


class Scripted:
    """Answers ``seed % 3`` tool calls per episode, each observation ``str(seed % 10)`` repeated."""

    def step(self, conversation, turn):
        calls = sum(role == "tool" for role, _ in conversation.turns)
        if calls < conversation.seed % 3:
            return EnvStep(observation=str(conversation.seed % 10) * (1 + calls), reward=0.25)
        return EnvStep(None)


class Raises:
    def step(self, conversation, turn):
        raise RuntimeError("tool down")


def runner(env=Scripted(), group_size=1, steps=None, cache_tokens=58, **settings):
    model = tiny_policy(0).eval()
    kwargs = {} if steps is None else {"steps": steps}
    gen = Generator(model, batch_size=6, max_prompt_len=P, max_generated_tokens=T, pad_id=0, stop_token_ids=STOPS,
                    cache_tokens=cache_tokens, group_size=group_size, **kwargs)
    settings = {"max_turns": 4, "max_observation_tokens": 5, "timeout_s": None, **settings}
    return TurnRunner(gen, env, Digits(), Ids(), TurnSettings(**settings)), model


def batch(group_size=1):
    lens = LENS if group_size == 1 else [LENS[i // group_size] for i in range(6)]
    prompts = left_padded_prompts(lens, P)
    if group_size > 1:
        prompts = prompts[:: group_size].repeat_interleave(group_size, 0)
    return prompts, torch.tensor(lens)


def forward_logprobs(model, prompts, lens, out, r):
    """Logprobs of row ``r``'s episode tokens from one plain forward over prompt + episode."""
    n, L = int(lens[r]), int(out.episode_lens[r])
    seq = torch.cat([prompts[r, P - n:], out.query_responses[r, P:P + L]])
    with torch.no_grad():
        logits = model(seq[None])[0].float()
    return torch.log_softmax(logits, -1)[n - 1:n - 1 + L].gather(1, seq[n:n + L, None])[:, 0]


@pytest.mark.parametrize("group_size", [1, 2])
def test_sampled_logprobs_are_a_plain_forward_over_the_compact_episode(group_size):
    """Gaps in the cache, positions and the extend chunk's mask are right exactly when one
    forward over the compacted episode gives the logprobs the tokens were sampled with."""
    run, model = runner(group_size=group_size)
    prompts, lens = batch(group_size)
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0), seeds=[0, 1, 2, 3, 4, 5])
    assert sum(out.stats.tool_calls) >= 3  # several rows continued after an observation
    for r in range(6):
        L = int(out.episode_lens[r])
        policy = ~out.observation_masks[r, :L]
        torch.testing.assert_close(out.logprobs[r, :L][policy], forward_logprobs(model, prompts, lens, out, r)[policy],
                                   rtol=0, atol=2e-6)
        assert (out.logprobs[r, :L][~policy] == 0).all()


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it():
    """Tokens sampled after a stop string leave the episode and the cache: the episode is still
    one plain forward's (their columns closed, positions rolled back), and no turn goes on past
    its first stop string."""
    run, model = runner(stop_strings=("4",))
    plain, _ = runner()
    prompts, lens = batch()
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0), seeds=[0, 1, 2, 3, 4, 5])
    cut = 0
    for r in range(6):
        L = int(out.episode_lens[r])
        policy = ~out.observation_masks[r, :L]
        torch.testing.assert_close(out.logprobs[r, :L][policy], forward_logprobs(model, prompts, lens, out, r)[policy],
                                   rtol=0, atol=2e-6)
        for role, text in out.conversations[r].turns:
            if role == "assistant" and "4" in text:
                ids = text.split()
                assert "4" not in " ".join(ids[:-1]) and "4" in ids[-1], (r, text)
                cut += int(ids[-1]) not in STOPS
    assert cut >= 2  # turns that a stop string ended before their stop token
    assert sum(out.stats.tool_calls) >= 2
    # without stop strings the same draws run on past them
    other = plain.generate(prompts, lens, torch.Generator().manual_seed(0), seeds=[0, 1, 2, 3, 4, 5])
    assert not torch.equal(other.query_responses, out.query_responses)


def test_the_episode_holds_turns_and_rendered_observations_in_order():
    run, _ = runner()
    prompts, lens = batch()
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0), seeds=[0, 1, 2, 3, 4, 5])
    for r in range(6):
        expected, obs = [], []
        for role, text in out.conversations[r].turns:
            ids = [int(t) for t in text.split()] if role == "assistant" else Digits().tokens(text)
            expected += ids
            obs += [role == "tool"] * len(ids)
        L = int(out.episode_lens[r])
        assert out.query_responses[r, P:P + L].tolist() == expected, r
        assert out.observation_masks[r, :L].tolist() == obs, r
        assert (out.query_responses[r, P + L:] == 0).all() and not out.observation_masks[r, L:].any()
        assert out.stats.tool_calls[r] == sum(role == "tool" for role, _ in out.conversations[r].turns)
        # the environment's rewards: 0.25 per answer, also one the budget left unwritten
        calls = out.stats.tool_calls[r]
        assert float(out.env_scores[r]) == 0.25 * (calls + (out.stats.truncated[r] and calls < r % 3))
        if not out.stats.truncated[r]:
            assert out.stats.tool_calls[r] == r % 3  # Scripted's seed = row
            assert int(out.query_responses[r, P + L - 1]) in STOPS
        # the final turn, what a reward function reads, without its stop token
        last = [int(t) for t in out.conversations[r].turns[-1][1].split()]
        assert out.final_turns[r] == (last[:-1] if last[-1] in STOPS else last)


def test_max_turns_ends_an_episode_as_truncated():
    run, _ = runner(max_turns=1)
    prompts, lens = batch()
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0), seeds=[0, 1, 2, 3, 4, 5])
    assert out.stats.turns == [1] * 6 and out.stats.tool_calls == [0] * 6
    assert not out.observation_masks.any()
    # rows whose environment wanted a call (seed % 3 > 0) and that finished their turn
    ended = [int(out.query_responses[r, P + int(out.episode_lens[r]) - 1]) in STOPS for r in range(6)]
    assert out.stats.truncated == [(r % 3 > 0) or not ended[r] for r in range(6)]


def test_a_full_cache_ends_episodes_without_an_observation_that_does_not_fit():
    run, _ = runner(cache_tokens=T)  # no room for gaps: the first turn's lockstep fills it
    prompts, lens = batch()
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0), seeds=[0, 1, 2, 3, 4, 5])
    for r in range(6):
        L = int(out.episode_lens[r])
        assert L <= T and out.observation_masks[r].sum() <= 5 * out.stats.tool_calls[r]
    assert any(out.stats.truncated)


def test_a_failing_environment_ends_the_episode_and_is_counted():
    run, _ = runner(env=Raises())
    prompts, lens = batch()
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0))
    finished = [int(out.query_responses[r, P + int(out.episode_lens[r]) - 1]) in STOPS for r in range(6)]
    assert out.stats.failed == finished and sum(finished) > 0
    assert run.failures == sum(finished)
    assert out.stats.metrics()["turns/env_failures"] == sum(finished)
    run.check_failures(sum(finished))  # no limit
    strict, _ = runner(env=Raises(), max_env_failures=sum(finished))
    out = strict.generate(prompts, lens, torch.Generator().manual_seed(0))
    strict.check_failures(sum(out.stats.failed))  # at the limit: goes on
    with pytest.raises(RuntimeError, match=f"{sum(finished) + 1} environment steps failed.*"
                                           f"turns.max_env_failures={sum(finished)}.*tool down"):
        strict.check_failures(sum(out.stats.failed) + 1)


def test_a_long_observation_is_cut_to_fit_and_counted():
    class Long:
        def step(self, conversation, turn):
            return EnvStep("1234567890") if not conversation.turns else EnvStep(None)

    run, _ = runner(env=Long())
    prompts, lens = batch()
    out = run.generate(prompts, lens, torch.Generator().manual_seed(0))
    for r in range(6):
        tools = [text for role, text in out.conversations[r].turns if role == "tool"]
        assert all(len(text) <= 5 for text in tools)
        assert out.stats.observations_cut[r] == len(tools)
    assert sum(out.stats.observations_cut) > 0


def test_compiled_steps_match_eager_and_compile_each_region_once():
    """Dynamo's eager backend: the guards and graphs of the compiled regions without inductor.
    Two batches of episodes: no region traces again in the second."""
    compiled = lambda fn: torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)
    steps = GenerationSteps(compiled(prefill), compiled(prefill_group), compiled(generate_next_token),
                            compiled=True, extend=compiled(extend))
    torch._dynamo.reset()
    eager_run, _ = runner()
    compiled_run, _ = runner(steps=steps)
    prompts, lens = batch()
    counts, start = [], torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in (0, 1):
        a = eager_run.generate(prompts, lens, torch.Generator().manual_seed(seed), seeds=[0, 1, 2, 3, 4, 5])
        b = compiled_run.generate(prompts, lens, torch.Generator().manual_seed(seed), seeds=[0, 1, 2, 3, 4, 5])
        assert torch.equal(a.query_responses, b.query_responses) and torch.equal(a.observation_masks, b.observation_masks)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
        assert sum(a.stats.tool_calls) > 0
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - start)
    assert counts[0] == 3 and counts[1] == counts[0]  # prefill, decode, extend


def test_scoring_masks_observations_and_reads_whole_episodes():
    """The Rollout with turns: the reference (the policy's weights) gives the generator's logprobs
    on every policy token, observation tokens are padding for everything but attention, and the
    environment's rewards are added to the reward model's scores."""
    run, model = runner()
    ref = copy.deepcopy(model).requires_grad_(False)
    value, reward = tiny_classifier(1).eval(), tiny_classifier(2).eval().requires_grad_(False)
    settings = ScoringSettings(prompt_len=P, pad_id=0, temperature=1.0, penalise_no_eos=False,
                               min_response_length=None, reward_penalty=-1.0)
    rollout = Rollout(run.gen, ref, value, ModelReward(reward), torch.tensor(STOPS), settings, turns=run)
    prompts, lens = batch()
    timer = lambda phase: __import__("contextlib").nullcontext()
    traj = rollout(prompts, lens, torch.Generator().manual_seed(0), timer, seeds=[0, 1, 2, 3, 4, 5])
    out = rollout.last_episodes[0]
    after = torch.arange(T)[None] >= out.episode_lens[:, None]
    assert torch.equal(traj.observation_masks, out.observation_masks)
    assert torch.equal(traj.response_padding_masks, after | out.observation_masks)
    assert torch.equal(traj.seq_lens, (~traj.response_padding_masks).sum(-1))
    valid = ~traj.response_padding_masks
    torch.testing.assert_close(traj.ref_logprobs[valid], out.logprobs[valid], rtol=0, atol=2e-6)
    for x in (traj.logprobs, traj.ref_logprobs, traj.values):
        assert (x[~valid] == 0).all()
    assert (traj.values[valid] != 0).all()
    # the reward model reads each episode's last token; the environment adds 0.25 per call
    for r in range(6):
        n, L = int(lens[r]), int(out.episode_lens[r])
        seq = torch.cat([prompts[r, P - n:], out.query_responses[r, P:P + L]])
        with torch.no_grad():
            expected = reward(seq[None])[0, -1, 0] + out.env_scores[r]
        torch.testing.assert_close(traj.scores[r], expected, rtol=0, atol=2e-6)
    assert float(out.env_scores.sum()) >= 0.25 * sum(out.stats.tool_calls) > 0
    assert rollout.episode_metrics["turns/tool_calls"] == sum(out.stats.tool_calls) / 6
    # the logged samples show whole episodes, observations included
    from torchtune_ppo.run.watch import sample_rows

    for r, row in enumerate(sample_rows(traj, lens, Ids(), P, n=6)):
        assert row["response"].split() == [str(t) for t in out.query_responses[r, P:P + int(out.episode_lens[r])].tolist()]
