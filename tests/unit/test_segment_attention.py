"""Packed rows' attention by sequence (``segment_attention``): the layout by hand, the keys each
slot sees against the block-causal masks, and the models, scoring and the loss step against the
masked path, eager and compiled.

Tolerance: 1e-5 absolute in float32 on these tiny models, as ``test_shared_prompt.py``: both
paths take the same softmax over the same kept keys, the masked one with the row's other slots
at -inf (exact zeros), so only the order of the sums differs (measured ~1e-6); a missing or
extra key moves values by 1e-2 or more (``test_a_wrong_layout_is_caught``).
"""

import pytest
import torch

from conftest import VOCAB, tiny_classifier, tiny_policy
from torchtune_ppo._patches.torchtune_modules import (SegmentLayout, accepts_segment_layouts, final_hidden_states,
                                                       use_segment_attention)
from torchtune_ppo.compile import BACKEND_ENV, RecompileCounter, maybe_compile
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.ppo.update import LossSettings, PPOUpdate
from torchtune_ppo.rlhf import block_causal_masks, packing
from torchtune_ppo.rlhf.segments import segment_layout
from torchtune_ppo.rollout.scoring import packed_score_trajectory, plan_scoring
import test_shared_prefix as prefix_case
import test_shared_prompt as group_case

ATOL = 1e-5


def _prepared(*models):
    for m in models:
        if m is not None:
            use_segment_attention(m)
    return models


def _seen(layout: SegmentLayout, slots: int) -> torch.Tensor:
    """bool ``[slots, slots]``: the keys (slots) each used query slot attends through ``layout``."""
    seen = torch.zeros(slots, slots, dtype=torch.bool)
    for s in range(layout.q_index.shape[0]):
        for i in range(layout.q_index.shape[1]):
            flat = s * layout.q_index.shape[1] + i
            owners = (layout.out_index.flatten() == flat).nonzero().flatten()
            for q in owners.tolist():
                if layout.q_index[s, i] == q:  # the slot whose output this is
                    seen[q, layout.kv_index[s][layout.mask[s, i]]] = True
    return seen


def _check_against_masks(segment_ids: torch.Tensor, prefix_ids=None) -> SegmentLayout:
    """The layout of ``segment_ids`` lets each used slot see exactly what the block-causal mask does."""
    R, L = segment_ids.shape
    layout = segment_layout(segment_ids.flatten().tolist(),
                            None if prefix_ids is None else prefix_ids.flatten().tolist(), row_len=L)
    masks = block_causal_masks(segment_ids, prefix_ids)  # [R, L, L]
    dense = torch.block_diag(*masks)  # flat slots: rows never see each other
    used = segment_ids.flatten() >= 0
    seen = _seen(layout, R * L)
    assert torch.equal(seen[used], dense[used])
    # every used slot's output is its own query's
    q_of = layout.q_index.flatten()[layout.out_index.flatten()]
    assert torch.equal(q_of[used], torch.arange(R * L)[used])
    assert layout.mask.any(-1).all()  # no query row without a key (padded ones see column 0)
    return layout


# --- the layout by hand ----------------------------------------------------------------------


def test_layout_by_hand():
    # one row: a prompt copy (segment 0) of 2 slots, response A (segment 5) of 2, response B (6)
    # of 1, then a lone sequence (segment 1) of 2 and an unused slot
    seg = torch.tensor([[0, 0, 5, 5, 6, 1, 1, -8]])
    prefix = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -8]])
    layout = _check_against_masks(seg, prefix)
    assert layout.q_index.tolist() == [[0, 1], [2, 3], [4, 0], [5, 6]]
    assert layout.kv_index.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 1, 4, 0], [0, 0, 5, 6]]
    T, F = True, False
    assert layout.mask.tolist() == [
        [[F, F, T, F], [F, F, T, T]],  # the copy: causal over itself
        [[T, T, T, F], [T, T, T, T]],  # A: the copy, then itself causally
        [[T, T, T, F], [T, F, F, F]],  # B: one query; its padded query sees column 0
        [[F, F, T, F], [F, F, T, T]],  # the lone sequence
    ]
    assert layout.out_index.tolist() == [[0, 1, 2, 3, 4, 6, 7, 0]]


def test_layout_without_prefixes_and_with_few_segments():
    # two rows: three sequences and unused slots; at least 2 segments even when one is used
    _check_against_masks(torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -2, -3]]))
    one = _check_against_masks(torch.tensor([[4, 4, 4, -1]]))
    assert one.q_index.shape == (2, 3) and one.kv_index.shape == (2, 3)


def test_layout_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="not whole rows of row_len=4"):
        segment_layout([0, 0, 0, 0, 1], None, row_len=4)
    with pytest.raises(ValueError, match="names prefix 7, which is not a used segment before it"):
        segment_layout([0, 0, 1, 1], [0, 0, 7, 7], row_len=4)


# --- the models ------------------------------------------------------------------------------


