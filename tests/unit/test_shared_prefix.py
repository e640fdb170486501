"""The prefix every prompt of a batch begins with, packed once per row (``share_prompt_prefix``):
scoring and the loss step against the same sequences packed each with its whole prompt.

Tolerance: 1e-5 absolute in float32 on these tiny models, for the reason of
``test_shared_prompt.py``: the same sums of the same products, in rows of other lengths, so the
attention's and the backward's reductions run in another order (measured here ~1e-6); a wrong
mask, position or read moves values by 1e-2 or more.
"""

import copy

import pytest
import torch

from conftest import EOS_ID, PAD_ID, VOCAB, recipe_config, tiny_classifier, tiny_policy
from torchtune_ppo import rlhf
from torchtune_ppo.compile import BACKEND_ENV, RecompileCounter, maybe_compile
from torchtune_ppo.config import batches, prompt_sharing
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.ppo.update import LossSettings, PPOUpdate
from torchtune_ppo.rlhf import ScoringSettings, packing
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rollout.scoring import packed_score_trajectory, plan_scoring
from test_shared_prompt import _NoTimer, _assert_close, _assert_trajectories_close, scoring_models  # noqa: F401

P, T = 9, 6
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=0.7, penalise_no_eos=True,
                           min_response_length=2, reward_penalty=-3.0)
HP = dict(temperature=0.7, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)
CHUNKS = 3
ATOL = 1e-5

# 10 prompts that begin with the same 4 tokens: one is those 4 alone, one fills P; responses of
# every length, some without a stop token, one of a single token
PROMPT_LENS = [4, 9, 5, 7, 6, 8, 5, 9, 6, 7]
STOPS = [0, None, 3, 5, 2, 1, None, 4, 0, 2]
COMMON = 4


