"""Speculative rollouts (torchtune_ppo.rollout.speculative): position-keyed noise makes a row's
response a function of its key alone, and drafts of every kind (right, wrong, right up to a stop
token, longer than the room left, empty) give plain decoding's response token for token, under
temperature, top-k, top-p, greedy and groups, eager and compiled with 0 recompiles."""

import pytest
import torch
from torchtune.models.llama3_2._component_builders import llama3_2

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from omegaconf import OmegaConf

from torchtune_ppo.compile import compile_count, generation_steps
from torchtune_ppo.config import validate_config
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.rollout.speculative import DraftStore, Speculation, keyed_noise, mix64, row_keys

VOCAB, P, T, B, PAD, STOP = 96, 8, 16, 4, 0, 5
LENS = [3, 8, 5, 6]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = llama3_2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                 max_seq_len=48, intermediate_dim=128)
    with torch.no_grad():  # tied std-1 embeddings make every distribution one-hot; ~3 nats instead
        m.tok_embeddings.weight.mul_(0.15)
    return m.requires_grad_(False)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(6, VOCAB, (len(lengths), P), generator=g)
    for r, n in enumerate(lengths):
        out[r, :P - n] = PAD
    return out, torch.tensor(lengths)


def generator(model, draft_tokens=4, **kw):
    args = dict(batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD, stop_token_ids=[STOP])
    return Generator(model, draft_tokens=draft_tokens, **{**args, **kw})


def valid(responses):
    """[b, T] bool: positions up to and including the first stop token."""
    stop = responses == STOP
    return (stop.cumsum(-1) - stop.long()) == 0


def test_keyed_noise_is_a_function_of_key_and_position_only():
    g = torch.Generator()
    a = keyed_noise(torch.empty(2, 3, 50), [11, 12], [[0, 1, 2], [5, 6, 7]], g)
    b = keyed_noise(torch.empty(1, 2, 50), [12], [[6, 7]], g)  # another batch, another chunk
    torch.testing.assert_close(b[0], a[1, 1:], rtol=0, atol=0)
    assert not torch.equal(a[0, 0], a[0, 1]) and not torch.equal(a[0, 0], a[1, 0])
    assert bool((a > 0).all())
    # Exponential(1): the mean of 15000 draws within 4 standard errors of 1
    many = keyed_noise(torch.empty(1, 300, 50), [3], [range(300)], g)
    assert abs(many.mean().item() - 1) < 4 / 15000 ** 0.5
    assert mix64(1, 2) != mix64(2, 1) and mix64(1, 2) == mix64(1, 2)


def test_row_keys_follow_the_prompt_not_the_row():
    prompts, lens = prompts_of(LENS)
    keys, ids = row_keys(prompts, lens, seed=3, round=7)
    order = [2, 0, 3, 1]
    keys2, ids2 = row_keys(prompts[order], lens[order], seed=3, round=7)
    assert keys2 == [keys[i] for i in order] and ids2 == [ids[i] for i in order]
    # repeated prompts (a group) get sample indices 0, 1, ...; another round or seed other keys
    rep = prompts[[0, 0, 1, 0]]
    keys3, ids3 = row_keys(rep, lens[[0, 0, 1, 0]], seed=3, round=7)
    assert [i[1] for i in ids3] == [0, 1, 0, 2] and len(set(keys3)) == 4 and keys3[0] == keys[0]
    assert row_keys(prompts, lens, seed=3, round=8)[0][0] != keys[0]
    assert row_keys(prompts, lens, seed=4, round=7)[0][0] != keys[0]


