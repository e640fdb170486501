"""The rollout: steps 1-6 as one region (compile.rollout) equal to the split path and compiled
equal to eager; a function reward through :class:`Rollout` equal to the same scores in the graph."""

import pytest
import torch

from conftest import EOS_ID, PAD_ID, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo.compile import maybe_compile
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout.fused import fused_rollout, score_trajectory
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.rlhf import ScoringSettings

P, T, B = 6, 4, 3
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=1.0, penalise_no_eos=True,
                           min_response_length=None, reward_penalty=-3.0)


def _setup(top_k):
    policy, ref = tiny_policy(0), tiny_policy(0)
    value, reward = tiny_classifier(1), tiny_classifier(2)
    with torch.no_grad():  # flatter next-token distributions, so sampling is not one-hot
        for m in (policy, ref):
            m.tok_embeddings.weight.mul_(0.15)
    gen = Generator(policy, batch_size=B, max_prompt_len=P, max_generated_tokens=T,
                    pad_id=PAD_ID, stop_token_ids=[EOS_ID], top_k=top_k)
    return gen, ref, value, ModelReward(reward)


@torch.no_grad()
def test_greedy_rollout_equals_generate_then_score():
    gen, ref, value, reward = _setup(top_k=1)
    lens = torch.tensor([6, 2, 4])
    prompts = left_padded_prompts(lens.tolist(), P, seed=5)
    out = gen.generate(prompts, lens)
    split = score_trajectory(out.query_responses, lens, out.logprobs, None, ref, value, reward, STOP,
                             SETTINGS)
    with gen.kv_cache.decoding():
        gen.prepare(prompts, lens)
        whole = fused_rollout(gen, gen.draw_noise(None, steps=T), lens, ref, value, reward, STOP, SETTINGS)
    for name, a, b in zip(split._fields, split, whole):
        if a is None and b is None:  # a field of multi-turn episodes only
            continue
        if a.is_floating_point():
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.slow  # compiles
@torch.no_grad()
def test_compiled_rollout_equals_eager():
    gen, ref, value, reward = _setup(top_k=None)
    compiled = maybe_compile(fused_rollout, enabled=True)
    lens = torch.tensor([1, 6, 3])
    for seed in (0, 1):  # the second batch reuses the graph
        prompts = left_padded_prompts(lens.tolist(), P, seed=seed)
        results = []
        for fn in (fused_rollout, compiled):
            with gen.kv_cache.decoding():
                gen.prepare(prompts, lens)
                noise = gen.draw_noise(torch.Generator().manual_seed(seed), steps=T)
                results.append(fn(gen, noise, lens, ref, value, reward, STOP, SETTINGS))
        eager, comp = results
        for name, a, b in zip(eager._fields, eager, comp):
            if a is None and b is None:  # a field of multi-turn episodes only
                continue
            if a.is_floating_point():
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
            else:
                assert torch.equal(a, b), name
    assert gen.model.layers[0].attn.kv_cache is None  # caches detached again


class _FixedScores:
    """A reward function returning given numbers, one per row, whatever the texts."""

    def __init__(self, values):
        self.values, self.calls = values, []

    def __call__(self, prompts, responses, *, references, prompt_tokens, response_tokens):
        self.calls.append((list(references), [len(t) for t in response_tokens]))
        return self.values[: len(prompts)]


class _Decoder:
    def decode(self, ids):
        return " ".join(map(str, ids))


@torch.no_grad()
def test_function_reward_drives_the_trajectory_as_a_reward_model_would():
    from torchtune_ppo.rewards import FunctionReward
    from torchtune_ppo.rollout import Rollout

    gen, ref, value, _ = _setup(top_k=1)
    values = [0.5, -1.25, 2.0]
    fixed = torch.tensor(values)
    settings = SETTINGS._replace(min_response_length=2)
    timer = lambda phase: __import__("contextlib").nullcontext()  # noqa: E731
    lens = torch.tensor([6, 2, 4])
    prompts = left_padded_prompts(lens.tolist(), P, seed=5)
    fn = _FixedScores(values)
    rollout = Rollout(gen, ref, value, FunctionReward(fn, _Decoder()), STOP, settings)
    by_function = rollout(prompts, lens, None, timer, references=["a", None, "c"])
    out = gen.generate(prompts, lens)  # greedy: the same responses
    by_model = score_trajectory(out.query_responses, lens, out.logprobs, None, ref, value,
                                lambda qr, masks, pos, last: fixed.clone(), STOP, settings)
    # the function reward is scored packed, the callable padded: equal within float rounding
    for name, a, b in zip(by_model._fields, by_model, by_function):
        if a is None and b is None:  # a field of multi-turn episodes only
            continue
        if a.is_floating_point():
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
        else:
            assert torch.equal(a, b), name
    assert fn.calls[0][0] == ["a", None, "c"]  # the references reach the function, row by row
    # the response tokens it saw stop before the stop token: valid tokens minus the stop
    valid = ~by_model.response_padding_masks
    has_stop = (torch.isin(by_model.query_responses[:, P:], STOP) & valid).any(-1)
    assert fn.calls[0][1] == (by_model.seq_lens - has_stop.long()).tolist()
    # penalties apply after the function, as after a reward model
    penalised = ~has_stop | (by_model.seq_lens < 2)
    assert torch.equal(by_function.scores, torch.where(penalised, torch.tensor(-3.0), fixed))
