"""The packed loss step against the padded one: same loss, stats and gradients, one graph.

The compiled tests share one compiled artefact (one graph, dynamic in the rows and reads of a
micro-step, compiled once per module) and call it with the same model objects, as the recipe
does.
"""

import copy
import math

import pytest
import torch
from torchtune import training
from torchtune.models.llama3_2._component_builders import llama3_2
from torchtune.modules import TransformerSelfAttentionLayer

from conftest import EOS_ID, PAD_ID, VOCAB, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo import rlhf
from torchtune_ppo.rlhf import packing
from torchtune_ppo.compile import RecompileCounter, compile_count, maybe_compile
from torchtune_ppo._patches.torchtune_modules import final_hidden_states
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rlhf import ScoringSettings, masks_and_positions
from twins.loss_step import ppo_loss_step

P, T = 6, 7
HP = dict(temperature=0.7, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)
CHUNKS = 3  # several output projections per micro-step, of uneven sizes


def _trajectory(policy, value, prompt_lens, stops, seed=0):
    """A scored batch: ``stops[i]`` is the index of row i's stop token (None: never stops)."""
    b = len(prompt_lens)
    g = torch.Generator().manual_seed(seed)
    prompts = left_padded_prompts(prompt_lens, P, seed=seed)
    responses = torch.randint(3, VOCAB, (b, T), generator=g)
    for i, stop in enumerate(stops):
        if stop is not None:
            responses[i, stop] = EOS_ID
    with torch.no_grad():
        traj = score_trajectory(
            torch.cat([prompts, responses], 1), torch.tensor(prompt_lens), None, policy,
            policy, value, lambda *args: torch.zeros(b), torch.tensor([EOS_ID]),
            ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=HP["temperature"], penalise_no_eos=True,
                            min_response_length=None, reward_penalty=-3.0),
        )
    valid = ~traj.response_padding_masks
    # old logprobs and values away from the current ones, so ratios and value clipping engage
    traj = traj._replace(
        logprobs=(traj.logprobs + 0.3 * torch.randn(b, T, generator=g)) * valid,
        values=(traj.values + 0.5 * torch.randn(b, T, generator=g)) * valid,
    )
    advantages = torch.randn(b, T, generator=g) * valid
    returns = torch.randn(b, T, generator=g) * valid
    # the reference policy away from the policy, so the KL terms and their gradients engage
    traj = traj._replace(ref_logprobs=(traj.ref_logprobs + 0.4 * torch.randn(b, T, generator=g)) * valid)
    return traj, advantages, returns


RAGGED = dict(  # a 1-token prompt, a 1-token response, one response without a stop token
    prompt_lens=[6, 1, 3, 4, 2, 5, 1, 6],
    stops=[0, None, 3, 6, 2, 1, 5, 4],
)
OTHER_MIX = dict(  # same shapes, other lengths: more sequences per row
    prompt_lens=[1, 2, 1, 3, 2, 1, 4, 1],
    stops=[1, 0, 2, 0, 1, 3, 0, 2],
)


def _zero_grads(*models):
    for m in models:
        m.zero_grad(set_to_none=True)


def _grads(*models):
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate(models) for n, p in m.named_parameters()}


def _padded(policy, value, traj, advantages, returns, micro_batches, **loss_terms):
    """Today's path: one padded micro-batch each, scaled by 1/grad_accum."""
    _zero_grads(policy, value)
    stats, total = [], 0.0
    for idxs in micro_batches:
        idxs = torch.tensor(idxs)
        loss, s = ppo_loss_step(
            policy, value, traj.query_responses[idxs], traj.masks[idxs], traj.position_ids[idxs],
            traj.response_padding_masks[idxs], traj.logprobs[idxs], traj.values[idxs],
            advantages[idxs], returns[idxs], prompt_len=P, loss_scale=1.0 / len(micro_batches),
            ref_logprobs=traj.ref_logprobs[idxs], **HP, **loss_terms,
        )
        loss.backward()
        stats.append(s)
        total = total + loss.detach()
    return total, stats, _grads(policy, value)


def _packed(step_fn, policy, value, traj, advantages, returns, micro_batches, rows, fixed_shapes=False,
            **loss_terms):
    _zero_grads(policy, value)
    lengths = packing.sequence_lengths(traj, P)
    steps = packing.pack_minibatch(
        traj, advantages, returns, micro_batches, lengths, prompt_len=P, rows=rows, num_chunks=CHUNKS,
        fixed_shapes=fixed_shapes,
    )
    step_stats, total = [], 0.0
    for step in steps:
        loss, s, _ = step_fn(policy, value, *step.mark_dynamic(),
                          num_micro_batches=len(micro_batches), **HP, **loss_terms)
        loss.backward()
        step_stats.append(s)
        total = total + loss.detach()
    return total, packing.micro_batch_stats(step_stats), _grads(policy, value), steps