def test_keyed_decoding_gives_each_prompt_its_response_wherever_it_sits(model):
    gen = generator(model, draft_tokens=0, top_k=20)
    prompts, lens = prompts_of(LENS)
    keys, _ = row_keys(prompts, lens, seed=0, round=0)
    out = gen.generate(prompts, lens, noise_keys=keys)
    order = [3, 1, 0]
    moved = gen.generate(prompts[order], lens[order], noise_keys=[keys[i] for i in order])
    torch.testing.assert_close(moved.query_responses, out.query_responses[order], rtol=0, atol=0)
    # the global generator's state is neither read nor moved
    state = torch.get_rng_state()
    again = gen.generate(prompts, lens, noise_keys=keys)
    assert torch.equal(again.query_responses, out.query_responses) and torch.equal(torch.get_rng_state(), state)


SAMPLINGS = [dict(), dict(top_k=20), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=30, top_p=0.8),
             dict(top_k=1)]


def drafts_of(plain_responses):
    """Drafts of every kind for 4 rows, from plain decoding's responses."""
    right = [r.tolist() for r in plain_responses]
    wrong = [[(t + 1) % VOCAB for t in r] for r in right]
    stop_at = [r[: r.index(STOP) + 1] if STOP in r else r[:6] for r in right]  # right up to its stop token
    return {
        "right": right,
        "wrong": wrong,
        "right_until_a_stop": stop_at,
        "longer_than_the_room": [r + [7] * 40 for r in right],
        "right_then_wrong": [r[:7] + [(t + 1) % VOCAB for t in r[7:]] for r in right],
        "mixed_and_empty": [right[0], None, wrong[2], []],
    }


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "plain")
def test_every_draft_gives_plain_decodings_response(model, sampling):
    gen = generator(model, **sampling)
    prompts, lens = prompts_of(LENS)
    keys, _ = row_keys(prompts, lens, seed=1, round=0)
    plain = gen.generate(prompts, lens, noise_keys=keys)
    keep = valid(plain.query_responses[:, P:])
    for name, drafts in drafts_of(plain.query_responses[:, P:]).items():
        gen.spec_stats.reset()
        out = gen.generate(prompts, lens, noise_keys=keys, drafts=drafts)
        assert torch.equal(out.query_responses, plain.query_responses), name
        torch.testing.assert_close(out.logprobs[keep], plain.logprobs[keep], rtol=0, atol=1e-5)
        metrics = gen.spec_stats.metrics()
        if name in ("right", "longer_than_the_room"):
            assert metrics["spec/acceptance"] == 1.0 and metrics["spec/forwards"] < T / 2, (name, metrics)
        if name == "wrong":
            assert metrics["spec/acceptance"] == 0.0, metrics


def test_rows_without_a_draft_keep_the_forwards_narrow_under_min_draft_rows(model):
    prompts, lens = prompts_of(LENS)
    keys, _ = row_keys(prompts, lens, seed=1, round=0)
    counts = {}
    for share in (0.0, 0.5, 1.0):
        gen = generator(model, top_k=20, min_draft_rows=share)
        plain = gen.generate(prompts, lens, noise_keys=keys)
        right = [r.tolist() for r in plain.query_responses[:, P:]]
        gen.spec_stats.reset()
        out = gen.generate(prompts, lens, noise_keys=keys, drafts=[right[0], right[1], None, None])
        assert torch.equal(out.query_responses, plain.query_responses)
        counts[share] = gen.spec_stats.verify_forwards
    # two of four rows have drafts: wide forwards at 0 and 0.5, none at 1
    assert counts[0.0] > 0 and counts[0.5] > 0 and counts[1.0] == 0, counts
    with pytest.raises(ValueError, match="min_draft_rows=1.5"):
        generator(model, min_draft_rows=1.5)


def test_groups_share_the_prefill_and_keep_their_own_noise(model):
    gen = generator(model, group_size=2, top_k=30)
    prompts, lens = prompts_of([4, 7])
    prompts, lens = prompts.repeat_interleave(2, 0), lens.repeat_interleave(2)
    keys, ids = row_keys(prompts, lens, seed=2, round=0)
    assert [i[1] for i in ids] == [0, 1, 0, 1]
    plain = gen.generate(prompts, lens, noise_keys=keys)
    assert not torch.equal(plain.query_responses[0], plain.query_responses[1])  # two samples of one prompt
    for drafts in drafts_of(plain.query_responses[:, P:]).values():
        assert torch.equal(gen.generate(prompts, lens, noise_keys=keys, drafts=drafts).query_responses,
                           plain.query_responses)