def _generated(prompt_lens=PROMPT_LENS, stops=STOPS, common=COMMON, seed=0):
    """Rows ``[b, P + T]``: left-padded prompts whose first ``common`` real tokens are the same."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (common,), generator=g)
    qr = torch.full((len(prompt_lens), P + T), PAD_ID, dtype=torch.long)
    for i, (n, stop) in enumerate(zip(prompt_lens, stops)):
        tail = torch.randint(3, VOCAB, (n - common,), generator=g)
        qr[i, P - n : P] = torch.cat([head, tail])
        qr[i, P:] = torch.randint(3, VOCAB, (T,), generator=g)
        if stop is not None:
            qr[i, P + stop] = EOS_ID
    return qr, torch.tensor(prompt_lens)


def _valid_counts(query_responses):
    padding, _ = rlhf.truncate_after_stop_token(query_responses[:, P:], STOP, PAD_ID)
    return (~padding).sum(-1).tolist()


def _plan(qr, prompt_lens, prefix=None, row_len=None):
    return plan_scoring(prompt_lens.tolist(), _valid_counts(qr), prompt_len=P, response_len=T, num_chunks=CHUNKS,
                        device=qr.device, common_prefix=prefix, row_len=row_len)


def _score(qr, prompt_lens, models, prefix=None, row_len=None, score=packed_score_trajectory):
    plan = _plan(qr, prompt_lens, prefix, row_len)
    policy, ref, value, reward = models
    with torch.no_grad():
        return score(qr, prompt_lens, None, policy, ref, value, reward, STOP, plan.mark_dynamic(prefix is not None),
                     SETTINGS), plan


def _real_slots(plan_or_steps):
    return int((plan_or_steps.segment_ids >= 0).sum()) if hasattr(plan_or_steps, "segment_ids") else sum(
        int((s.segment_ids >= 0).sum()) for s in plan_or_steps)


# --- the prefix and the layout by hand --------------------------------------------------------


def test_common_prefix_of_prompts_by_hand():
    assert packing.common_prefix_len([[5, 6, 7], [5, 6, 8, 9], [5, 6]]) == 2
    assert packing.common_prefix_len([[5, 6], [5, 6]]) == 2  # all equal: the shortest whole
    assert packing.common_prefix_len([[1, 2], [3, 2]]) == 0
    assert packing.common_prefix_len([]) == 0
    qr, lens = _generated()
    assert packing.prompt_prefix(qr, lens.tolist(), P) == COMMON  # read past the left padding
    qr[3, P - 7 + 2] = (qr[3, P - 7 + 2] + 1 - 3) % (VOCAB - 3) + 3  # row 3 differs at its 3rd token
    assert packing.prompt_prefix(qr, lens.tolist(), P) == 2


def test_prefix_scoring_plan_by_hand():
    # P = 4, T = 3: prompts [a b c], [a b d e], [a b f], [a b g h] share 2 tokens; responses of 2
    # valid tokens each
    qr = torch.tensor([[0, 11, 12, 13, 21, 2, 0], [11, 12, 14, 15, 31, 2, 0],
                       [0, 11, 12, 16, 41, 2, 0], [11, 12, 17, 18, 51, 2, 0]])
    lens = [3, 4, 3, 4]
    plan = plan_scoring(lens, [2] * 4, prompt_len=4, response_len=3, num_chunks=1, device=torch.device("cpu"),
                        common_prefix=packing.prompt_prefix(qr, lens, 4), row_len=16)
    # two balanced rows cut to the 9 slots each needs: the copy of [a b] (from the row's first
    # sequence, the longer), then that sequence's [d e] and response, then the other's [c] and its
    assert plan.token_src.tolist() == [[7, 8, 9, 10, 11, 12, 3, 4, 5], [21, 22, 23, 24, 25, 26, 17, 18, 19]]
    assert qr.flatten()[plan.token_src].tolist() == [[11, 12, 14, 15, 31, 2, 13, 21, 2],
                                                     [11, 12, 17, 18, 51, 2, 16, 41, 2]]
    assert plan.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4]] * 2
    for row in range(2):
        seg, prefix = plan.segment_ids[row].tolist(), plan.prefix_ids[row].tolist()
        assert seg[0] == seg[1] == prefix[0] and set(prefix) == {seg[0]}
        assert len(set(seg[2:6])) == 1 and len(set(seg[6:9])) == 1 and len({seg[0], seg[2], seg[6]}) == 3
    # reads: a sequence's first token at its own prompt's last slot (3, 6; 12, 15), then the next
    assert plan.read_positions.flatten()[:8].tolist() == [3, 4, 6, 7, 12, 13, 15, 16]
    assert plan.read_targets.flatten()[:8].tolist() == [3, 4, 0, 1, 9, 10, 6, 7]
    assert plan.last_positions.tolist() == [8, 5, 17, 14]
    # a prefix of 0 tokens: each sequence whole after an empty copy, one segment each
    empty = plan_scoring(lens, [2] * 4, prompt_len=4, response_len=3, num_chunks=1, device=torch.device("cpu"),
                         common_prefix=0, row_len=16)
    assert _real_slots(empty) == 5 + 6 + 5 + 6 and _real_slots(plan) == 2 * 2 + 3 + 4 + 3 + 4
    assert empty.position_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 5]


def test_prefix_pieces_are_balanced_and_fit():
    pieces, length = packing.prefix_pieces([5, 4, 3, 3, 2, 1], [1] * 6, shared_len=3, row_len=14, max_reads=10)
    assert sorted(k for p in pieces for k in p) == list(range(6))
    assert len(pieces) == 2 and length == 3 + 9  # loads 9 and 9
    # too long for 2 rows of 14: a third
    pieces, length = packing.prefix_pieces([8, 8, 8], [1] * 3, shared_len=3, row_len=14, max_reads=10)
    assert len(pieces) == 3 and length == 11
    # reads bound the pieces too
    pieces, _ = packing.prefix_pieces([1] * 6, [4] * 6, shared_len=3, row_len=100, max_reads=8)
    assert len(pieces) == 3 and all(len(p) == 2 for p in pieces)
    assert packing.prefix_pieces([4], [2], shared_len=3, row_len=14, max_reads=8) == ([[0]], 7)


def test_prefix_row_len_and_rows():
    assert packing.prefix_row_len(32, 11) == 4 * 43
    assert packing.prefix_row_len(32, 11, max_seq_len=100) == 100
    assert packing.prefix_row_len(32, 11, max_seq_len=40) == 43  # never below P + t
    assert packing.prefix_rows(8, 4 * 43, 32, 11) == 2  # 4 whole sequences a row at least
    assert packing.prefix_rows(9, 4 * 43, 32, 11) == 3
    assert packing.prefix_rows(8, 4 * 43, 32, 11, fixed_shapes=True) == 2  # never below 2


# --- scoring ---------------------------------------------------------------------------------


@pytest.mark.parametrize("row_len", [None, P + T + 5])  # 4 rows' worth, or rows a few sequences fill
def test_prefix_scoring_matches_unshared_and_padded(scoring_models, row_len):
    qr, lens = _generated()
    unshared, plain = _score(qr, lens, scoring_models)
    shared, plan = _score(qr, lens, scoring_models, packing.prompt_prefix(qr, lens.tolist(), P), row_len)
    _assert_trajectories_close(shared, unshared)
    policy, ref, value, reward = scoring_models
    with torch.no_grad():  # and the padded rows', which share no code with packing
        padded = score_trajectory(qr, lens, None, policy, ref, value, ModelReward(reward), STOP, SETTINGS)
    _assert_trajectories_close(shared, padded)
    copy_slots = (plan.segment_ids == plan.prefix_ids) & (plan.segment_ids >= 0)
    copies = len(set(plan.segment_ids[copy_slots].tolist()))  # one copy of the prefix a piece
    assert _real_slots(plan) == _real_slots(plain) - (len(qr) - copies) * COMMON
    if row_len is not None:
        assert copies > 1  # the sequences over several rows, a copy of the prefix in each


def test_a_wrong_prefix_is_caught(scoring_models):
    """The equality above can fail: a prefix one token longer than the prompts share moves the
    scores (the sequences then read another row's token at that position)."""
    qr, lens = _generated(prompt_lens=[5, *PROMPT_LENS[1:]])  # every prompt longer than the prefix
    unshared, _ = _score(qr, lens, scoring_models)
    right, _ = _score(qr, lens, scoring_models, COMMON)
    _assert_trajectories_close(right, unshared)
    wrong, _ = _score(qr, lens, scoring_models, COMMON + 1)
    assert (wrong.ref_logprobs - unshared.ref_logprobs).abs().max() > 1e-3


# --- the loss step ---------------------------------------------------------------------------


def _trajectory(models, seed=0):
    qr, lens = _generated(seed=seed)
    traj, _ = _score(qr, lens, models)
    b, g = len(qr), torch.Generator().manual_seed(seed + 7)
    valid = ~traj.response_padding_masks
    traj = traj._replace(  # old logprobs and values away from the current ones: clipping engages
        logprobs=(traj.logprobs + 0.3 * torch.randn(b, T, generator=g)) * valid,
        values=(traj.values + 0.5 * torch.randn(b, T, generator=g)) * valid,
        ref_logprobs=(traj.ref_logprobs + 0.4 * torch.randn(b, T, generator=g)) * valid,
    )
    return traj, torch.randn(b, T, generator=g) * valid, torch.randn(b, T, generator=g) * valid


def _loss_and_grads(step_fn, policy, value, traj, adv, ret, micro_batches, *, share, rows, row_len=None,
                    max_reads=0, fixed_shapes=False, **terms):
    for m in (policy, value):
        if m is not None:
            m.zero_grad(set_to_none=True)
    lengths = packing.sequence_lengths(traj, P, common_prefix=share)
    steps = packing.pack_minibatch(traj, adv, ret, micro_batches, lengths, prompt_len=P, rows=rows,
                                   num_chunks=CHUNKS, row_len=row_len, max_reads=max_reads,
                                   fixed_shapes=fixed_shapes, share_prefix=share)
    stats, total = [], 0.0
    for step in steps:
        loss, s, _ = step_fn(policy, value, *(step if fixed_shapes else step.mark_dynamic(share)),
                             num_micro_batches=len(micro_batches), **HP, **terms)
        loss.backward()
        stats.append(s)
        total = total + loss.detach()
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate((policy, value)) if m is not None
             for n, p in m.named_parameters() if p.grad is not None}
    return total, packing.micro_batch_stats(stats), grads, steps, lengths


