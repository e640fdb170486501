"""A group's prompt computed once: packed rows of one prompt copy followed by its responses, in
scoring and in the loss step, against the same rows packed each with its own prompt copy.

Tolerance: 1e-5 absolute in float32 on these tiny models. Both paths compute the same sums of
the same products; what differs is the row a token sits in (its length and the masked slots
around it), so the attention's and the backward's reductions run in another order and block
differently. That rounds the last bits (measured here up to ~1e-6); a wrong mask, position or
read moves values by 1e-2 or more.
"""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from conftest import EOS_ID, PAD_ID, VOCAB, left_padded_prompts, recipe_config, tiny_classifier, tiny_policy
from torchtune_ppo import lora, rlhf
from torchtune_ppo.compile import BACKEND_ENV, RecompileCounter, maybe_compile
from torchtune_ppo.config import batches, share_group_prompt, validate_config
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.ppo.update import LossSettings, PPOUpdate
from torchtune_ppo.rlhf import ScoringSettings, block_causal_masks, packing
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rollout.scoring import packed_score_trajectory, plan_scoring
from twins.loss_step import ppo_loss_step

P, T, N = 6, 7, 4
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=0.7, penalise_no_eos=True,
                           min_response_length=2, reward_penalty=-3.0)
HP = dict(temperature=0.7, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)
CHUNKS = 3
ATOL = 1e-5

# three groups of N: a full-length prompt, a 1-token prompt; responses of every length, some
# without a stop token, one of a single token (no slot of its own in the loss step)
GROUPS = dict(prompt_lens=[6, 1, 3], stops=[0, None, 3, 6, 2, 1, 5, None, 4, 0, None, 1])
OTHER = dict(prompt_lens=[2, 5, 6], stops=[1, 0, 2, 0, None, 3, None, 2, 6, 5, 1, 0])


def _generated(prompt_lens, stops, seed=0):
    """Rows ``[len(prompt_lens) * N, P + T]``: each prompt N times in a row, then its responses."""
    b = len(stops)
    g = torch.Generator().manual_seed(seed)
    prompts = left_padded_prompts(prompt_lens, P, seed=seed).repeat_interleave(N, 0)
    responses = torch.randint(3, VOCAB, (b, T), generator=g)
    for i, stop in enumerate(stops):
        if stop is not None:
            responses[i, stop] = EOS_ID
    return torch.cat([prompts, responses], 1), torch.tensor(prompt_lens).repeat_interleave(N)


def _valid_counts(query_responses):
    padding, _ = rlhf.truncate_after_stop_token(query_responses[:, P:], STOP, PAD_ID)
    return (~padding).sum(-1).tolist()


def _score(query_responses, prompt_lens, models, group_size, row_len=None, score=packed_score_trajectory):
    plan = plan_scoring(prompt_lens.tolist(), _valid_counts(query_responses), prompt_len=P, response_len=T,
                        num_chunks=CHUNKS, device=query_responses.device, group_size=group_size, row_len=row_len)
    policy, ref, value, reward = models
    with torch.no_grad():
        return score(query_responses, prompt_lens, None, policy, ref, value, reward, STOP, plan.mark_dynamic(),
                     SETTINGS), plan


def _assert_trajectories_close(a, b):
    for name, x, y in zip(b._fields, a, b):
        if y is None:
            assert x is None, name
        elif y.is_floating_point():
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(x, y), name


@pytest.fixture(scope="module")
def scoring_models():
    policy, ref, value, reward = tiny_policy(0), tiny_policy(1), tiny_classifier(1), tiny_classifier(2)
    for m in (policy, ref, value, reward):
        m.eval().requires_grad_(False)
    return policy, ref, value, reward


# --- masks and layout by hand ------------------------------------------------------------