def _packed_rows(seed=0):
    """Two rows of 12 slots: a prompt copy and three responses, then two sequences and filler."""
    seg = torch.tensor([[0, 0, 0, 10, 10, 11, 11, 11, 12, 12, 12, 12], [1, 1, 1, 1, 1, 2, 2, 2, 2, -1, -2, -3]])
    prefix = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 2, 2, 2, 2, -1, -2, -3]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]])
    tokens = torch.randint(3, VOCAB, seg.shape, generator=torch.Generator().manual_seed(seed))
    return tokens, seg, prefix, pos


def test_segment_attention_equals_the_masks_in_a_model():
    policy = tiny_policy(0)
    assert not accepts_segment_layouts(policy)
    _prepared(policy)
    assert accepts_segment_layouts(policy) and use_segment_attention(policy) == 0  # idempotent
    tokens, seg, prefix, pos = _packed_rows()
    layout = _check_against_masks(seg, prefix)
    used = seg >= 0
    with torch.no_grad():
        masked = final_hidden_states(policy, tokens, mask=block_causal_masks(seg, prefix), input_pos=pos)
        by_sequence = final_hidden_states(policy, tokens, mask=layout, input_pos=pos)
    torch.testing.assert_close(by_sequence[used], masked[used], atol=ATOL, rtol=0)
    assert masked[used].abs().max() > 0.1


def test_a_wrong_layout_is_caught():
    """The equality above can fail: without the prompt copy as the responses' prefix, their
    states move."""
    policy, = _prepared(tiny_policy(0))
    tokens, seg, prefix, pos = _packed_rows()
    wrong = segment_layout(seg.flatten().tolist(), seg.flatten().tolist(), row_len=seg.shape[1])
    with torch.no_grad():
        masked = final_hidden_states(policy, tokens, mask=block_causal_masks(seg, prefix), input_pos=pos)
        by_sequence = final_hidden_states(policy, tokens, mask=wrong, input_pos=pos)
    assert (by_sequence[0, 3:] - masked[0, 3:]).abs().max() > 1e-2


def test_bf16_segment_attention_within_bf16_rounding():
    """bf16 on CPU (attention computed in fp32, the recipe's): the same states up to bf16's
    rounding of the layers' products (8 bits of mantissa: 2 ** -8 relative, a few ulps here)."""
    from torchtune_ppo._patches.torchtune_modules import use_fp32_attention

    policy = tiny_policy(0).to(torch.bfloat16)
    use_fp32_attention(policy)
    _prepared(policy)
    tokens, seg, prefix, pos = _packed_rows(1)
    used = seg >= 0
    with torch.no_grad():
        masked = final_hidden_states(policy, tokens, mask=block_causal_masks(seg, prefix), input_pos=pos)
        by_sequence = final_hidden_states(policy, tokens, mask=_check_against_masks(seg, prefix), input_pos=pos)
    scale = masked[used].float().abs().max()
    torch.testing.assert_close(by_sequence[used].float(), masked[used].float(), atol=float(scale) * 2 ** -6, rtol=0)


# --- scoring and the loss step against the masks -----------------------------------------------


def _score_both(case, qr, lens, models, **plan_kw):
    policy, ref, value, reward = models
    out = []
    for segments in (False, True):
        plan = plan_scoring(lens.tolist(), case._valid_counts(qr), prompt_len=case.P, response_len=case.T,
                            num_chunks=case.CHUNKS, device=qr.device, segment_attention=segments, **plan_kw)
        assert (plan.attention is not None) == segments
        with torch.no_grad():
            out.append(packed_score_trajectory(qr, lens, None, policy, ref, value, reward, case.STOP,
                                               plan.mark_dynamic(plan_kw.get("common_prefix") is not None),
                                               case.SETTINGS))
    return out


@pytest.fixture(scope="module")
def models():
    ms = tiny_policy(0), tiny_policy(1), tiny_classifier(1), tiny_classifier(2)
    for m in ms:
        m.eval().requires_grad_(False)
    return _prepared(*ms)


def test_scoring_by_sequence_matches_the_masks(models):
    qr, lens = prefix_case._generated()  # a prefix every prompt shares, and each prompt whole
    for kw in (dict(common_prefix=packing.prompt_prefix(qr, lens.tolist(), prefix_case.P)), dict()):
        by_sequence, masked = _score_both(prefix_case, qr, lens, models, **kw)[::-1]
        prefix_case._assert_trajectories_close(by_sequence, masked)
    qr, lens = group_case._generated(**group_case.GROUPS)  # groups of N sharing their prompt
    by_sequence, masked = _score_both(group_case, qr, lens, models, group_size=group_case.N)[::-1]
    group_case._assert_trajectories_close(by_sequence, masked)