def _assert_same(packed, padded, atol=1e-5):
    (loss_k, stats_k, grads_k), (loss_p, stats_p, grads_p) = packed[:3], padded
    torch.testing.assert_close(loss_k, loss_p, atol=atol, rtol=0)
    assert len(stats_k) == len(stats_p)
    for g, (sk, sp) in enumerate(zip(stats_k, stats_p)):
        for name, a, b in zip(rlhf.PPOStats._fields, sk, sp):
            assert a.shape == b.shape == ()
            torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"{g}.{name}: {m}")
    assert grads_k.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_k[name], grads_p[name], atol=atol, rtol=0, msg=name)


def _split(order, grad_accum):
    m = len(order) // grad_accum
    return [order[i : i + m] for i in range(0, len(order), m)]


@pytest.mark.parametrize("grad_accum,rows", [(1, 2), (2, 1), (2, 3)])
def test_packed_matches_padded_loss_stats_and_grads(grad_accum, rows):
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    micro_batches = _split([3, 0, 6, 1, 7, 2, 5, 4], grad_accum)
    padded = _padded(policy, value, traj, advantages, returns, micro_batches)
    packed = _packed(packed_ppo_loss_step, policy, value, traj, advantages, returns, micro_batches, rows)
    _assert_same(packed, padded)
    assert max(g.abs().max() for g in padded[2].values()) > 1e-3  # not trivially zero
    assert 0 < padded[1][0].clipfrac < 1.0 / grad_accum  # clipping is exercised


@pytest.mark.parametrize("kl_estimator", ["k1", "k3", "k3+"])
def test_entropy_bonus_and_kl_loss_match_padded(kl_estimator):
    """The entropy bonus (entropy read chunk by chunk) and the KL loss term: the packed step's
    loss, stats and gradients are the padded twin's, whose entropy comes from whole logits."""
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    micro_batches = _split([3, 0, 6, 1, 7, 2, 5, 4], 2)
    terms = dict(entropy_coeff=0.05, kl_coeff=0.3, kl_estimator=kl_estimator)
    padded = _padded(policy, value, traj, advantages, returns, micro_batches, **terms)
    packed = _packed(packed_ppo_loss_step, policy, value, traj, advantages, returns, micro_batches, 2, **terms)
    _assert_same(packed, padded)
    # the terms move the gradients: the same batch without them differs
    plain = _padded(policy, value, traj, advantages, returns, micro_batches)
    assert max((plain[2][k] - packed[2][k]).abs().max() for k in plain[2]) > 1e-4
    entropy, kl = (sum(getattr(s, f) for s in packed[1]) for f in ("entropy", "kl_loss"))
    assert 0 < entropy < math.log(VOCAB)
    assert kl > 1e-3 if kl_estimator != "k1" else abs(kl) > 1e-3


