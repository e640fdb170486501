"""Packed scoring (steps 2-6 on real tokens only) against the padded ``score_trajectory``.

Every Trajectory field equal within 1e-5 on ragged batches, eager and compiled; the compiled
tests share one compiled artefact (one graph, dynamic in the packed rows and reads, compiled
once per module) and call it with the same model objects, as the recipe does.
"""

import contextlib

import pytest
import torch

from conftest import EOS_ID, PAD_ID, VOCAB, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo import rlhf
from torchtune_ppo.compile import RecompileCounter, compile_count, maybe_compile
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.rollout.scoring import (
    MIN_SIZE, packed_score_trajectory, plan_scoring,
)
from torchtune_ppo.rlhf.packing import plan_micro_steps
from torchtune_ppo.rewards import FunctionReward
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout import Rollout
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rlhf import ScoringSettings, concat_trajectories

P, T = 6, 7
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=0.7, penalise_no_eos=True,
                           min_response_length=2, reward_penalty=-3.0)
CHUNKS = 3  # several output projections, of uneven fill

RAGGED = dict(  # 1-token prompts, 1-token responses, rows without a stop token, a pad id in a prompt
    prompt_lens=[6, 1, 3, 4, 2, 5, 1, 6],
    stops=[0, None, 3, 6, 2, 1, 5, None],
    pad_inside=(0, 2),
)
SHORT = dict(  # short everything: many sequences per row, few rows
    prompt_lens=[1, 2, 1, 3, 2, 1, 4, 1],
    stops=[1, 0, 2, 0, 1, 3, 0, 2],
    pad_inside=(6, 3),
)
LONG = dict(  # nothing stops: every row full, as many rows as sequences
    prompt_lens=[6, 6, 5, 6, 6, 4, 6, 6],
    stops=[None] * 8,
    pad_inside=None,
)


def _batch(prompt_lens, stops, pad_inside, seed=0):
    """Generated rows: ``stops[i]`` is row i's first stop token (None: never stops); after it,
    more tokens (stop tokens too), as a generator leaves them."""
    b = len(prompt_lens)
    g = torch.Generator().manual_seed(seed)
    prompts = left_padded_prompts(prompt_lens, P, seed=seed)
    if pad_inside is not None:  # pad id as a real prompt token
        prompts[pad_inside] = PAD_ID
    responses = torch.randint(3, VOCAB, (b, T), generator=g)
    for i, stop in enumerate(stops):
        if stop is not None:
            responses[i, stop] = EOS_ID
            if stop + 2 < T:
                responses[i, stop + 2] = EOS_ID
    return torch.cat([prompts, responses], 1), torch.tensor(prompt_lens), torch.randn(b, T, generator=g)


def _plan(query_responses, prompt_lens):
    padding, _ = rlhf.truncate_after_stop_token(query_responses[:, P:], STOP, PAD_ID)
    return plan_scoring(prompt_lens.tolist(), (~padding).sum(-1).tolist(), prompt_len=P,
                        response_len=T, num_chunks=CHUNKS, device=query_responses.device)


def _assert_same(packed, padded, atol=1e-5):
    for name, a, b in zip(padded._fields, packed, padded):
        if a is None and b is None:  # a field of multi-turn episodes only
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if b.is_floating_point():
            torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def scoring_models():
    policy, ref = tiny_policy(5), tiny_policy(0)
    value, reward = tiny_classifier(1), tiny_classifier(2)
    for m in (policy, ref, value, reward):
        m.eval().requires_grad_(False)
    return policy, ref, value, reward


@pytest.mark.parametrize("mix", [RAGGED, SHORT, LONG], ids=["ragged", "short", "long"])
@torch.no_grad()
def test_packed_equals_padded_with_a_reward_model(scoring_models, mix):
    _, ref, value, reward = scoring_models
    qr, lens, logprobs = _batch(**mix)
    padded = score_trajectory(qr, lens, logprobs, None, ref, value, ModelReward(reward), STOP, SETTINGS)
    packed = packed_score_trajectory(qr, lens, logprobs, None, ref, value, reward, STOP, _plan(qr, lens), SETTINGS)
    _assert_same(packed, padded)
    valid = ~padded.response_padding_masks
    assert (padded.ref_logprobs[valid] != 0).all() and (padded.values[valid] != 0).all()
    assert (packed.ref_logprobs[~valid] == 0).all() and (packed.values[~valid] == 0).all()


@torch.no_grad()
def test_packed_equals_padded_with_given_scores_and_computed_policy_logprobs(scoring_models):
    policy, ref, value, _ = scoring_models
    qr, lens, _ = _batch(**RAGGED)
    scores = torch.randn(len(lens))
    padded = score_trajectory(qr, lens, None, policy, ref, value, None, STOP, SETTINGS, scores=scores)
    packed = packed_score_trajectory(qr, lens, None, policy, ref, value, None, STOP, _plan(qr, lens),
                                     SETTINGS, scores=scores)
    _assert_same(packed, padded)
    assert (packed.logprobs - packed.ref_logprobs).abs().max() > 1e-2  # the policy's, not the reference's