@pytest.mark.slow
def test_compiled_verification_equals_eager_with_no_recompile(model):
    eager = generator(model, top_k=30)
    compiled = generator(model, top_k=30, steps=generation_steps(compiled=True))
    prompts, lens = prompts_of(LENS)
    first = None
    for rnd in range(3):  # acceptance from all to none, and back
        keys, _ = row_keys(prompts, lens, seed=5, round=rnd)
        plain = eager.generate(prompts, lens, noise_keys=keys)
        for drafts in drafts_of(plain.query_responses[:, P:]).values():
            out = compiled.generate(prompts, lens, noise_keys=keys, drafts=drafts)
            assert torch.equal(out.query_responses, plain.query_responses)
        first = compile_count() if first is None else first  # after the first round's calls
    assert compile_count() == first  # prefill, verify and verify_one compiled once, in the first round


def test_drafts_are_refused_without_keys_or_room(model):
    prompts, lens = prompts_of(LENS)
    with pytest.raises(ValueError, match="drafts need noise_keys"):
        generator(model).generate(prompts, lens, drafts=[[1]] * 4)
    with pytest.raises(ValueError, match="draft_tokens > 0"):
        generator(model, draft_tokens=0).generate(prompts, lens, noise_keys=[1, 2, 3, 4], drafts=[[1]] * 4)
    with pytest.raises(ValueError, match="noise_keys has 3 keys for 4 prompts"):
        generator(model).generate(prompts, lens, noise_keys=[1, 2, 3])
    with pytest.raises(ValueError, match="draft_tokens=-1"):
        generator(model, draft_tokens=-1)


def test_draft_store_is_bounded_and_round_trips():
    store = DraftStore(max_entries=2)
    big = (1 << 64) - 5  # a digest above int64's range survives the round trip
    store.put((big, 0), torch.tensor([4, 5, 6]))
    store.put((7, 1), torch.tensor([8]))
    store.put((big, 0), torch.tensor([9, 9]))  # replaced, now the newest
    store.put((3, 0), torch.tensor([1, 2]))  # evicts (7, 1), the oldest
    assert store.get((7, 1)) is None and store.get((big, 0)).tolist() == [9, 9]
    copy = DraftStore(max_entries=2)
    copy.load_state_dict(store.state_dict())
    assert list(copy._entries) == list(store._entries)
    assert all(torch.equal(copy.get(k), v) for k, v in store._entries.items())
    with pytest.raises(ValueError, match="speculative.max_stored=0"):
        DraftStore(0)


def test_speculation_records_valid_tokens_and_keys_by_round():
    spec = Speculation(seed=0, noise="per_prompt")
    prompts, lens = prompts_of(LENS)
    keys, ids = spec.keys(prompts, lens, step=3)
    assert keys == spec.keys(prompts, lens, step=9)[0]  # per_prompt: one round for the run
    assert Speculation(seed=0).keys(prompts, lens, step=3)[0] != Speculation(seed=0).keys(prompts, lens, step=9)[0]
    assert spec.drafts(ids) == [None] * 4
    responses = torch.arange(4 * T).view(4, T)
    spec.record(ids, responses, torch.tensor([2, 0, T, 5]))
    assert spec.drafts(ids) == [[0, 1], [], responses[2].tolist(), responses[3, :5].tolist()]
    assert Speculation(seed=0, draft="none").drafts(ids) is None
    with pytest.raises(ValueError, match="noise='every'"):
        Speculation(seed=0, noise="every")


ROOT = __import__("pathlib").Path(__file__).parents[2]


