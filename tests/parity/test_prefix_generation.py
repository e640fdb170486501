"""Tests for the generator's shared prompt prefix (``Generator(prefix_len=c)``): the prefix every
prompt of a call begins with computed once, into every row of the KV cache, against the plain
prefill of every row (the eager twin), a full forward, and compiled with zero recompiles."""

import pytest
import torch

from torchtune_ppo.compile import generation_steps
from torchtune_ppo.rollout.generation import Generator

from test_generation import PAD, SAMPLING, T, VOCAB, full_forward_logprobs, lens, one_thread, tiny_model  # noqa: F401

P, C, B = 10, 4, 4  # prompt width, shared prefix, rows


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def with_prefix(lengths, prefix, seed=0) -> torch.Tensor:
    """``[len(lengths), P]`` left-padded prompts that begin with ``prefix`` (each row's own
    tokens after it, never PAD)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((len(lengths), P), PAD)
    for r, n in enumerate(lengths):
        rest = torch.randint(1, VOCAB, (n - len(prefix),), generator=g)
        rows[r, P - n:] = torch.cat([torch.tensor(prefix), rest])
    return rows


PREFIX = [7, 3, 99, 12]


def generators(model, sampling, **kw):
    args = {**dict(batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD, stop_token_ids=[5, 17],
                   stop_check_every=4), **sampling, **kw}
    return Generator(model, **args), Generator(model, prefix_len=C, **args)


@pytest.mark.parametrize("sampling", [SAMPLING, dict(top_k=1)], ids=["sampled", "greedy"])
def test_shared_prefix_gives_the_plain_prefills_tokens(model, sampling):
    """The same tokens exactly, logprobs and logits within a few fp32 ulps (the rest of each
    prompt attends over every cache column, the plain prefill over the first P), for full and
    short batches, prompts of every length from C + 1 to P."""
    plain, shared = generators(model, sampling)
    for seed, lengths in enumerate([[P, C + 1, 7, 6], [5, 9], [C + 1]]):
        prompts = with_prefix(lengths, PREFIX, seed=seed)
        a = plain.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed), return_logits=True)
        b = shared.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed), return_logits=True)
        assert shared.prefix_shared and not plain.prefix_shared
        torch.testing.assert_close(b.query_responses, a.query_responses, rtol=0, atol=0)
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(b.logits, a.logits, rtol=2e-6, atol=2e-6)
    assert not model.caches_are_setup()


def test_shared_prefix_logprobs_match_a_full_forward(model):
    _, shared = generators(model, SAMPLING, stop_token_ids=[])
    prompts = with_prefix([P, 6, 5, 8], PREFIX, seed=11)
    out = shared.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(2))
    assert shared.prefix_shared
    expected = full_forward_logprobs(model, out, prompts, SAMPLING["temperature"])
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["other prefix", "prompt no longer than the prefix"])
def test_a_call_without_the_prefix_is_prefilled_whole(model, case):
    """A call whose prompts do not all begin with the same C tokens, or where one has nothing
    after them, runs the plain prefill: the same tokens and logprobs, bit for bit."""
    plain, shared = generators(model, SAMPLING)
    if case == "other prefix":
        prompts = torch.cat([with_prefix([8, 6], PREFIX, seed=1), with_prefix([7], [7, 3, 98, 12], seed=2)])
    else:
        prompts = with_prefix([8, C, 6], PREFIX, seed=3)
    a = plain.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(4))
    b = shared.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(4))
    assert not shared.prefix_shared
    torch.testing.assert_close(b.query_responses, a.query_responses, rtol=0, atol=0)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=0)
    # and the next call that shares it computes it once again
    prompts = with_prefix([8, 6], PREFIX, seed=5)
    shared.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(4))
    assert shared.prefix_shared


def test_compiled_equals_eager_with_zero_recompiles(model, monkeypatch):
    """Compiled: the prefix region and the chunk region, each compiled once, across calls of
    several lengths and prefixes; the eager twin's tokens exactly. Traced by dynamo and
    AOTAutograd (the cache writes functionalised), without inductor's code generation, which
    the prefill and chunk regions of test_generation.py and the multi-turn tests exercise."""
    from torch._dynamo.utils import counters

    from torchtune_ppo.compile import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")

    eager = generators(model, SAMPLING)[1]
    args = dict(batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD, stop_token_ids=[5, 17],
                stop_check_every=4, **SAMPLING)
    compiled = Generator(model, prefix_len=C, steps=generation_steps(compiled=True), **args)
    prompts = with_prefix([P, 6], PREFIX, seed=20)
    compiled.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(0))
    graphs = counters["stats"]["unique_graphs"]
    batches = [([P, 5, 7, 9], PREFIX), ([6, 6, 6, 6], [1, 2, 3, 4]), ([C + 1, 8], PREFIX)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, (lengths, prefix) in enumerate(batches):
            prompts = with_prefix(lengths, prefix, seed=30 + seed)
            out = compiled.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed))
            assert compiled.prefix_shared
            ref = eager.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(out.query_responses, ref.query_responses, rtol=0, atol=0)
            torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs


def test_invalid_prefix_len(model):
    kw = dict(max_prompt_len=P, max_generated_tokens=T, pad_id=PAD, stop_token_ids=[])
    for bad in (-1, P, 2.0):
        with pytest.raises(ValueError, match=rf"Generator: prefix_len={bad!r} is invalid"):
            Generator(model, batch_size=B, prefix_len=bad, **kw)
    with pytest.raises(ValueError, match=r"0 with group_size > 1 \(got 2\)"):
        Generator(model, batch_size=B, prefix_len=C, group_size=2, **kw)


def test_eval_prefix_len_is_the_fewest_tokens_each_set_shares():
    from torchtune_ppo.eval.data import EvalPrompts
    from torchtune_ppo.eval.evaluator import eval_prefix_len

    def prompt_set(rows):
        width = max(map(len, rows))
        tokens = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
        return EvalPrompts(tokens, torch.tensor([len(r) for r in rows]), [None] * len(rows), "test")

    a = prompt_set([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 7, 8]])  # 4 shared
    b = prompt_set([[8, 8, 8, 8, 8, 8, 1], [8, 8, 8, 8, 8, 8, 2, 3]])  # 6 shared, within itself
    assert eval_prefix_len([a], minimum=2) == 4
    assert eval_prefix_len([a, b], minimum=2) == 4  # each call holds one set: its own prefix, of one length
    assert eval_prefix_len([b], minimum=2) == 6
    assert eval_prefix_len([a, b], minimum=5) == 0  # too short to be worth a region of its own
    short = prompt_set([[1, 2, 3], [1, 2, 3, 4]])  # a prompt that is all prefix keeps one token to prefill
    assert eval_prefix_len([short], minimum=1) == 2


def test_speculative_calls_share_the_prefix_too(model):
    """Drafts checked in one forward after a shared-prefix prefill: the same tokens as the plain
    prefill's call with the same noise keys and drafts (right, wrong and none)."""
    plain, shared = generators(model, SAMPLING, draft_tokens=3)
    prompts = with_prefix([P, 6, 8, 5], PREFIX, seed=7)
    keys = [11, 22, 33, 44]
    first = plain.generate(prompts, lens(prompts), noise_keys=keys)  # the drafts: what plain decoding gives
    drafts = [first.query_responses[0, P:].tolist(), [1, 2, 3, 4, 5], None, first.query_responses[3, P:P + 4].tolist()]
    a = plain.generate(prompts, lens(prompts), noise_keys=keys, drafts=drafts)
    b = shared.generate(prompts, lens(prompts), noise_keys=keys, drafts=drafts)
    assert shared.prefix_shared and shared.spec_stats.accepted > 0
    torch.testing.assert_close(b.query_responses, a.query_responses, rtol=0, atol=0)
    torch.testing.assert_close(b.query_responses, first.query_responses, rtol=0, atol=0)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=2e-6, atol=2e-6)