ORDER = [3, 7, 0, 9, 1, 5, 2, 8, 4, 6]


@pytest.mark.parametrize("critic", [True, False])
@pytest.mark.parametrize("grad_accum,row_len", [(1, None), (2, None), (2, P + T + 4)])
def test_prefix_loss_step_matches_unshared(critic, grad_accum, row_len):
    """Loss, per-micro-batch stats and gradients, with a value model and critic-free; rows long
    enough for every sequence of a micro-batch, or short enough that they spread over rows."""
    policy, value = tiny_policy(0), tiny_classifier(1) if critic else None
    traj, adv, ret = _trajectory((policy, tiny_policy(1), value or tiny_classifier(1), tiny_classifier(2)))
    m = len(ORDER) // grad_accum
    micro_batches = [ORDER[i : i + m] for i in range(0, len(ORDER), m)]
    unshared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches,
                               share=False, rows=m)
    rows = m if row_len is not None else packing.prefix_rows(m, packing.prefix_row_len(P, T - 1), P, T - 1)
    shared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches, share=True,
                             rows=rows, row_len=row_len, max_reads=m * T)
    _assert_close(shared, unshared)
    assert shared[4].common_prefix == COMMON and unshared[4].common_prefix == 0
    assert max(g.abs().max() for g in unshared[2].values()) > 1e-3  # not trivially zero
    assert _real_slots(shared[3]) < _real_slots(unshared[3])
    assert all(s.prefix_ids is not None for s in shared[3]) and all(s.prefix_ids is None for s in unshared[3])


