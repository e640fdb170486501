"""torchtune_ppo.rollout.sampling.sample against hand-computed nuclei, on vocabularies whose
probabilities are NOT already in descending order (the order a sort-free shortcut would assume)."""

import pytest
import torch

from torchtune_ppo.rollout.sampling import sample

ROWS = 4000
# probabilities 0.5, 0.3, 0.15, 0.05, permuted: [0.05, 0.5, 0.15, 0.3]
PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def _noise(rows, width, seed=0):
    return torch.empty(rows, width).exponential_(generator=torch.Generator().manual_seed(seed))


def _frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


def test_top_p_without_top_k_on_a_permuted_vocabulary():
    logits = PROBS.log().expand(ROWS, 4)
    # Descending: 0.5 (id 1), 0.3 (id 3), 0.15 (id 2), 0.05 (id 0). The mass before each is
    # 0, 0.5, 0.8, 0.95: top_p=0.6 keeps {1, 3}; renormalised 0.625, 0.375.
    token, logprob = sample(logits, _noise(ROWS, 4), top_p=0.6)
    assert set(token.tolist()) == {1, 3}
    freq = _frequencies(token, 4)
    assert abs(freq[1].item() - 0.625) < 0.03 and abs(freq[3].item() - 0.375) < 0.03
    # logprobs under the full distribution, not the nucleus
    torch.testing.assert_close(logprob, PROBS.log()[token], rtol=0, atol=1e-6)
    # top_p=0.85 adds the 0.15 token (mass before it 0.8 < 0.85), never the 0.05 one
    token, _ = sample(logits, _noise(ROWS, 4, seed=1), top_p=0.85)
    assert set(token.tolist()) == {1, 2, 3}
    # the most likely token alone once its own mass reaches top_p
    token, _ = sample(logits, _noise(ROWS, 4, seed=2), top_p=0.5)
    assert set(token.tolist()) == {1}


def _kept(logits, top_k=None, **kwargs):
    """``[B, V]`` bool: the ids ``sample`` can draw in each row.

    Each noise column is raced alone with a near-zero draw (1 elsewhere): its id wins exactly
    when its filtered probability is not 0. The columns are the vocabulary's ids, or with
    ``top_k`` the top-k ids in descending order (``sample`` takes ``[B, top_k]`` noise).
    """
    b, v = logits.shape
    width = v if top_k is None else top_k
    ids = torch.arange(v).expand(b, v) if top_k is None else logits.topk(top_k, -1).indices
    noise = torch.ones(b * width, width)
    noise[torch.arange(b * width), torch.arange(width).repeat(b)] = 1e-30
    token, _ = sample(logits.repeat_interleave(width, 0), noise, top_k=top_k, **kwargs)
    won = (token == ids.reshape(-1)).view(b, width)  # race r * width + i favours ids[r, i]
    return torch.zeros(b, v, dtype=torch.bool).scatter_(-1, ids, won)


@pytest.mark.parametrize("seed", range(3))
def test_top_p_without_top_k_keeps_the_nucleus_of_a_shuffled_vocabulary(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 32
    logits = torch.randn(8, vocab, generator=g)  # random order, distinct values
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    nucleus = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, before < 0.7)
    assert 1 < nucleus.sum(-1).min() and nucleus.sum(-1).max() < vocab  # not trivial
    assert torch.equal(_kept(logits, top_p=0.7), nucleus)
    # the sorted path (top_k over the whole vocabulary) keeps the same ids
    assert torch.equal(_kept(logits, top_k=vocab, top_p=0.7), nucleus)


def test_top_p_applies_to_the_tempered_distribution():
    logits = PROBS.log().expand(ROWS, 4)
    # At temperature 2: probabilities ∝ sqrt(p) = .379 (id 1), .294 (id 3), .208 (id 2),
    # .120 (id 0); the mass before each is 0, .379, .673, .880: top_p=0.7 keeps {1, 3, 2}
    # (at temperature 1 it would keep {1, 3}).
    token, logprob = sample(logits, _noise(ROWS, 4), temperature=2.0, top_p=0.7)
    assert set(token.tolist()) == {1, 2, 3}
    tempered = torch.softmax(PROBS.log() / 2, -1)
    torch.testing.assert_close(logprob, tempered.log()[token], rtol=0, atol=1e-6)
    kept = tempered[[1, 2, 3]] / tempered[[1, 2, 3]].sum()
    freq = _frequencies(token, 4)
    for tok, p in zip((1, 2, 3), kept.tolist()):
        assert abs(freq[tok].item() - p) < 0.03, (tok, freq, kept)


def test_a_zero_noise_draw_never_picks_a_filtered_token():
    # A zero Exponential draw at a token outside the nucleus: 0 / 0 would be NaN, which
    # argmax picks. Every row here has one, at a filtered id.
    logits = PROBS.log().expand(3, 4)
    noise = torch.ones(3, 4)
    noise[0, 0] = noise[1, 2] = noise[2, 0] = 0.0  # ids 0 and 2 are outside the 0.6 nucleus
    token, logprob = sample(logits, noise, top_p=0.6)
    assert token.tolist() == [1, 1, 1]  # then the race is argmax(probs): id 1
    assert torch.isfinite(logprob).all()
    # the same with top_k (k-wide noise over the top-3: ids 1, 3, 2 in that order)
    noise = torch.ones(2, 3)
    noise[:, 2] = 0.0
    token, _ = sample(logits[:2], noise, top_k=3, top_p=0.6)
    assert token.tolist() == [1, 1]


def test_exponential_noise_draws_what_torch_exponential_draws():
    """The fast CPU draws are torch's ``exponential_`` draws from the same generator state, bit
    for bit, so seeded runs sample what they sampled before; and the state moves on alike."""
    from torchtune_ppo.rollout.sampling import exponential_noise

    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for shape in [(16, 49152), (3, 5, 7)]:
        got = exponential_noise(torch.empty(shape), ours)
        assert torch.equal(got, torch.empty(shape).exponential_(generator=theirs))
    assert torch.equal(ours.get_state(), theirs.get_state())
    assert not torch.equal(got, exponential_noise(torch.empty(3, 5, 7), torch.Generator().manual_seed(4)))


def test_exponential_noise_resolves_the_smallest_draws():
    """The race's winners come from the smallest draws: below 1e-6 they must not sit on the
    2**-24 grid of float32 uniforms (17 values there), where ~17 draws of 2**24 would collide."""
    from torchtune_ppo.rollout.sampling import exponential_noise

    draws = exponential_noise(torch.empty(1 << 24), torch.Generator().manual_seed(0))
    small = draws[draws < 1e-6]
    assert 4 <= small.numel() <= 40  # Poisson(16.8)
    assert small.unique().numel() == small.numel()