@pytest.mark.parametrize("config, overrides, pattern", [
    ("ppo_tiny_tools.yaml", [], r"speculative.enabled=True with env \(multi-turn episodes\).*speculative.enabled=False"),
    ("ppo_tiny_sentiment.yaml", ["compile.rollout=True"], r"speculative.enabled=True with compile.rollout=True"),
    ("ppo_tiny_sentiment.yaml", ["speculative.draft=last"],
     r"speculative.draft must be one of \['previous', 'ngram', 'drafter', 'none'\]"),
    ("ppo_tiny_sentiment.yaml", ["speculative.draft=drafter"],
     r"speculative.draft=drafter with speculative.drafter=null: a drafter component"),
    ("ppo_tiny_sentiment.yaml", ["speculative.drafter._component_=test_speculative.LastResponseDrafter"],
     r"speculative.draft=previous with speculative.drafter=set"),
    ("ppo_tiny_sentiment.yaml", ["speculative.draft=drafter", "speculative.drafter._component_=my_drafts.Drafter"],
     r"speculative.drafter._component_.*my_drafts"),
    ("ppo_tiny_sentiment.yaml", ["speculative.max_draft_tokens=0"], r"speculative.max_draft_tokens"),
    ("ppo_tiny_sentiment.yaml", ["speculative.drafts=3"], r"speculative.*unknown.*drafts|drafts.*speculative"),
])
def test_config_refuses_what_speculation_cannot_do(config, overrides, pattern):
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "recipes/configs/tiny" / config),
                          OmegaConf.from_dotlist(["speculative.enabled=True", *overrides]))
    with pytest.raises(ValueError, match=pattern):
        validate_config(cfg)