def test_fixed_shape_packing_matches_padded():
    """The layout used under FSDP: every micro-step ``rows x L`` with ``C x K`` reads."""
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    micro_batches = _split([3, 0, 6, 1, 7, 2, 5, 4], 2)
    padded = _padded(policy, value, traj, advantages, returns, micro_batches)
    packed = _packed(packed_ppo_loss_step, policy, value, traj, advantages, returns, micro_batches,
                     rows=2, fixed_shapes=True)
    _assert_same(packed, padded)
    steps = packed[3]
    assert len(steps) >= 2  # 55 tokens do not fit 2 rows of 12
    assert {tuple(s.tokens.shape) for s in steps} == {(2, P + T - 1)}
    assert {tuple(s.read_positions.shape) for s in steps} == {(CHUNKS, 2 * T // CHUNKS + (2 * T % CHUNKS > 0))}


def test_packed_matches_padded_with_activation_checkpointing():
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    micro_batches = _split(list(range(8)), 2)
    padded = _padded(policy, value, traj, advantages, returns, micro_batches)
    for m in (policy, value):  # as the recipe does with enable_activation_checkpointing
        training.set_activation_checkpointing(m, auto_wrap_policy={TransformerSelfAttentionLayer})
    loss, stats, grads, _ = _packed(
        packed_ppo_loss_step, policy, value, traj, advantages, returns, micro_batches, 2
    )
    grads = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in grads.items()}
    _assert_same((loss, stats, grads), padded)


def test_packing_holds_real_tokens_only():
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    lengths = packing.sequence_lengths(traj, P)
    assert lengths.prompt_lens == RAGGED["prompt_lens"]
    spans = [T if s is None else s + 1 for s in RAGGED["stops"]]
    assert lengths.spans == lengths.valid_counts == spans
    steps = packing.pack_minibatch(traj, advantages, returns, [list(range(8))], lengths, prompt_len=P, rows=2)
    real = sum(p + s - 1 for p, s in zip(lengths.prompt_lens, spans))
    for step in steps:  # at most 2 rows, at least MIN_SIZE rows and reads, only the reads it uses
        rows, (c, k) = step.tokens.shape[0], step.read_positions.shape
        assert step.tokens.shape[1] == P + T - 1 and packing.MIN_SIZE <= rows <= 2
        assert all(t.shape[0] == rows for t in step[:3]) and all(t.shape == (1, k) for t in step[3:13])
        assert k == max(packing.MIN_SIZE, int((step.weights > 0).sum()))
    assert sum(int((step.segment_ids >= 0).sum()) for step in steps) == real
    assert sum(int((step.weights > 0).sum()) for step in steps) == sum(spans)
    # every read predicts the response token at its trajectory position
    targets = torch.cat([s.targets[s.weights > 0] for s in steps]).sort().values
    expected = torch.cat([traj.query_responses[i, P : P + n] for i, n in enumerate(spans)]).sort().values
    assert torch.equal(targets, expected)
    # 55 real tokens: first-fit decreasing fills 5 rows of 12 (60 slots); in steps of at most 2
    # rows the last step gets a filler row (72 slots); padded rows would take 8 * 13 = 104.
    assert real == 55 and sum(step.tokens.numel() for step in steps) == 72
    one_step = packing.pack_minibatch(traj, advantages, returns, [list(range(8))], lengths, prompt_len=P, rows=8)
    assert len(one_step) == 1 and one_step[0].tokens.shape == (5, P + T - 1)
    # reads in 3 chunks: 35 real reads -> 3 chunks of 12, the last read unused
    chunked = packing.pack_minibatch(traj, advantages, returns, [list(range(8))], lengths, prompt_len=P,
                                     rows=8, num_chunks=3)[0]
    assert chunked.read_positions.shape == (3, 12) and int((chunked.weights > 0).sum()) == sum(spans) == 35
    assert torch.equal(chunked.targets.flatten()[:35], one_step[0].targets[0])


def test_plan_places_whole_sequences_without_overlap():
    tokens = [10, 3, 7, 9, 1, 5, 10, 2, 6]
    reads = [4, 1, 7, 2, 1, 5, 9, 2, 3]
    places, step_rows, step_reads = packing.plan_micro_steps(tokens, reads, rows=2, row_len=10, max_reads=12)
    num_steps = len(step_rows)
    assert all(r <= 2 for r in step_rows) and all(r <= 12 for r in step_reads)
    assert sum(step_reads) == sum(reads)
    slots, read_slots = set(), set()
    for n, r, (step, slot, read) in zip(tokens, reads, places):
        assert slot // 10 == (slot + n - 1) // 10 < 2  # inside one of the step's two rows
        cells = {(step, slot + j) for j in range(n)}
        assert not cells & slots
        slots |= cells
        cells = {(step, read + j) for j in range(r)}
        assert not cells & read_slots and read + r <= 12
        read_slots |= cells
    assert {step for step, _, _ in places} == set(range(num_steps))
    assert 3 <= num_steps <= 4  # >= 53 tokens / 20 slots and 34 reads / 12
    with pytest.raises(ValueError, match="does not fit"):
        packing.plan_micro_steps([11], [1], rows=2, row_len=10, max_reads=12)


def _tied_policy():
    torch.manual_seed(0)
    return llama3_2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                    max_seq_len=64, intermediate_dim=64, tie_word_embeddings=True)