def test_prefix_masks_by_hand():
    # one row: a prompt (segment 0) of 2 slots, response A (segment 5) of 2, response B (6) of 1,
    # then a lone sequence (segment 1) of 2 and an unused slot
    seg = torch.tensor([[0, 0, 5, 5, 6, 1, 1, -8]])
    prefix = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -8]])
    mask = block_causal_masks(seg, prefix)[0]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    allowed = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 4], 5: [5], 6: [5, 6], 7: [7]}
    for q, ks in allowed.items():
        expected[q, ks] = True
    assert torch.equal(mask, expected)
    # without prefixes (and with prefix = own segment) the block-diagonal causal masks
    plain = block_causal_masks(seg)[0]
    assert torch.equal(plain, block_causal_masks(seg, seg)[0])
    assert not plain[2, 0] and not plain[4, 1] and plain[3, 2]


def test_shared_scoring_plan_by_hand():
    # one group of 2: a 2-token prompt (P = 3), responses of 2 and 1 valid tokens (T = 3)
    plan = plan_scoring([2, 2], [2, 1], prompt_len=3, response_len=3, num_chunks=1, device=torch.device("cpu"),
                        group_size=2)
    row_len = 3 + 2 * 3  # the prompt and both responses at full length
    assert plan.token_src.shape == (2, row_len)  # one row used, one filler row (MIN_SIZE)
    # row 0 of the [2, 6] rows: prompt at 1, 2; response 0 at 3, 4; row 1: response 1 at 6 + 3
    assert plan.token_src[0, :5].tolist() == [1, 2, 3, 4, 9]
    assert plan.position_ids[0, :5].tolist() == [0, 1, 2, 3, 2]  # each response continues from 2
    seg, prefix = plan.segment_ids[0, :5].tolist(), plan.prefix_ids[0, :5].tolist()
    assert seg[:2] == [0, 0] and prefix == [0] * 5 and len({seg[2], seg[4], 0}) == 3 and seg[2] == seg[3]
    # reads: response 0's tokens at slots 1 (the prompt's last) and 2; response 1's first at slot 1
    assert plan.read_positions.flatten()[:3].tolist() == [1, 2, 1]
    assert plan.read_targets.flatten()[:3].tolist() == [0, 1, 3]
    assert plan.last_positions.tolist() == [3, 4]
    unshared = plan_scoring([2, 2], [2, 1], prompt_len=3, response_len=3, num_chunks=1, device=torch.device("cpu"))
    assert unshared.prefix_ids is None and unshared.token_src.shape[1] == 6


def test_shared_row_len_and_rows():
    # room for the whole group after a full prompt, unless that is more than 4 unshared rows
    assert packing.shared_row_len(256, 63, 8) == 256 + 8 * 63
    assert packing.shared_row_len(96, 63, 4) == 96 + 4 * 63
    assert packing.shared_row_len(256, 1023, 16) == 256 + 4 * 1023 <= 4 * (256 + 1023)
    assert packing.shared_row_len(256, 1023, 16, max_seq_len=2048) == 2048  # the models' limit
    assert packing.shared_row_len(2000, 47, 8, max_seq_len=2048) == 2048
    assert packing.shared_row_len(2000, 47, 8, max_seq_len=2040) == 2047  # never below P + t
    assert packing.shared_row_len(6, 0, 8) == 6 and packing.shared_row_len(6, 6, 1) == 12
    assert packing.shared_rows(16, 256 + 8 * 63, 256, 63) == 2  # 2 groups of 8 a micro-batch
    assert packing.shared_rows(16, 256 + 8 * 63, 256, 63, fixed_shapes=True) == 2


# --- scoring -------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [GROUPS, OTHER])
@pytest.mark.parametrize("row_len", [None, P + T + 4])  # a whole group a row; a group over 2-4 rows
def test_shared_scoring_matches_unshared(scoring_models, mix, row_len):
    qr, prompt_lens = _generated(**mix)
    unshared, plain = _score(qr, prompt_lens, scoring_models, 1)
    shared, plan = _score(qr, prompt_lens, scoring_models, N, row_len)
    _assert_trajectories_close(shared, unshared)
    # and the padded rows', which share no code with packing
    policy, ref, value, reward = scoring_models
    with torch.no_grad():
        padded = score_trajectory(qr, prompt_lens, None, policy, ref, value, ModelReward(reward), STOP, SETTINGS)
    _assert_trajectories_close(shared, padded)
    assert int((plan.segment_ids >= 0).sum()) < int((plain.segment_ids >= 0).sum())  # fewer real slots
    if row_len is not None:  # some group continues in another row with its own prompt copy
        copies = [int(((plan.segment_ids == s) & (plan.prefix_ids == s)).any()) for s in range(len(qr))]
        assert sum(copies) > len(mix["prompt_lens"])