def test_prefix_loss_step_with_entropy_kl_aggregation_and_fixed_shapes():
    policy, value = tiny_policy(0), tiny_classifier(1)
    traj, adv, ret = _trajectory((policy, tiny_policy(1), value, tiny_classifier(2)))
    micro_batches = [ORDER[:5], ORDER[5:]]
    terms = dict(entropy_coeff=0.01, kl_coeff=0.05, kl_estimator="k3")
    unshared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches, share=False,
                               rows=5, **terms)
    row_len = packing.prefix_row_len(P, T - 1)
    rows = packing.prefix_rows(5, row_len, P, T - 1, fixed_shapes=True)
    shared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches, share=True,
                             rows=rows, row_len=row_len, max_reads=3 * T, fixed_shapes=True, **terms)
    _assert_close(shared, unshared)
    assert len({(s.tokens.shape, s.read_positions.shape) for s in shared[3]}) == 1  # fixed


def test_compiled_prefix_regions_match_eager_without_recompiles(monkeypatch, scoring_models):
    """Scoring and the loss step compiled (dynamo's eager backend: its guards and graphs): the
    eager values, and no recompile for another length mix or prefix."""
    monkeypatch.setenv(BACKEND_ENV, "eager")
    score = maybe_compile(packed_score_trajectory, enabled=True)
    step_fn = maybe_compile(packed_ppo_loss_step, enabled=True)
    counter = RecompileCounter()
    policy, value = tiny_policy(0), tiny_classifier(1)
    mixes = [dict(), dict(common=2, seed=1), dict(stops=[None] * 10, common=3, seed=2)]
    for k, mix in enumerate(mixes):
        qr, lens = _generated(**mix)
        prefix = packing.prompt_prefix(qr, lens.tolist(), P)
        eager, _ = _score(qr, lens, scoring_models, prefix)
        compiled, _ = _score(qr, lens, scoring_models, prefix, score=score)
        _assert_trajectories_close(compiled, eager)
        traj, adv, ret = _trajectory((policy, tiny_policy(1), value, tiny_classifier(2)), seed=k)
        args = (policy, value, traj, adv, ret, [ORDER[:5], ORDER[5:]])
        kw = dict(share=True, rows=2, max_reads=5 * T)
        _assert_close(_loss_and_grads(step_fn, *args, **kw), _loss_and_grads(packed_ppo_loss_step, *args, **kw))
        if k == 0:
            counter.mark()
    assert counter.since_mark == 0