@pytest.mark.parametrize("build", [tiny_policy, _tied_policy], ids=["linear", "tied"])
def test_chunked_logprobs_equal_log_softmax_of_full_logits(build):
    model = build()
    prompts = left_padded_prompts([6, 2, 4], P)
    masks, pos = masks_and_positions(torch.tensor([6, 2, 4]), P, 0)
    with torch.no_grad():
        full = model(prompts, mask=masks, input_pos=pos)  # [3, P, V]
        hidden = final_hidden_states(model, prompts, mask=masks, input_pos=pos)
        torch.testing.assert_close(model.output(hidden).float(), full, atol=1e-6, rtol=0)
        targets = torch.randint(0, VOCAB, (3 * P,), generator=torch.Generator().manual_seed(0))
        got = rlhf.chunked_logprobs(model.output, hidden.flatten(0, 1), targets, 0.7, chunk_size=5)
        one = rlhf.token_logprobs(model.output, hidden.flatten(0, 1), targets, 0.7)
    expected = torch.log_softmax(full.flatten(0, 1) / 0.7, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(one, expected, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- compiled


@pytest.fixture(scope="module")
def compiled():
    """One compiled packed step and the models it is always called with."""
    return maybe_compile(packed_ppo_loss_step, enabled=True), (tiny_policy(), tiny_classifier())


@pytest.mark.slow  # compiles
def test_compiled_packed_matches_padded_and_never_recompiles(compiled):
    step_fn, (policy, value) = compiled
    counter = RecompileCounter()
    graphs = compile_count()
    for call, (mix, seed, order) in enumerate([
        (RAGGED, 0, [3, 0, 6, 1, 7, 2, 5, 4]),
        (OTHER_MIX, 1, [0, 1, 2, 3, 4, 5, 6, 7]),
        (RAGGED, 2, [7, 6, 5, 4, 3, 2, 1, 0]),
    ]):
        traj, advantages, returns = _trajectory(policy, value, seed=seed, **mix)
        micro_batches = _split(order, 2)
        eager = copy.deepcopy(policy), copy.deepcopy(value)
        padded = _padded(*eager, traj, advantages, returns, micro_batches)
        packed = _packed(step_fn, policy, value, traj, advantages, returns, micro_batches, rows=3)
        _assert_same(packed, padded)
        if call == 0:
            assert compile_count() - graphs == 1  # one graph for every micro-step
            counter.mark()
    assert counter.since_mark == 0


@pytest.mark.parametrize("aggregation", [a for a in rlhf.AGGREGATIONS if a != "token-mean"])
def test_seq_mean_aggregations_do_not_depend_on_the_micro_batch_split(aggregation):
    """The seq-mean losses weight by sequence over the whole minibatch: gradient_accumulation_steps
    1, 2 and 4 give the same loss and gradients (token-mean, torchtune's, averages micro-batch
    means and so depends on the split)."""
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    lengths = packing.sequence_lengths(traj, P)
    order = [3, 0, 6, 1, 7, 2, 5, 4]
    results = []
    for grad_accum in (1, 2, 4):
        _zero_grads(policy, value)
        steps = packing.pack_minibatch(traj, advantages, returns, _split(order, grad_accum), lengths,
                                       prompt_len=P, rows=2, num_chunks=CHUNKS, aggregation=aggregation)
        total = 0.0
        for step in steps:
            loss, _, _ = packed_ppo_loss_step(policy, value, *step, num_micro_batches=grad_accum, **HP)
            loss.backward()
            total = total + loss.detach()
        results.append((total, _grads(policy, value)))
    (loss_1, grads_1), *others = results
    assert max(g.abs().max() for g in grads_1.values()) > 1e-3
    for loss_k, grads_k in others:
        torch.testing.assert_close(loss_k, loss_1, atol=1e-5, rtol=0)
        for name in grads_1:
            torch.testing.assert_close(grads_k[name], grads_1[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # compiles
def test_compiled_loss_options_match_eager():
    """Clip-higher, dual-clip, a seq-mean aggregation, the entropy bonus and a straight-through
    KL loss term through the compiled step: the same loss, stats and gradients as the eager one."""
    policy, value = tiny_policy(), tiny_classifier()
    traj, advantages, returns = _trajectory(policy, value, **RAGGED)
    lengths = packing.sequence_lengths(traj, P)
    micro_batches = _split([3, 0, 6, 1, 7, 2, 5, 4], 2)
    steps = packing.pack_minibatch(traj, advantages, returns, micro_batches, lengths, prompt_len=P, rows=2,
                                   num_chunks=CHUNKS, aggregation="seq-mean-token-mean")
    options = dict(HP, epsilon_low=0.1, epsilon_high=0.3, dual_clip=1.2, num_micro_batches=2,
                   entropy_coeff=0.05, kl_coeff=0.3, kl_estimator="k3+")
    results = []
    for step_fn in (packed_ppo_loss_step, maybe_compile(packed_ppo_loss_step, enabled=True)):
        _zero_grads(policy, value)
        step_stats, total = [], 0.0
        for step in steps:
            loss, s, _ = step_fn(policy, value, *step.mark_dynamic(), **options)
            loss.backward()
            step_stats.append(s)
            total = total + loss.detach()
        results.append((total, packing.micro_batch_stats(step_stats), _grads(policy, value)))
    _assert_same(results[1], results[0])
    stats = results[0][1]
    assert sum(s.dualclip_frac for s in stats) > 0 and sum(s.clipfrac_low for s in stats) > 0
    assert sum(s.entropy for s in stats) > 0 and sum(s.kl_loss for s in stats) > 1e-3