def _loss_and_grads(step_fn, policy, value, traj, adv, ret, micro_batches, *, segments, **pack):
    for m in (policy, value):
        m.zero_grad(set_to_none=True)
    share = pack.get("share_prefix", False)
    lengths = packing.sequence_lengths(traj, prefix_case.P, common_prefix=share)
    steps = packing.pack_minibatch(traj, adv, ret, micro_batches, lengths, prompt_len=prefix_case.P,
                                   num_chunks=prefix_case.CHUNKS, segment_attention=segments, **pack)
    assert all((s.attention is not None) == segments for s in steps)
    stats, total = [], 0.0
    for step in steps:
        loss, s, _ = step_fn(policy, value, *step.mark_dynamic(share), num_micro_batches=len(micro_batches),
                             **prefix_case.HP)
        loss.backward()
        stats.append(s)
        total = total + loss.detach()
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate((policy, value))
             for n, p in m.named_parameters() if p.grad is not None}
    return total, packing.micro_batch_stats(stats), grads, steps


PACKINGS = {
    "prefix": dict(share_prefix=True, rows=2, max_reads=5 * prefix_case.T),
    "prefix, short rows": dict(share_prefix=True, rows=5, max_reads=5 * prefix_case.T,
                               row_len=prefix_case.P + prefix_case.T + 4),
    "unshared": dict(rows=5),
}


@pytest.mark.parametrize("name", list(PACKINGS))
def test_loss_step_by_sequence_matches_the_masks(name):
    policy, value = _prepared(tiny_policy(0), tiny_classifier(1))
    traj, adv, ret = prefix_case._trajectory((policy, tiny_policy(1), value, tiny_classifier(2)))
    micro_batches = [prefix_case.ORDER[:5], prefix_case.ORDER[5:]]
    args = (packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches)
    masked = _loss_and_grads(*args, segments=False, **PACKINGS[name])
    by_sequence = _loss_and_grads(*args, segments=True, **PACKINGS[name])
    group_case._assert_close(by_sequence, masked)
    assert max(g.abs().max() for g in masked[2].values()) > 1e-3


def test_compiled_regions_by_sequence_match_eager_without_recompiles(monkeypatch, models):
    """Scoring and the loss step compiled with layouts (dynamo's eager backend): the eager values,
    and no recompile for another length mix, prefix or number of sequences."""
    monkeypatch.setenv(BACKEND_ENV, "eager")
    score = maybe_compile(packed_score_trajectory, enabled=True)
    step_fn = maybe_compile(packed_ppo_loss_step, enabled=True)
    counter = RecompileCounter()
    policy, value = _prepared(tiny_policy(0), tiny_classifier(1))
    mixes = [dict(), dict(common=2, seed=1), dict(stops=[None] * 10, common=3, seed=2)]
    for k, mix in enumerate(mixes):
        qr, lens = prefix_case._generated(**mix)
        prefix = packing.prompt_prefix(qr, lens.tolist(), prefix_case.P)
        plan = plan_scoring(lens.tolist(), prefix_case._valid_counts(qr), prompt_len=prefix_case.P,
                            response_len=prefix_case.T, num_chunks=prefix_case.CHUNKS, device=qr.device,
                            common_prefix=prefix, segment_attention=True).mark_dynamic(True)
        with torch.no_grad():
            eager = packed_score_trajectory(qr, lens, None, *models, prefix_case.STOP, plan, prefix_case.SETTINGS)
            compiled = score(qr, lens, None, *models, prefix_case.STOP, plan, prefix_case.SETTINGS)
        prefix_case._assert_trajectories_close(compiled, eager)
        traj, adv, ret = prefix_case._trajectory((policy, tiny_policy(1), value, tiny_classifier(2)), seed=k)
        args = (policy, value, traj, adv, ret, [prefix_case.ORDER[:5], prefix_case.ORDER[5:]])
        kw = dict(segments=True, **PACKINGS["prefix"])
        group_case._assert_close(_loss_and_grads(step_fn, *args, **kw),
                                 _loss_and_grads(packed_ppo_loss_step, *args, **kw))
        if k == 0:
            counter.mark()
    assert counter.since_mark == 0


# --- the switch ------------------------------------------------------------------------------


def test_update_refuses_models_that_do_not_take_layouts():
    policy, value = tiny_policy(0), tiny_classifier(1)
    kw = dict(batch_size=10, ppo_batch_size=10, ppo_epochs=1, gradient_accumulation_steps=1,
              prompt_len=prefix_case.P, response_len=prefix_case.T, temperature=0.7,
              loss=LossSettings(epsilon=0.2, value_clip_range=0.2, value_coeff=0.1), clip_grad_norm=1.0,
              optimizer_in_bwd=False)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    PPOUpdate(policy, value, opt, None, packed_ppo_loss_step, **kw)  # off: any model
    with pytest.raises(ValueError, match="the policy, value model"):
        PPOUpdate(policy, value, opt, None, packed_ppo_loss_step, segment_attention=True, **kw)
    _prepared(policy, value)
    PPOUpdate(policy, value, opt, None, packed_ppo_loss_step, segment_attention=True, **kw)