def test_shared_scoring_without_value_model_and_with_given_scores(scoring_models):
    """Critic-free with a function reward: values 0, the given scores and penalties."""
    policy, ref, _, _ = scoring_models
    qr, prompt_lens = _generated(**GROUPS)
    scores = torch.randn(len(qr), generator=torch.Generator().manual_seed(3))
    out = []
    for group_size in (1, N):
        plan = plan_scoring(prompt_lens.tolist(), _valid_counts(qr), prompt_len=P, response_len=T,
                            num_chunks=CHUNKS, device=qr.device, group_size=group_size)
        with torch.no_grad():
            out.append(packed_score_trajectory(qr, prompt_lens, None, policy, ref, None, None, STOP, plan,
                                               SETTINGS, scores=scores))
    _assert_trajectories_close(out[1], out[0])
    assert torch.equal(out[1].values, torch.zeros_like(out[1].values))


# --- loss step -----------------------------------------------------------------------------


def _trajectory(mix, models, seed=0):
    qr, prompt_lens = _generated(**mix, seed=seed)
    policy, ref, value, reward = models
    traj, _ = _score(qr, prompt_lens, (policy, ref, value, reward), 1)
    b, g = len(qr), torch.Generator().manual_seed(seed + 7)
    valid = ~traj.response_padding_masks
    traj = traj._replace(  # old logprobs and values away from the current ones: clipping engages
        logprobs=(traj.logprobs + 0.3 * torch.randn(b, T, generator=g)) * valid,
        values=(traj.values + 0.5 * torch.randn(b, T, generator=g)) * valid,
        ref_logprobs=(traj.ref_logprobs + 0.4 * torch.randn(b, T, generator=g)) * valid,
    )
    return traj, torch.randn(b, T, generator=g) * valid, torch.randn(b, T, generator=g) * valid


def _grads(*models):
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate(models) if m is not None
            for n, p in m.named_parameters() if p.grad is not None}


def _loss_and_grads(step_fn, policy, value, traj, adv, ret, micro_batches, *, group_size, rows,
                    row_len=None, max_reads=0, fixed_shapes=False, aggregation="token-mean", **terms):
    for m in (policy, value):
        if m is not None:
            m.zero_grad(set_to_none=True)
    lengths = packing.sequence_lengths(traj, P)
    steps = packing.pack_minibatch(traj, adv, ret, micro_batches, lengths, prompt_len=P, rows=rows,
                                   num_chunks=CHUNKS, group_size=group_size, row_len=row_len, max_reads=max_reads,
                                   fixed_shapes=fixed_shapes, aggregation=aggregation)
    stats, total = [], 0.0
    for step in steps:
        loss, s, _ = step_fn(policy, value, *(step if fixed_shapes else step.mark_dynamic()),
                             num_micro_batches=len(micro_batches), **HP, **terms)
        loss.backward()
        stats.append(s)
        total = total + loss.detach()
    return total, packing.micro_batch_stats(stats), _grads(policy, value), steps


def _padded(policy, value, traj, adv, ret, micro_batches):
    """The padded loss step, one micro-batch at a time, scaled by ``1 / grad_accum``."""
    for m in (policy, value):
        m.zero_grad(set_to_none=True)
    stats, total = [], 0.0
    for idxs in map(torch.tensor, micro_batches):
        loss, st = ppo_loss_step(
            policy, value, traj.query_responses[idxs], traj.masks[idxs], traj.position_ids[idxs],
            traj.response_padding_masks[idxs], traj.logprobs[idxs], traj.values[idxs], adv[idxs], ret[idxs],
            prompt_len=P, loss_scale=1.0 / len(micro_batches), ref_logprobs=traj.ref_logprobs[idxs], **HP)
        loss.backward()
        stats.append(st)
        total = total + loss.detach()
    return total, stats, _grads(policy, value)


