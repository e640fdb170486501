"""One frozen base for the reward and the value model (``lora.SharedBaseReward``): the reward
model is the LoRA value model's base with its adapters off and the reward checkpoint's head.
Its scores are a separate copy's bit for bit, its only parameters are the head's, and the
compiled scoring region, which switches the adapters off and on inside, compiles once."""

import contextlib

import pytest
import torch
from torchtune.models.llama2 import lora_llama2_classifier

from conftest import EOS_ID, PAD_ID, VOCAB, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo import lora
from torchtune_ppo.compile import RecompileCounter, compile_count, regions
from torchtune_ppo.config import parse_compile
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout import Rollout
from torchtune_ppo.rollout.fused import score_trajectory
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.rlhf import ScoringSettings

P, T = 6, 5
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=0.7, penalise_no_eos=False,
                           min_response_length=None, reward_penalty=-3.0)
TIMER = lambda phase: contextlib.nullcontext()  # noqa: E731


def _lora_classifier(state):
    model = lora_llama2_classifier(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, num_classes=1,
        vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
        intermediate_dim=64, lora_rank=4, lora_alpha=8.0)
    lora.load_base(model, state, "checkpointer")
    return model


def models():
    """(value, shared reward, separate reward): the value model trained (random ``lora_b``, a
    moved head), the reward model on its base, and the reward model as its own copy."""
    checkpoint = tiny_classifier(2).state_dict()  # the reward model's checkpoint
    value = _lora_classifier(checkpoint)
    shared = lora.SharedBaseReward(value, lora.checkpoint_head(value, checkpoint))
    lora.train_adapters_only(value, also=lora.head_names(value))
    with torch.no_grad():
        for name, p in value.named_parameters():
            if "lora_b" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
        value.output.weight.add_(0.1)
    separate = _lora_classifier(checkpoint)
    lora.adapters_off_for_good(separate)
    return value, shared, separate.eval().requires_grad_(False)


def _rollout(policy, ref, value, reward_model, compile_cfg=False):
    gen = Generator(policy, batch_size=2, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID], temperature=0.7)
    r = regions(parse_compile(compile_cfg))
    return Rollout(gen, ref, value, ModelReward(reward_model), STOP, SETTINGS, score=r.score,
                   whole_scoring_models=r.whole_scoring_models)


def _batch(seed):
    lens = torch.tensor([[6, 1, 3, 4], [2, 5, 6, 1], [4, 4, 2, 3]][seed % 3])
    return left_padded_prompts(lens.tolist(), P, seed=seed), lens


@torch.no_grad()
def test_reward_on_the_shared_base_is_the_separate_copy_exactly():
    value, shared, separate = models()
    policy, ref = tiny_policy(0), tiny_policy(0).eval().requires_grad_(False)
    prompts, lens = _batch(0)
    a = _rollout(policy, ref, value, shared)(prompts, lens, torch.Generator().manual_seed(0), TIMER)
    b = _rollout(policy, ref, value, separate)(prompts, lens, torch.Generator().manual_seed(0), TIMER)
    for name, x, y in zip(a._fields, a, b):
        if x is None and y is None:  # a field of multi-turn episodes only
            continue
        assert torch.equal(x, y), name
    # not vacuous: with its adapters on and its own head the value model scores otherwise
    tokens = a.query_responses
    assert (value(tokens) - separate(tokens)).abs().max() > 1e-2
    assert not any(m.disabled for m in shared.base_adapters)  # on again after the scoring
    # the padded scoring (compile.rollout's) calls the reward model itself: the same scores
    padded = [score_trajectory(tokens, lens, a.logprobs, None, ref, value, ModelReward(m), STOP, SETTINGS)
              for m in (shared, separate)]
    assert torch.equal(padded[0].scores, padded[1].scores)
    torch.testing.assert_close(padded[0].scores, a.scores, rtol=0, atol=1e-5)  # padded vs packed: op order


def test_the_base_is_one_set_of_tensors_and_only_the_head_is_the_reward_models():
    value, shared, _ = models()
    assert [n for n, _ in shared.named_parameters()] == ["output.weight"]
    assert list(shared.state_dict()) == ["output.weight"]
    assert not shared.output.weight.requires_grad and shared.output.weight is not value.output.weight
    base = {id(p) for n, p in value.named_parameters() if not n.startswith("output.")}
    seen = {id(p) for m in (shared.tok_embeddings, shared.layers, shared.norm) for p in m.parameters()}
    assert seen == base
    assert len(shared.base_adapters) == 2 * 7


@pytest.mark.slow  # compiles
@torch.no_grad()
def test_compiled_scoring_with_the_shared_base_compiles_once_and_matches_eager():
    """The scoring region switches the base's adapters off for the reward forward and on again:
    one graph for every call, whose scores match the separate copy's eager ones."""
    value, shared, separate = models()
    policy, ref = tiny_policy(0), tiny_policy(0).eval().requires_grad_(False)
    trajectory_only = {"generate": False, "trajectory": True, "loss_step": False, "rollout": False}
    compiled = _rollout(policy, ref, value, shared, trajectory_only)
    eager = _rollout(policy, ref, value, separate)
    counter, graphs = RecompileCounter(), compile_count()
    for call in range(3):
        prompts, lens = _batch(call)
        a = compiled(prompts, lens, torch.Generator().manual_seed(call), TIMER)
        b = eager(prompts, lens, torch.Generator().manual_seed(call), TIMER)
        if call == 0:
            assert compile_count() - graphs == 1
            counter.mark()
        assert torch.equal(a.query_responses, b.query_responses)
        # fp32 inductor kernels sum in another order than eager: ~1e-6 on scores of size ~1
        torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-5)
        assert not any(m.disabled for m in shared.base_adapters)
    assert counter.since_mark == 0