def test_config_defaults_leave_speculation_off():
    cfg = validate_config(OmegaConf.load(ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"))
    assert cfg.speculative.enabled is False and Speculation.from_config(cfg, 0) is None
    cfg.speculative.enabled = True
    spec = Speculation.from_config(cfg, 0)
    assert (spec.draft, spec.noise, spec.store.max_entries) == ("previous", "per_step", 65536)
    from torchtune_ppo.rollout import speculative_args
    assert speculative_args(cfg) == dict(draft_tokens=8, min_draft_rows=0.5)
    cfg.speculative.draft = "none"
    assert speculative_args(cfg)["draft_tokens"] == 0


def test_draft_lookup_picks_a_draft_up_again_after_one_different_token():
    from torchtune_ppo.rollout.generation import draft_lookup

    draft = [10, 11, 12, 13, 14, 15, 16, 17]
    # sampled one extra token (99) after 12: the draft is found again after "12 13" -> 14 ...
    assert draft_lookup(draft, [10, 11, 12, 99, 12, 13], 3) == [14, 15, 16]
    assert draft_lookup(draft, [10, 11, 12, 13, 14], 2) == [15, 16]  # aligned: the same as by position
    assert draft_lookup(draft, [10, 11, 98, 99], 3) == []  # the last tokens are nowhere in the draft
    assert draft_lookup(draft, [16, 17], 3) == []  # found at the draft's end: nothing follows
    # of two occurrences, the one nearest the row's own position
    assert draft_lookup([1, 2, 7, 0, 0, 1, 2, 8], [5, 5, 5, 5, 1, 2], 1) == [8]


def test_a_draft_one_token_out_of_step_is_still_accepted(model):
    gen = generator(model, top_k=1)  # greedy: the shifted draft is right after the inserted token
    prompts, lens = prompts_of(LENS)
    plain = gen.generate(prompts, lens, noise_keys=None)
    right = [r.tolist() for r in plain.query_responses[:, P:]]
    shifted = [r[:4] + [r[4] + 1] + r[4:] for r in right]  # one token too many at position 4
    gen.spec_stats.reset()
    out = gen.generate(prompts, lens, drafts=shifted)
    assert torch.equal(out.query_responses, plain.query_responses)
    assert gen.spec_stats.metrics()["spec/acceptance"] > 0.5


@pytest.mark.parametrize("sampling", [dict(top_k=1), dict(top_k=20), dict(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "top_k", "top_p"])
def test_prompt_lookup_gives_plain_decodings_response(model, sampling):
    gen = generator(model, **sampling)
    prompts, lens = prompts_of(LENS)
    prompts[:, -4:] = prompts[:, -8:-4]  # each prompt ends with its own 4 tokens repeated: something to look up
    keys, _ = row_keys(prompts, lens, seed=3, round=0)
    plain = gen.generate(prompts, lens, noise_keys=keys)
    gen.spec_stats.reset()
    out = gen.generate(prompts, lens, noise_keys=keys, drafts=[None] * 4, prompt_lookup=True)
    assert torch.equal(out.query_responses, plain.query_responses)
    assert gen.spec_stats.draft_tokens > 0  # guesses were offered
    if sampling == dict(top_k=1):  # greedy decoding of this model cycles: its own tokens come back
        assert gen.spec_stats.metrics()["spec/acceptance"] > 0.3


def test_ngram_speculation_passes_no_stored_drafts():
    spec = Speculation(seed=0, draft="ngram")
    prompts, lens = prompts_of(LENS)
    _, ids = spec.keys(prompts, lens, step=0)
    spec.record(ids, torch.zeros(4, T, dtype=torch.long), torch.full((4,), 3))
    assert spec.drafts(ids) == [None] * 4 and len(spec.store) == 0


# ---- a user's own drafter (draft: drafter) ----------------------------------------------------


class LastResponseDrafter:
    """A drafter as a user writes one: each (prompt, sample index)'s last response, kept in
    ``record``, with a state dict. ``calls`` counts what it was asked."""

    def __init__(self, shift: int = 0):
        self.shift, self.last, self.calls = shift, {}, []

    def __call__(self, prompts, sample_indices):
        self.calls.append((prompts, sample_indices))
        return [None if (tuple(p), i) not in self.last else [(t + self.shift) % VOCAB for t in self.last[tuple(p), i]]
                if self.shift else self.last[tuple(p), i] for p, i in zip(prompts, sample_indices)]

    def record(self, prompts, sample_indices, responses):
        for p, i, r in zip(prompts, sample_indices, responses):
            self.last[tuple(p), i] = list(r)

    def state_dict(self):
        return {"last": [[list(p), i, r] for (p, i), r in self.last.items()]}

    def load_state_dict(self, state):
        self.last = {(tuple(p), i): r for p, i, r in state["last"]}


@pytest.mark.parametrize("shift", [0, 1], ids=["right", "wrong"])
def test_a_drafters_drafts_give_plain_decodings_response(model, shift):
    """A user's drafter is asked with each row's prompt tokens and sample index, sees what was
    sampled, and its drafts, right or wrong, leave the samples as plain decoding's."""
    from torchtune_ppo.rollout.speculative import real_prompts

    gen = generator(model, top_k=20)
    prompts, lens = prompts_of(LENS)
    drafter = LastResponseDrafter(shift)
    spec = Speculation(seed=0, draft="drafter", noise="per_prompt", drafter=drafter)
    keys, ids = spec.keys(prompts, lens, step=0)
    real = real_prompts(prompts, lens)
    assert real == [prompts[r, P - n:].tolist() for r, n in enumerate(LENS)]
    plain = gen.generate(prompts, lens, noise_keys=keys)
    assert spec.drafts(ids, real, vocab_size=VOCAB) == [None] * 4  # nothing recorded yet
    responses = plain.query_responses[:, P:]
    spec.record(ids, responses, valid(responses).sum(-1), real)
    drafts = spec.drafts(ids, real, vocab_size=VOCAB)
    assert drafter.calls[-1] == (real, [0, 0, 0, 0])
    assert drafts[0][:3] == [(t + shift) % VOCAB for t in responses[0, :3].tolist()]
    gen.spec_stats.reset()
    out = gen.generate(prompts, lens, noise_keys=keys, drafts=drafts)
    assert torch.equal(out.query_responses, plain.query_responses)
    acceptance = gen.spec_stats.metrics()["spec/acceptance"]
    assert acceptance > 0.9 if shift == 0 else acceptance < 0.1
    # its state goes into the run's checkpoints and comes back
    again = Speculation(seed=0, draft="drafter", noise="per_prompt", drafter=LastResponseDrafter(shift))
    again.load_state_dict(spec.state_dict())
    assert again.drafts(ids, real, vocab_size=VOCAB) == drafts


@pytest.mark.parametrize("answer, pattern", [
    (lambda p, i: [[1, 2]] * (len(p) - 1), r"4 rows, got 3 items"),
    (lambda p, i: "abc", r"4 rows, got str"),
    (lambda p, i: [[1, 2], None, "7 8", None], r"row 2's draft is str 7 8, not token ids"),
    (lambda p, i: [[1, 2.0], None, None, None], r"row 0's draft is list .*not token ids"),
    (lambda p, i: [None, [3, VOCAB], None, None], rf"row 1's draft has token id {VOCAB}, outside the vocabulary"),
    (lambda p, i: [None, None, None, [-1]], r"row 3's draft has token id -1"),
])
def test_a_drafters_bad_answer_is_refused_by_name(answer, pattern):
    spec = Speculation(seed=0, draft="drafter", drafter=answer)
    prompts, lens = prompts_of(LENS)
    from torchtune_ppo.rollout.speculative import real_prompts

    _, ids = spec.keys(prompts, lens, step=0)
    with pytest.raises(ValueError, match="speculative.drafter must return one draft per row.*" + pattern):
        spec.drafts(ids, real_prompts(prompts, lens), vocab_size=VOCAB)
    # tensors and arrays of token ids are taken
    ok = Speculation(seed=0, draft="drafter", drafter=lambda p, i: [torch.tensor([1, 2]), None, [3], []])
    assert ok.drafts(ids, real_prompts(prompts, lens), vocab_size=VOCAB) == [[1, 2], None, [3], []]
    with pytest.raises(TypeError, match="speculative.drafter: int is not callable"):
        Speculation(seed=0, draft="drafter", drafter=3)


def test_a_drafter_named_in_the_config_runs_in_the_recipe(make_recipe, tmp_path):
    """``draft: drafter`` with ``speculative.drafter._component_``: the recipe builds it, the
    second visit of each prompt is drafted by it (one batch an epoch, one noise round) as the
    built-in ``previous`` drafts it, and the run's samples are those of the run without drafts."""
    from test_recipe_wiring_options import _prompts

    # one batch an epoch: step 2 sees step 1's prompts
    common = {"dataset.data_files": _prompts(tmp_path, 8), "num_ppo_steps": 2, "speculative.enabled": True,
              "speculative.noise": "per_prompt"}
    runs = {}
    for name, extra in (("none", {"speculative.draft": "none"}), ("previous", {}),
                        ("drafter", {"speculative.draft": "drafter",
                                     "speculative.drafter._component_": "test_speculative.LastResponseDrafter"})):
        recipe, _ = make_recipe(**common, **extra)
        logged = []
        recipe.train(on_step=lambda step, metrics: logged.append(dict(metrics)))
        runs[name] = (recipe, logged)
    drafter = runs["drafter"][0]._rollout.speculation.drafter
    assert isinstance(drafter, LastResponseDrafter) and len(drafter.last) == 8
    for a, b in zip(runs["none"][1], runs["drafter"][1]):
        assert (a["scores"], a["response_lengths"]) == (b["scores"], b["response_lengths"])
    # drafted as the built-in `previous` drafts: the same acceptance (step 2's weights moved: not all)
    spec = [[(r["spec/rows_with_draft"], r["spec/acceptance"]) for r in runs[k][1]] for k in ("previous", "drafter")]
    assert spec[0] == spec[1] and spec[1][0] == (0.0, 0.0) and spec[1][1][0] == 1.0 and spec[1][1][1] > 0.3