def _assert_close(a, b):
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = a[:3], b[:3]
    torch.testing.assert_close(loss_a, loss_b, atol=ATOL, rtol=0)
    for sa, sb in zip(stats_a, stats_b):
        for name, x, y in zip(rlhf.PPOStats._fields, sa, sb):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=ATOL, rtol=0, msg=name)


# whole groups in order, as the group-wise draw gives them: groups 2, 0, 1
ORDER = [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("critic", [True, False])
@pytest.mark.parametrize("grad_accum,rows,row_len", [(1, 3, None), (2, 2, None), (3, 2, P + T + 3)])
def test_shared_loss_step_matches_unshared(critic, grad_accum, rows, row_len):
    """Loss, per-micro-batch stats and gradients; with a value model and critic-free; micro-batches
    that cut a group (grad_accum 3: 4 rows each, groups of 4 -> whole; 2: 6 rows -> cut); rows short
    enough that a group continues in another row."""
    policy, value = tiny_policy(0), tiny_classifier(1) if critic else None
    traj, adv, ret = _trajectory(GROUPS, (policy, tiny_policy(1), value or tiny_classifier(1), tiny_classifier(2)))
    m = len(ORDER) // grad_accum
    micro_batches = [ORDER[i : i + m] for i in range(0, len(ORDER), m)]
    unshared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches,
                               group_size=1, rows=m)
    shared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches, group_size=N,
                             rows=rows, row_len=row_len, max_reads=m * T)
    _assert_close(shared, unshared)
    if critic:  # and the padded twin's, on [b, P + T] rows, which shares no code with packing
        _assert_close(shared, _padded(policy, value, traj, adv, ret, micro_batches))
    assert max(g.abs().max() for g in unshared[2].values()) > 1e-3  # not trivially zero
    slots = lambda steps: sum(int((s.segment_ids >= 0).sum()) for s in steps)  # noqa: E731
    assert slots(shared[3]) < slots(unshared[3])
    assert all(s.prefix_ids is not None for s in shared[3]) and all(s.prefix_ids is None for s in unshared[3])


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_shared_loss_step_matches_unshared_with_entropy_kl_and_aggregations(aggregation):
    policy = tiny_policy(0)
    traj, adv, ret = _trajectory(OTHER, (policy, tiny_policy(1), tiny_classifier(1), tiny_classifier(2)))
    micro_batches = [ORDER[:6], ORDER[6:]]
    terms = dict(entropy_coeff=0.01, kl_coeff=0.05, kl_estimator="k3", aggregation=aggregation)
    unshared = _loss_and_grads(packed_ppo_loss_step, policy, None, traj, adv, ret, micro_batches, group_size=1,
                               rows=6, **terms)
    shared = _loss_and_grads(packed_ppo_loss_step, policy, None, traj, adv, ret, micro_batches, group_size=N,
                             rows=2, max_reads=6 * T, **terms)
    _assert_close(shared, unshared)


def test_shared_loss_step_fixed_shapes_matches_unshared():
    """The FSDP layout (every micro-step the same rows and reads) with shared prompts."""
    policy, value = tiny_policy(0), tiny_classifier(1)
    traj, adv, ret = _trajectory(GROUPS, (policy, tiny_policy(1), value, tiny_classifier(2)))
    micro_batches = [ORDER[:6], ORDER[6:]]
    unshared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches, group_size=1,
                               rows=3, fixed_shapes=True)
    rows = packing.shared_rows(6, packing.shared_row_len(P, T - 1, N), P, T - 1, fixed_shapes=True)
    shared = _loss_and_grads(packed_ppo_loss_step, policy, value, traj, adv, ret, micro_batches, group_size=N,
                             rows=rows, max_reads=3 * T, fixed_shapes=True)
    _assert_close(shared, unshared)
    shapes = {(s.tokens.shape, s.read_positions.shape) for s in shared[3]}
    assert len(shapes) == 1  # fixed