def test_prefix_update_matches_unshared():
    """Two epochs through :class:`PPOUpdate`: the weights and stats of the unshared update."""
    models = tiny_policy(0), tiny_classifier(1)
    traj, adv, ret = _trajectory((models[0], tiny_policy(1), models[1], tiny_classifier(2)))
    results, weights = [], []
    for share in (False, True):
        policy, value = copy.deepcopy(models[0]), copy.deepcopy(models[1])
        params = [p for m in (policy, value) for p in m.parameters()]
        torch.manual_seed(5)  # the draw
        update = PPOUpdate(policy, value, torch.optim.SGD(params, lr=0.5), None, packed_ppo_loss_step,
                           batch_size=10, ppo_batch_size=10, ppo_epochs=2, gradient_accumulation_steps=2,
                           prompt_len=P, response_len=T, temperature=0.7,
                           loss=LossSettings(epsilon=0.2, value_clip_range=0.2, value_coeff=0.1), clip_grad_norm=1.0,
                           optimizer_in_bwd=False, share_prefix=share)
        results.append(update(traj, adv, ret, _NoTimer(), step=1))
        weights.append({n: p.detach().clone() for m in (policy, value) for n, p in m.named_parameters()})
    for a, b in zip(results[1].stats, results[0].stats):
        for name, x, y in zip(rlhf.PPOStats._fields, a, b):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], atol=ATOL, rtol=0, msg=name)
    assert any(not torch.equal(weights[0][n], p) for n, p in models[0].named_parameters())  # it trained


# --- the switch ------------------------------------------------------------------------------


class _Prompts:
    def __init__(self, prompts):
        self.prompts = prompts

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, i):
        return {"tokens": self.prompts[i]}


def test_the_switch_follows_the_datasets_prefix_and_refuses_what_cannot_share(tmp_path, monkeypatch):
    notes = []
    monkeypatch.setattr(batches, "note", notes.append)
    cfg = recipe_config(tmp_path, max_prompt_len=32)
    system = list(range(3, 13))  # 10 tokens every prompt begins with: >= max(8, 32 / 4)
    shared = _Prompts([system + [20 + i, 7] for i in range(300)])
    assert prompt_sharing(cfg, 1, shared) == (1, True) and "on: the first 256 prompts share 10" in notes[-1]
    few = _Prompts([system[:7] + [20 + i] for i in range(5)])
    assert prompt_sharing(cfg, 1, few) == (1, False) and "share 7 leading tokens (fewer than 8)" in notes[-1]
    assert prompt_sharing(recipe_config(tmp_path, max_prompt_len=48), 1, shared) == (1, False)  # 10 < 48 / 4
    assert prompt_sharing(recipe_config(tmp_path, share_prompt_prefix=True), 1, few) == (1, True)
    assert prompt_sharing(recipe_config(tmp_path, share_prompt_prefix=False), 1, shared) == (1, False)
    # groups sharing their prompt: the group's copy, no prefix; asked for anyway: an error
    grpo = dict(num_samples_per_prompt=4)
    assert prompt_sharing(recipe_config(tmp_path, "grpo_tiny_arithmetic.yaml", **grpo), 1, shared) == (4, False)
    with pytest.raises(ValueError, match="share_prompt_prefix=True, but each group's prompt is already one copy"):
        prompt_sharing(recipe_config(tmp_path, "grpo_tiny_arithmetic.yaml", share_prompt_prefix=True, **grpo), 1)
    with pytest.raises(ValueError, match=r"share_prompt_prefix=True, but compile.rollout=True"):
        prompt_sharing(recipe_config(tmp_path, share_prompt_prefix=True, **{"compile.rollout": True}), 1)


def test_memory_plan_counts_prefix_rows_when_asked(tmp_path):
    from torchtune_ppo.run.memory import memory_plan

    def label(**overrides):
        cfg = recipe_config(tmp_path, batch_size=16, forward_batch_size=16, ppo_batch_size=16,
                            max_generated_tokens=6, **overrides)
        return next(k for k in memory_plan(cfg, prompt_len=12).rows if k.startswith("activations"))

    assert "micro-step 8 packed rows x 17 tokens" in label()  # 2 micro-batches of 8
    assert "micro-step 2 packed rows x 68 tokens" in label(share_prompt_prefix=True)  # 4 a row