def test_plan_holds_real_tokens_only():
    qr, lens, _ = _batch(**RAGGED)
    padding, _ = rlhf.truncate_after_stop_token(qr[:, P:], STOP, PAD_ID)
    valid_counts = (~padding).sum(-1).tolist()
    assert valid_counts == [1, 7, 4, 7, 3, 2, 6, 7]
    plan = _plan(qr, lens)
    real = sum(lens.tolist()) + sum(valid_counts)  # 28 prompt + 37 response tokens
    rows, k = plan.token_src.shape[0], plan.read_positions.shape[1]
    assert plan.token_src.shape[1] == P + T and MIN_SIZE <= rows <= len(lens)
    assert rows * (P + T) < qr.numel() and int((plan.segment_ids >= 0).sum()) == real == 65
    assert plan.read_positions.shape == (CHUNKS, k) and k == -(-sum(valid_counts) // CHUNKS)
    # each read predicts its response token from the slot before it, in the same sequence
    flat_tokens = qr.flatten()[plan.token_src].flatten()
    reads = plan.read_index[~padding]
    slots = plan.read_positions.flatten()[reads]
    assert torch.equal(flat_tokens[slots + 1], qr[:, P:][~padding])
    assert torch.equal(plan.segment_ids.flatten()[slots], plan.segment_ids.flatten()[slots + 1])
    # each row's last valid token is where the reward is read
    last = qr[torch.arange(len(lens)), P + torch.tensor(valid_counts) - 1]
    assert torch.equal(flat_tokens[plan.last_positions], last)
    with pytest.raises(ValueError, match="at least one real prompt token"):
        plan_scoring([0, 3], [1, 1], prompt_len=P, response_len=T, num_chunks=1, device=qr.device)


def test_scoring_placement_is_one_first_fit_decreasing_micro_step():
    """plan_scoring places rows with the loss step's planner, as one micro-step of up to b rows."""
    sizes = [10, 3, 7, 9, 1, 5, 10, 2, 6]
    places, step_rows, _ = plan_micro_steps(sizes, [1] * len(sizes), rows=len(sizes), row_len=10,
                                            max_reads=len(sizes))
    cells = set()
    for n, (step, start, _) in zip(sizes, places):
        assert step == 0 and start // 10 == (start + n - 1) // 10 < step_rows[0]
        assert not cells & set(range(start, start + n))
        cells |= set(range(start, start + n))
    assert step_rows == [6]  # 53 slots in rows of 10: 10 | 10 | 9+1 | 7+3 | 6+2 | 5
    with pytest.raises(ValueError, match="does not fit"):
        plan_micro_steps([11], [1], rows=1, row_len=10, max_reads=1)


# ----------------------------------------------------------------------------- Rollout


class _FixedScores:
    def __init__(self, values):
        self.values = values

    def __call__(self, prompts, responses, *, references, prompt_tokens, response_tokens):
        return self.values[: len(prompts)]


class _Decoder:
    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("kind", ["model", "function"])
@torch.no_grad()
def test_rollout_packed_equals_padded(scoring_models, kind):
    policy, ref, value, reward = scoring_models
    gen = Generator(policy, batch_size=4, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID], top_k=None, temperature=0.7)
    fixed = [0.5, -1.0, 2.0, 1.5]  # per chunk of 4
    reward_fn = ModelReward(reward) if kind == "model" else FunctionReward(_FixedScores(fixed), _Decoder())
    lens = torch.tensor([6, 1, 3, 4, 2, 5, 1, 6])  # two chunks of 4
    prompts = left_padded_prompts(lens.tolist(), P, seed=7)
    timer = lambda phase: contextlib.nullcontext()  # noqa: E731
    rollout = Rollout(gen, ref, value, reward_fn, STOP, SETTINGS)
    packed = rollout(prompts, lens, torch.Generator().manual_seed(0), timer)
    # the same responses (same seed), scored on padded rows by the reference twin
    rng, padded = torch.Generator().manual_seed(0), []
    in_graph = ModelReward(reward) if kind == "model" else (lambda qr, masks, pos, last: torch.tensor(fixed))
    for p, n in zip(prompts.split(4), lens.split(4)):
        out = gen.generate(p, n, rng=rng)
        padded.append(score_trajectory(out.query_responses, n, out.logprobs, None, ref, value, in_graph,
                                       STOP, SETTINGS))
    padded = concat_trajectories(padded)
    _assert_same(packed, padded)
    assert not padded.response_padding_masks.all(-1).any()


def test_a_custom_reward_callable_is_refused(scoring_models):
    policy, ref, value, _ = scoring_models
    gen = Generator(policy, batch_size=2, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID], temperature=0.7)
    with pytest.raises(TypeError, match="ModelReward or a FunctionReward"):
        Rollout(gen, ref, value, lambda qr, masks, pos, last: torch.zeros(len(qr)), STOP, SETTINGS)


# ----------------------------------------------------------------------------- compiled


@pytest.fixture(scope="module")
def compiled():
    """One compiled packed scoring region (what ``Rollout`` compiles with ``compile.trajectory``)."""
    return maybe_compile(packed_score_trajectory, enabled=True)


@pytest.mark.slow  # compiles
@torch.no_grad()
def test_compiled_packed_equals_padded_and_compiles_once(compiled, scoring_models):
    _, ref, value, reward = scoring_models
    counter = RecompileCounter()
    graphs = compile_count()
    shapes = set()
    for call, (mix, seed) in enumerate([(RAGGED, 0), (SHORT, 1), (LONG, 2), (RAGGED, 3)]):
        qr, lens, logprobs = _batch(**mix, seed=seed)
        plan = _plan(qr, lens)
        shapes.add((plan.token_src.shape[0], plan.read_positions.shape[1]))
        packed = compiled(qr, lens, logprobs, None, ref, value, reward, STOP, plan.mark_dynamic(), SETTINGS)
        padded = score_trajectory(qr, lens, logprobs, None, ref, value, ModelReward(reward), STOP, SETTINGS)
        _assert_same(packed, padded)
        if call == 0:
            assert compile_count() - graphs == 1  # one graph for every length mix
            counter.mark()
    assert counter.since_mark == 0
    assert len(shapes) >= 3  # the rows and reads did change from call to call