def test_shared_loss_step_with_a_lora_policy():
    """Adapters' gradients (the base frozen) through shared prompts: the unshared ones."""
    from torchtune.models.llama2 import lora_llama2

    base = tiny_policy(0)
    policy = lora_llama2(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                         vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                         intermediate_dim=64, lora_rank=4, lora_alpha=8.0)
    lora.load_base(policy, base.state_dict(), "checkpointer")
    lora.train_adapters_only(policy)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_b" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    traj, adv, ret = _trajectory(GROUPS, (base, tiny_policy(1), tiny_classifier(1), tiny_classifier(2)))
    micro_batches = [ORDER[:6], ORDER[6:]]
    unshared = _loss_and_grads(packed_ppo_loss_step, policy, None, traj, adv, ret, micro_batches, group_size=1, rows=6)
    shared = _loss_and_grads(packed_ppo_loss_step, policy, None, traj, adv, ret, micro_batches, group_size=N,
                             rows=2, max_reads=6 * T)
    _assert_close(shared, unshared)
    assert shared[2] and all("lora" in name for name in shared[2])


# --- compiled == eager, one graph ------------------------------------------------------------


def test_compiled_shared_regions_match_eager_without_recompiles(monkeypatch, scoring_models):
    """Scoring and loss step compiled (dynamo traces and guards as with inductor; its eager backend
    runs the graph): the eager values, and no recompile for another length mix."""
    monkeypatch.setenv(BACKEND_ENV, "eager")
    score = maybe_compile(packed_score_trajectory, enabled=True)
    step_fn = maybe_compile(packed_ppo_loss_step, enabled=True)
    counter = RecompileCounter()
    policy, value = tiny_policy(0), tiny_classifier(1)
    for k, mix in enumerate((GROUPS, OTHER, dict(GROUPS, stops=[None] * 12))):
        qr, prompt_lens = _generated(**mix, seed=k)
        eager, _ = _score(qr, prompt_lens, scoring_models, N)
        compiled, _ = _score(qr, prompt_lens, scoring_models, N, score=score)
        _assert_trajectories_close(compiled, eager)
        traj, adv, ret = _trajectory(mix, (policy, tiny_policy(1), value, tiny_classifier(2)), seed=k)
        args = (policy, value, traj, adv, ret, [ORDER[:6], ORDER[6:]])
        ours = _loss_and_grads(step_fn, *args, group_size=N, rows=2, max_reads=6 * T)
        _assert_close(ours, _loss_and_grads(packed_ppo_loss_step, *args, group_size=N, rows=2, max_reads=6 * T))
        if k == 0:
            counter.mark()
    assert counter.since_mark == 0


# --- the update: group-wise draw -----------------------------------------------------------


def _update(policy, value, group_size, share, epochs=2, ppo_batch_size=8, grad_accum=2):
    params = [p for m in (policy, value) if m is not None for p in m.parameters()]
    return PPOUpdate(policy, value, torch.optim.SGD(params, lr=0.5), None, packed_ppo_loss_step,
                     batch_size=12, ppo_batch_size=ppo_batch_size, ppo_epochs=epochs,
                     gradient_accumulation_steps=grad_accum, prompt_len=P, response_len=T, temperature=0.7,
                     loss=LossSettings(epsilon=0.2, value_clip_range=0.2, value_coeff=0.1), clip_grad_norm=1.0,
                     optimizer_in_bwd=False, group_size=group_size, share_prompts=share)


class _NoTimer:
    def __call__(self, phase):
        import contextlib
        return contextlib.nullcontext()


@pytest.mark.parametrize("ppo_batch_size,grad_accum", [(8, 2), (12, 3), (6, 1)])
def test_shared_update_matches_unshared_with_the_same_draw(ppo_batch_size, grad_accum):
    """Two epochs of minibatches (whole groups, or a group cut by a minibatch boundary): the
    shared update leaves the weights and stats of the unshared one with the same draw."""
    models = tiny_policy(0), tiny_classifier(1)
    traj, adv, ret = _trajectory(GROUPS, (models[0], tiny_policy(1), models[1], tiny_classifier(2)))
    results, weights = [], []
    for share in (False, True):
        policy, value = copy.deepcopy(models[0]), copy.deepcopy(models[1])
        torch.manual_seed(5)  # the draw
        update = _update(policy, value, N, share, ppo_batch_size=ppo_batch_size, grad_accum=grad_accum)
        results.append(update(traj, adv, ret, _NoTimer(), step=1))
        weights.append({n: p.detach().clone() for m in (policy, value) for n, p in m.named_parameters()})
    for a, b in zip(results[1].stats, results[0].stats):
        for name, x, y in zip(rlhf.PPOStats._fields, a, b):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], atol=ATOL, rtol=0, msg=name)
    assert any(not torch.equal(weights[0][n], p) for n, p in models[0].named_parameters())  # it trained


