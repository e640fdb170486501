"""Tests for torchtune_ppo.rollout.generation: parity with torchtune and with full forwards, eager vs
compiled, stop tokens, odd inputs, and zero recompiles across batches and training steps.

Compiling costs 15-90 s per region on a small CPU runner, so all compiled tests share two
module-scoped generators (greedy and sampling) on one model.
"""


import pytest
import torch
from torchtune import generation as tt_generation
from torchtune.models.llama3_2._component_builders import llama3_2

from torchtune_ppo.compile import generation_steps
from torchtune_ppo.rollout.generation import GenerationOutput, Generator
from torchtune_ppo.rollout.sampling import sample

VOCAB, P, T, BATCH, PAD = 128, 10, 12, 4, 0
SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.9)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls gain nothing from a second OpenMP thread, and on a shared 2-core runner an
    # oversubscribed OpenMP pool is 100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = llama3_2(
        vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
        max_seq_len=64, intermediate_dim=128,
    )
    # The output is tied to std-1 embeddings, which makes every distribution one-hot; scaled
    # down, next-token entropy is ~3.4 nats, so sampling has something to sample.
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.15)
    return model


def left_padded(lengths, seed: int = 0) -> torch.Tensor:
    """[len(lengths), P] prompts of the given real lengths, left-padded with PAD."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (len(lengths), P), generator=g)
    for row, n in enumerate(lengths):
        prompts[row, : P - n] = PAD
    return prompts


def lens(prompts: torch.Tensor) -> torch.Tensor:
    """[b] real lengths of prompts from :func:`left_padded` (whose tokens are never PAD)."""
    return (prompts != PAD).sum(-1)


def full_forward_logprobs(model, out: GenerationOutput, prompts, temperature) -> torch.Tensor:
    """[b, T] logprobs of the responses from one no-cache forward over the whole sequence."""
    qr = out.query_responses
    real = torch.cat([prompts != PAD, torch.ones(qr.shape[0], T, dtype=torch.bool)], dim=1)
    mask = tt_generation.get_causal_mask_from_padding_mask(real)
    input_pos = tt_generation.get_position_ids_from_padding_mask(real)
    with torch.no_grad():
        logits = model(qr, input_pos=input_pos, mask=mask)[:, P - 1 : -1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, qr[:, P:, None])[..., 0]


def up_to_stop(responses: torch.Tensor, stop_ids) -> torch.Tensor:
    """[b, T] bool: response positions up to and including the first stop token."""
    is_stop = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype))
    return (is_stop.cumsum(-1) - is_stop.long()) == 0


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def greedy_compiled(model):
    return Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T,
                     pad_id=PAD, stop_token_ids=[], top_k=1, steps=generation_steps(compiled=True))


@pytest.fixture(scope="module")
def sampling_compiled(model):
    return Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T,
                     pad_id=PAD, stop_token_ids=[5, 17], steps=generation_steps(compiled=True), stop_check_every=4,
                     **SAMPLING)


@pytest.fixture(scope="module")
def sampling_eager(model):
    return Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T,
                     pad_id=PAD, stop_token_ids=[5, 17], stop_check_every=4, **SAMPLING)


def test_sample_hand_worked():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    noise = torch.empty(4000, 4).exponential_(generator=torch.Generator().manual_seed(0))
    token, logprob = sample(logits, noise, top_p=0.7)  # nucleus {0, 1}
    assert set(token.tolist()) == {0, 1}
    assert abs((token == 0).float().mean().item() - 0.5 / 0.8) < 0.03
    torch.testing.assert_close(logprob, probs.log()[token], rtol=0, atol=1e-6)
    token, _ = sample(logits, noise[:, :3], top_k=3)  # k-wide noise
    assert set(token.tolist()) == {0, 1, 2}
    token, _ = sample(logits, noise[:, :3], top_k=3, top_p=0.6)  # {.53, .32, .16}: {0, 1}
    assert set(token.tolist()) == {0, 1}
    token, _ = sample(logits, noise[:, :2], top_k=2, top_p=0.55)  # top-p of {.625, .375}
    assert set(token.tolist()) == {0}
    token, logprob = sample(logits[:2] * 3, None, temperature=3.0, top_k=1)
    assert token.tolist() == [0, 0]
    torch.testing.assert_close(logprob, probs.log()[[0, 0]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_greedy_matches_torchtune(model, greedy_compiled, compiled):
    gen = greedy_compiled if compiled else Generator(
        model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD,
        stop_token_ids=[], top_k=1,
    )
    prompts = left_padded([P, 4, 7])  # one full-length row, b < batch_size
    out = gen.generate(prompts, lens(prompts))
    expected, _ = tt_generation.generate(
        model, prompts, max_generated_tokens=T, pad_id=PAD, top_k=1
    )
    assert out.query_responses.shape == (3, P + T) and out.query_responses.dtype == torch.long
    torch.testing.assert_close(out.query_responses, expected.long(), rtol=0, atol=0)
    torch.testing.assert_close(
        out.logprobs, full_forward_logprobs(model, out, prompts, 1.0), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_logprobs_match_full_forward(model, sampling_eager, sampling_compiled, compiled):
    gen = sampling_compiled if compiled else sampling_eager
    prompts = left_padded([3, P, 1, 6], seed=1)
    out = gen.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(0))
    assert out.logits is None and out.logprobs.dtype == torch.float32
    valid = up_to_stop(out.query_responses[:, P:], gen.stop_token_ids)
    reference = full_forward_logprobs(model, out, prompts, SAMPLING["temperature"])
    torch.testing.assert_close(out.logprobs[valid], reference[valid], rtol=0, atol=1e-5)
    assert torch.isfinite(out.logprobs).all()


def test_return_logits(model, sampling_eager):
    prompts = left_padded([5, 2], seed=2)
    out = sampling_eager.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(0),
                                  return_logits=True)
    assert out.logits.shape == (2, T, VOCAB)
    valid = up_to_stop(out.query_responses[:, P:], sampling_eager.stop_token_ids)
    from_logits = torch.log_softmax(out.logits / SAMPLING["temperature"], dim=-1)
    from_logits = from_logits.gather(-1, out.query_responses[:, P:, None])[..., 0]
    torch.testing.assert_close(out.logprobs[valid], from_logits[valid], rtol=0, atol=1e-6)


def test_seeded_sampling(model):
    gen = Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T,
                    pad_id=PAD, stop_token_ids=[], temperature=1.0, top_k=50, top_p=0.95)
    prompts = left_padded([P, 4, 8, 2], seed=3)
    a = gen.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(7))
    b = gen.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(7))
    c = gen.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(8))
    assert torch.equal(a.query_responses, b.query_responses)
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.query_responses, c.query_responses)


@pytest.mark.slow  # compiles
def test_eager_and_compiled_agree(sampling_eager, sampling_compiled):
    prompts = left_padded([2, 9, P], seed=4)
    eager = sampling_eager.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(3))
    compiled = sampling_compiled.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(3))
    torch.testing.assert_close(compiled.query_responses, eager.query_responses, rtol=0, atol=0)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-5)


def test_stop_tokens_pad_after_first_stop(model):
    kwargs = dict(batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD,
                  top_k=1)
    prompts = left_padded([P, 3, 6, 8], seed=5)
    free = Generator(model, stop_token_ids=[], **kwargs).generate(prompts, lens(prompts))
    stop = int(free.query_responses[0, P + 3])  # row 0 stops at response index <= 3
    out = Generator(model, stop_token_ids=[stop], **kwargs).generate(prompts, lens(prompts))
    assert out.query_responses.shape == (4, P + T)
    keep = up_to_stop(free.query_responses[:, P:], [stop])
    expected = torch.where(keep, free.query_responses[:, P:], PAD)
    torch.testing.assert_close(out.query_responses[:, P:], expected, rtol=0, atol=0)
    torch.testing.assert_close(out.query_responses[:, :P], prompts, rtol=0, atol=0)
    first = int((free.query_responses[0, P:] == stop).nonzero()[0])
    assert int(out.query_responses[0, P + first]) == stop  # the stop token itself is kept
    assert (out.query_responses[0, P + first + 1 :] == PAD).all()  # then padding


def test_early_exit_when_all_rows_stop(model):
    kwargs = dict(batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD,
                  top_k=1)
    prompts = left_padded([4, 5], seed=6)  # b < batch_size: two all-pad filler rows
    firsts = Generator(model, stop_token_ids=[], **kwargs).generate(prompts, lens(prompts)).query_responses[:, P]
    filler = Generator(model, stop_token_ids=[], **kwargs).generate(
        torch.full((1, P), PAD), torch.zeros(1, dtype=torch.long)).query_responses[0, P]
    assert filler not in firsts  # so the filler rows never stop
    gen = Generator(model, stop_token_ids=firsts.tolist(), stop_check_every=2, **kwargs)
    calls = []
    decode = gen._decode
    gen._decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    out = gen.generate(prompts, lens(prompts))
    assert len(calls) == 1  # step 1 runs, step 2 checks the real rows and stops
    assert out.query_responses.shape == (2, P + T)
    assert torch.equal(out.query_responses[:, P], firsts)
    assert (out.query_responses[:, P + 1 :] == PAD).all()
    assert torch.isfinite(out.logprobs).all()


def test_all_pad_row_is_finite_and_isolated(model):
    gen = Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T,
                    pad_id=PAD, stop_token_ids=[], top_k=1)
    prompts = left_padded([6, 3, P], seed=7)
    with_pad_row = prompts.clone()
    with_pad_row[1] = PAD
    a, b = gen.generate(prompts, lens(prompts)), gen.generate(with_pad_row, lens(with_pad_row))
    assert torch.isfinite(b.logprobs).all()
    for row in (0, 2):
        assert torch.equal(a.query_responses[row], b.query_responses[row])
        torch.testing.assert_close(a.logprobs[row], b.logprobs[row], rtol=0, atol=1e-6)


def test_single_generated_token(model):
    gen = Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=1,
                    pad_id=PAD, stop_token_ids=[3], top_k=1)
    prompts = left_padded([P, 2], seed=8)
    out = gen.generate(prompts, lens(prompts))
    expected, _ = tt_generation.generate(model, prompts, max_generated_tokens=1, pad_id=PAD,
                                         top_k=1)
    assert out.query_responses.shape == (2, P + 1) and out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.query_responses, expected.long(), rtol=0, atol=0)


def test_model_left_cache_free_and_mode_restored(model, sampling_eager):
    model.train()
    sampling_eager.generate(left_padded([4], seed=9), torch.tensor([4]), rng=torch.Generator().manual_seed(0))
    assert model.training and all(m.training for m in model.modules())
    assert not model.caches_are_enabled() and not model.caches_are_setup()
    # With no cache attached, mask=None means causal again (torchtune drops is_causal whenever
    # a cache is set up).
    tokens = left_padded([P], seed=9)
    causal = torch.tril(torch.ones(P, P, dtype=torch.bool))[None]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), model(tokens, mask=causal), rtol=0, atol=1e-6)


def test_chunked_output_model(model, sampling_eager):
    # A policy set up for chunked cross-entropy still generates, and keeps its setting.
    prompts = left_padded([4, 7], seed=11)
    rng = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    plain = sampling_eager.generate(prompts, lens(prompts), rng=rng())
    model.set_num_output_chunks(2)
    try:
        chunked = sampling_eager.generate(prompts, lens(prompts), rng=rng())
        assert model.num_output_chunks == 2
    finally:
        model.set_num_output_chunks(0)
    assert torch.equal(plain.query_responses, chunked.query_responses)


def test_invalid_arguments(model, sampling_eager):
    for bad in (torch.zeros(P, dtype=torch.long), torch.zeros(2, P + 1, dtype=torch.long),
                torch.zeros(BATCH + 1, P, dtype=torch.long), torch.zeros(0, P, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"prompts must have shape \[b, max_prompt_len\]"):
            sampling_eager.generate(bad, lens(bad))
    with pytest.raises(ValueError, match="prompts must be int64"):
        sampling_eager.generate(torch.zeros(2, P), torch.full((2,), P))
    for kwargs, name in ((dict(temperature=0.0), "temperature"), (dict(top_p=1.5), "top_p"),
                         (dict(top_k=0), "top_k"), (dict(max_generated_tokens=60), "max_seq_len"),
                         (dict(stop_token_ids=[VOCAB]), "stop_token_ids")):
        args = dict(batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD,
                    stop_token_ids=[])
        with pytest.raises(ValueError, match=name):
            Generator(model, **{**args, **kwargs})


@pytest.mark.slow  # compiles
def test_zero_recompiles_across_batches_and_training(model, sampling_eager, sampling_compiled):
    from torch._dynamo.utils import counters

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def train_step():
        # Full-sequence forward on the cache-free model, backward, SGD step.
        model.train()
        tokens = torch.randint(1, VOCAB, (BATCH, P + T))
        loss = torch.log_softmax(model(tokens), -1)[..., 0].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    sampling_compiled.generate(left_padded([P, 1], seed=10), torch.tensor([P, 1]), rng=torch.Generator().manual_seed(0))
    graphs = counters["stats"]["unique_graphs"]
    batches = [[P, 1, 5, 7], [2, 2, 3, 9], [P, P, P, P], [1, 4], [6, 8, 3, 1]]  # one short batch
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, lengths in enumerate(batches):
            train_step()
            prompts = left_padded(lengths, seed=20 + seed)
            out = sampling_compiled.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed))
            assert out.query_responses.shape == (len(lengths), P + T)
    assert counters["stats"]["unique_graphs"] == graphs
    # Still the eager twin's tokens after five optimizer steps.
    eager = sampling_eager.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(out.query_responses, eager.query_responses, rtol=0, atol=0)
    torch.testing.assert_close(out.logprobs, eager.logprobs, rtol=0, atol=1e-5)


def test_pad_id_inside_a_prompt_is_a_real_token(model):
    """Padding is told by length: a prompt holding the pad id as a real token (e.g. <unk> = 0 in
    Llama-2 tokenizers) generates exactly as the same prompt with an ordinary token there, when
    the model cannot tell the two ids apart."""
    ordinary = 7
    twin = tiny_model()
    with torch.no_grad():  # give the pad id the ordinary token's embedding (and output row)
        twin.tok_embeddings.weight[PAD] = twin.tok_embeddings.weight[ordinary]
    gen = Generator(twin, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T,
                    pad_id=PAD, stop_token_ids=[], top_k=1)
    prompts = left_padded([6, P, 4], seed=12)
    with_pad = prompts.clone()
    with_pad[0, P - 3] = PAD  # mid-prompt
    with_pad[1, 0] = PAD  # first token of a full-length prompt
    with_pad[2, P - 4] = PAD  # first token of a short prompt
    replaced = torch.where((with_pad == PAD) & (torch.arange(P) >= P - lens(prompts)[:, None]),
                           ordinary, with_pad)
    a = gen.generate(with_pad, lens(prompts))
    b = gen.generate(replaced, lens(prompts))
    torch.testing.assert_close(a.query_responses[:, P:], b.query_responses[:, P:], rtol=0, atol=0)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)


def test_invalid_prompt_lens(sampling_eager):
    prompts = left_padded([3, 4])
    for bad in (torch.tensor([3]), torch.tensor([3.0, 4.0]), torch.tensor([3, P + 1]),
                torch.tensor([-1, 4])):
        with pytest.raises(ValueError, match="prompt_lens"):
            sampling_eager.generate(prompts, bad)


# ---- group_size: one prefill per group of identical prompts ---------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_group_prefill_gives_the_n_prefills_tokens(model, n):
    """Each prompt prefilled once and its cache copied into its n rows: the tokens and logprobs of
    n prefills of it, from the same draws, in full and short (filler-group) batches, sampled and
    greedy. The tokens are compared exactly; the logprobs and logits within a few fp32 ulps
    (relative 2e-6): the prefill projects only the last position to the vocabulary, a product of
    B / n rows against one of B rows, whose sums may round differently in the last bits
    (relative 3.3e-7 seen here)."""
    B = 8
    kw = dict(batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD, stop_token_ids=[5, 17],
              stop_check_every=4)
    for sampling in (SAMPLING, dict(top_k=1)):
        every, shared = Generator(model, **kw, **sampling), Generator(model, **kw, **sampling, group_size=n)
        for seed, lengths in enumerate([[P, 1, 6, 3][: B // n], [4]]):  # a full batch, then one group
            prompts = left_padded(lengths, seed=40 + seed).repeat_interleave(n, dim=0)
            a = every.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed), return_logits=True)
            b = shared.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(seed), return_logits=True)
            torch.testing.assert_close(b.query_responses, a.query_responses, rtol=0, atol=0)
            torch.testing.assert_close(b.logprobs, a.logprobs, rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(b.logits, a.logits, rtol=2e-6, atol=1e-6)
            if "top_k" in sampling and sampling["top_k"] == 1:  # greedy: a group's rows agree
                assert (b.query_responses.view(-1, n, P + T) == b.query_responses[::n, None]).all()
            else:  # sampled: each row draws its own first token, so a group's rows differ
                assert not (b.query_responses.view(-1, n, P + T) == b.query_responses[::n, None]).all()
    # the model is left as it was: no cache, the buffers back in place
    assert not model.caches_are_setup()
    full = shared.kv_cache._caches[0].k_cache
    assert full.shape[0] == B and full.is_contiguous()


def test_group_prefill_logprobs_match_full_forward(model):
    n = 2
    gen = Generator(model, batch_size=BATCH, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD,
                    stop_token_ids=[], group_size=n, **SAMPLING)
    prompts = left_padded([7, 2], seed=5).repeat_interleave(n, dim=0)
    out = gen.generate(prompts, lens(prompts), rng=torch.Generator().manual_seed(1))
    expected = full_forward_logprobs(model, out, prompts, SAMPLING["temperature"])
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-4)


def test_group_prefill_invalid_arguments(model):
    kw = dict(max_prompt_len=P, max_generated_tokens=T, pad_id=PAD, stop_token_ids=[])
    with pytest.raises(ValueError, match=r"Generator: batch_size=6 is not a multiple of num_samples_per_prompt=4 \(the group size\)"):
        Generator(model, batch_size=6, group_size=4, **kw)
    with pytest.raises(ValueError, match="group_size=0 is invalid"):
        Generator(model, batch_size=4, group_size=0, **kw)
    gen = Generator(model, batch_size=4, group_size=2, **kw)
    with pytest.raises(ValueError, match=r"generate: a call of 3 prompts is not a multiple of num_samples_per_prompt=2"):
        gen.generate(left_padded([3, 3, 3]), torch.tensor([3, 3, 3]))
    prompts = left_padded([4, 4], seed=1)  # two different prompts where one group should be
    with pytest.raises(ValueError, match="each run of 2 rows must hold one prompt"):
        gen.generate(prompts, lens(prompts))
    same = left_padded([5], seed=2).repeat(2, 1)
    with pytest.raises(ValueError, match="each run of 2 rows must hold one prompt"):
        gen.generate(same, torch.tensor([5, 4]))  # same tokens, different lengths
    same[1, 0] = 99  # a different padding token is still the same prompt
    gen.generate(same, torch.tensor([5, 5]))