def test_group_wise_draw_keeps_groups_together_and_rows_without_groups():
    update = _update(tiny_policy(0), None, N, True)
    torch.manual_seed(0)
    order = update._draw(torch.device("cpu"))
    assert sorted(order) == list(range(12))
    assert all(order[k : k + N] == list(range(order[k], order[k] + N)) and order[k] % N == 0
               for k in range(0, 12, N))
    # without groups: the row permutation of the same random stream, as before groups existed
    plain = _update(tiny_policy(0), None, 1, True)
    torch.manual_seed(0)
    expected = torch.randperm(12).tolist()
    torch.manual_seed(0)
    assert plain._draw(torch.device("cpu")) == expected


# --- config and memory plan ------------------------------------------------------------------


def _grpo(tmp_path, **overrides):
    return recipe_config(tmp_path, "grpo_tiny_arithmetic.yaml", **overrides)


def test_switch_on_wherever_the_sizes_allow_and_falls_back_with_a_note(tmp_path, monkeypatch):
    notes = []
    monkeypatch.setattr(batches, "note", notes.append)
    assert share_group_prompt(_grpo(tmp_path, num_samples_per_prompt=4)) and not notes
    assert share_group_prompt(_grpo(tmp_path, num_samples_per_prompt=4, share_group_prefill=True))
    assert not share_group_prompt(_grpo(tmp_path, num_samples_per_prompt=4, share_group_prefill=False)) and not notes
    # auto: forward_batch_size per process not whole groups, on 1 process or on 2
    assert not share_group_prompt(_grpo(tmp_path, num_samples_per_prompt=8, forward_batch_size=4,
                                        ppo_batch_size=16))
    assert "forward_batch_size=4 gives 4 rows per process, not whole groups of num_samples_per_prompt=8" in notes[-1]
    assert not share_group_prompt(_grpo(tmp_path, num_samples_per_prompt=4, forward_batch_size=8), world_size=4)
    assert "2 rows per process" in notes[-1]
    assert not share_group_prompt(recipe_config(tmp_path, num_samples_per_prompt=4, **{"compile.rollout": True}))
    assert "compile.rollout=True" in notes[-1]
    assert not share_group_prompt(recipe_config(tmp_path))
    assert "num_samples_per_prompt=1" in notes[-1]
    with pytest.raises(ValueError, match="share_group_prefill=True with compile.rollout=True"):
        recipe_config(tmp_path, num_samples_per_prompt=4, share_group_prefill=True, **{"compile.rollout": True})


def test_memory_plan_counts_a_groups_prompt_once(tmp_path):
    from torchtune_ppo.run.memory import memory_plan

    def activations(**overrides):  # PPO with groups of 8, 12-token prompts and 6-token responses
        cfg = recipe_config(tmp_path, num_samples_per_prompt=8, batch_size=8, forward_batch_size=32,
                            ppo_batch_size=32, max_generated_tokens=6, **overrides)
        rows = memory_plan(cfg, prompt_len=12).rows
        return next((k, v) for k, v in rows.items() if k.startswith("activations"))

    (label_on, on), (label_off, off) = activations(), activations(share_group_prefill=False)
    assert "micro-step 16 packed rows x 17 tokens" in label_off  # 2 micro-batches of 16 responses
    # 16 responses, 8 a row after one copy of the 12-token prompt: 2 rows of 12 + 8 * 5
    assert "micro-step 2 packed rows x 52 tokens" in label_on
    assert on < off
