"""LoRA policy pieces: the reference is the base model exactly (adapters off, no second copy),
zero ``lora_b`` starts as the full model exactly, merged weights are the adapted model."""

import contextlib

import pytest
import torch
from torchtune.models.llama2 import lora_llama2
from torchtune.modules.peft import get_adapter_params

from conftest import EOS_ID, PAD_ID, VOCAB, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune_ppo import lora
from torchtune_ppo.compile import regions
from torchtune_ppo.config import parse_compile
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rollout import Rollout
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.rlhf import ScoringSettings

P, T = 6, 5
STOP = torch.tensor([EOS_ID])
SETTINGS = ScoringSettings(prompt_len=P, pad_id=PAD_ID, temperature=0.7, penalise_no_eos=True,
                           min_response_length=None, reward_penalty=-3.0)
EVERYWHERE = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                  apply_lora_to_output=True)


def lora_policy(rank=4, alpha=8.0, trained=True, **where):
    """conftest's tiny_policy(0) as the base of a LoRA model; ``trained``: random ``lora_b``."""
    base = tiny_policy(0)
    model = lora_llama2(**(where or EVERYWHERE), vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2,
                        embed_dim=32, max_seq_len=64, intermediate_dim=64, lora_rank=rank, lora_alpha=alpha)
    lora.load_base(model, base.state_dict(), "checkpointer")
    lora.train_adapters_only(model)
    if trained:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model, base.eval().requires_grad_(False)


def _tokens():
    return torch.randint(3, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_zero_b_starts_as_the_full_model_exactly():
    model, base = lora_policy(trained=False)
    assert torch.equal(model(_tokens()), base(_tokens()))


@torch.no_grad()
def test_adapters_off_is_the_base_model_exactly():
    model, base = lora_policy()
    on = model(_tokens())
    assert (on - base(_tokens())).abs().max() > 1e-2  # the adapters do change the model
    with lora.adapters_off(model):
        assert torch.equal(model(_tokens()), base(_tokens()))
    assert torch.equal(model(_tokens()), on)  # and are on again after the block


def test_only_adapters_train():
    model, _ = lora_policy(**EVERYWHERE)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(get_adapter_params(model))
    # 2 layers x (4 attention + 3 MLP linears) + the LM head, each an A and a B
    assert len(trained) == 2 * (2 * 7 + 1) and all(".lora_a." in n or ".lora_b." in n for n in trained)


@torch.no_grad()
def test_merged_weights_are_the_adapted_model():
    model, base = lora_policy()
    merged = lora.merged_state_dict(model)
    assert set(merged) == set(base.state_dict())
    plain = tiny_policy(1)
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(_tokens()), model(_tokens()), atol=1e-5, rtol=0)


def test_settings_and_peft_config():
    model, _ = lora_policy(rank=4, alpha=8.0, lora_attn_modules=["q_proj", "v_proj"])
    assert lora.lora_settings(model) == lora.LoraSettings(4, 8.0, ["q_proj", "v_proj"])
    assert lora.peft_adapter_config(model) == {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"],
                                                "peft_type": "LORA"}
    assert lora.round_adapters_once(model) == 4  # bf16's adapters: the same settings
    assert lora.lora_settings(model) == lora.LoraSettings(4, 8.0, ["q_proj", "v_proj"])
    model.layers[0].attn.q_proj.rank = 2  # mixed ranks cannot be one adapter_config.json
    with pytest.raises(ValueError, match=r"same \(rank, alpha\)"):
        lora.lora_settings(model)
    with pytest.raises(ValueError, match="no LoRA layers"):
        lora.lora_settings(tiny_policy(0))


def test_load_base_and_load_adapters_name_what_does_not_fit():
    model, base = lora_policy()
    state = base.state_dict()
    del state["norm.scale"]
    with pytest.raises(ValueError, match=r"checkpointer: .*missing \['norm.scale'\]"):
        lora.load_base(model, state, "checkpointer")
    adapters = lora.adapter_state_dict(model)
    adapters.pop("output.lora_a.weight")
    with pytest.raises(ValueError, match=r"step_2: .*missing \['output.lora_a.weight'\]"):
        lora.load_adapters(model, adapters, "step_2")


@torch.no_grad()
def test_rollout_reference_is_the_base_model_exactly():
    """The rollout scores the reference with the policy's adapters off: the same trajectory,
    bit for bit, as with a separate copy of the base weights as the reference."""
    model, base = lora_policy()
    value, reward = tiny_classifier(1), ModelReward(tiny_classifier(2).eval())
    lens = torch.tensor([6, 1, 3, 4])
    prompts = left_padded_prompts(lens.tolist(), P, seed=3)
    timer = lambda phase: contextlib.nullcontext()  # noqa: E731
    gen = Generator(model, batch_size=2, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID], temperature=0.7)
    shared = Rollout(gen, model, value, reward, STOP, SETTINGS, reference=lambda: lora.adapters_off(model))
    copied = Rollout(gen, base, value, reward, STOP, SETTINGS)
    a = shared(prompts, lens, torch.Generator().manual_seed(0), timer)
    b = copied(prompts, lens, torch.Generator().manual_seed(0), timer)
    for name, x, y in zip(a._fields, a, b):
        if x is None and y is None:  # a field of multi-turn episodes only
            continue
        assert torch.equal(x, y), name
    # not vacuous: generation ran with the adapters on, so policy and reference disagree
    valid = ~a.response_padding_masks
    assert (a.logprobs - a.ref_logprobs)[valid].abs().max() > 1e-3
    assert not any(m.disabled for m in model.modules() if hasattr(m, "disabled"))


def test_fused_rollout_is_refused_for_a_lora_reference():
    model, _ = lora_policy()
    gen = Generator(model, batch_size=2, max_prompt_len=P, max_generated_tokens=T, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID], temperature=0.7)
    fused = regions(parse_compile({"rollout": True, "generate": False, "trajectory": False, "loss_step": False}))
    with pytest.raises(ValueError, match="compile.rollout"):
        Rollout(gen, model, tiny_classifier(1), ModelReward(tiny_classifier(2)), STOP, SETTINGS,
                fused_rollout=fused.fused_rollout, reference=lambda: lora.adapters_off(model))


def test_classifier_checkpointer_writes_adapters_like_torchtunes(tmp_path):
    """A LoRA value model saved through ClassifierHFCheckpointer: the same adapter files, names
    and config as torchtune's FullModelHFCheckpointer writes for the same adapters."""
    import json

    from safetensors.torch import load_file
    from torchtune import training
    from torchtune.training import FullModelHFCheckpointer

    import torchtune_ppo
    from torchtune_ppo.models import ClassifierHFCheckpointer
    from torchtune_ppo.tasks.tiny_sentiment import tiny_lora_reward

    source = torchtune_ppo.asset_path("tiny_sentiment/reward")
    ours = ClassifierHFCheckpointer(checkpoint_dir=source, checkpoint_files=["model.safetensors"],
                                    model_type="LLAMA2", output_dir=str(tmp_path / "ours"))
    model = tiny_lora_reward(["q_proj", "v_proj"], apply_lora_to_mlp=True)
    lora.load_base(model, ours.load_checkpoint()[training.MODEL_KEY], "value_checkpointer")
    payload = lambda: {training.MODEL_KEY: {}, training.ADAPTER_KEY: lora.adapter_state_dict(model),  # noqa: E731
                       training.ADAPTER_CONFIG: lora.peft_adapter_config(model)}
    ours.save_checkpoint(payload(), epoch=1, adapter_only=True)
    theirs = FullModelHFCheckpointer(checkpoint_dir=source, checkpoint_files=["model.safetensors"],
                                     model_type="REWARD", output_dir=str(tmp_path / "theirs"))
    theirs.save_checkpoint(payload(), epoch=1, adapter_only=True)
    a, b = tmp_path / "ours" / "epoch_1", tmp_path / "theirs" / "epoch_1"
    assert not list(a.glob("model-*"))
    sa, sb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert json.loads((a / "adapter_config.json").read_text()) == json.loads((b / "adapter_config.json").read_text())
    pa = torch.load(a / "adapter_model.pt", weights_only=True)
    assert pa.keys() == lora.adapter_state_dict(model).keys()


# ---- bf16: the adapter's term added inside the base product ---------------------------------


def _bf16_lora_linear(b_std, seed=0):
    """A torchtune ``LoRALinear`` (64 -> 96, rank 4, alpha 8) in bf16 and an input for it; the
    base weights of unit-scale outputs, ``lora_b`` of ``b_std``: a term of ~``50 * b_std``."""
    from torchtune.modules.peft import LoRALinear

    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(64, 96, rank=4, alpha=8.0)
    with torch.no_grad():
        layer.weight.normal_(std=0.15, generator=g)
        layer.lora_a.weight.normal_(std=0.2, generator=g)
        layer.lora_b.weight.normal_(std=b_std, generator=g)
    x = torch.randn(2, 40, 64, generator=g)
    return layer.to(torch.bfloat16), x.to(torch.bfloat16)


def _swapped(layer):
    import copy

    layer = copy.deepcopy(layer)
    assert lora.round_adapters_once(layer) == 1 and isinstance(layer, lora.OneRoundingLoRALinear)
    return layer


@torch.no_grad()
@pytest.mark.parametrize("b_std", [1e-4, 2e-3])
def test_bf16_adapter_term_is_rounded_once_with_the_base_product(b_std):
    """torchtune's ``LoRALinear`` rounds ``x W^T`` to bf16 and then adds the adapter's term: a term
    under half a bf16 spacing of the product leaves it unchanged. The swapped class's output is
    ``x W^T + term`` summed in fp32 and rounded once."""
    layer, x = _bf16_lora_linear(b_std)
    term = (layer.alpha / layer.rank) * layer.lora_b(layer.lora_a(x))  # the adapter's own bf16 term
    exact = (x.float() @ layer.weight.float().t() + term.float()).to(torch.bfloat16)
    base = torch.nn.functional.linear(x, layer.weight)
    ours, theirs = _swapped(layer)(x), layer(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == (2, 40, 96)
    # the sum rounded once, up to the product's order of accumulation; torchtune's two roundings
    # land elsewhere in a share of the outputs
    assert (ours == exact).float().mean() > 0.99
    assert (theirs == exact).float().mean() < 0.9
    # what the adapter changes: as many outputs as the exact sum changes; with the smaller term
    # torchtune's class leaves more of them at the base product's value
    changed = {name: (y != base).float().mean().item() for name, y in
               (("exact", exact), ("ours", ours), ("theirs", theirs))}
    assert changed["exact"] > 0.05, changed
    assert abs(changed["ours"] - changed["exact"]) < 0.01 * changed["exact"] + 1e-3, changed
    if b_std < 1e-3:
        assert changed["theirs"] < 0.85 * changed["exact"], changed


def test_one_rounding_adapters_keep_the_parameters_gradients_and_the_off_switch():
    """Same parameters and state dict; in fp32 the same output and gradients as torchtune's
    ``LoRALinear`` (only the summation differs); adapters off: ``F.linear`` bit for bit, in bf16."""
    layer, x = _bf16_lora_linear(2e-3, seed=1)
    layer32, x32 = layer.float(), x.float().requires_grad_(True)
    ours = _swapped(layer32)
    assert list(ours.state_dict()) == list(layer32.state_dict())
    grads = []
    for module in (layer32, ours):
        module.zero_grad()
        x32.grad = None
        (module(x32).square().sum()).backward()
        grads.append([x32.grad.clone(), module.lora_a.weight.grad.clone(), module.lora_b.weight.grad.clone()])
    for theirs_g, ours_g in zip(*grads):
        torch.testing.assert_close(ours_g, theirs_g, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer16 = _swapped(layer.to(torch.bfloat16))
        layer16.disabled = True
        assert torch.equal(layer16(x), torch.nn.functional.linear(x, layer16.weight))
        layer16.disabled = False
        layer16.lora_b.weight.zero_()  # zero B: the base product exactly, as torchtune's class
        assert torch.equal(layer16(x), torch.nn.functional.linear(x, layer16.weight))


@pytest.mark.slow  # inductor compiles the layer's forward and backward
def test_compiled_one_rounding_adapter_matches_eager_in_bf16():
    """Compiled by inductor, the swapped class keeps ``addmm``'s single rounding: the same outputs
    and gradients as eager, within bf16's rounding of the gradients' last products."""
    layer, x = _bf16_lora_linear(2e-4, seed=2)
    ours = _swapped(layer)
    ours.lora_a.weight.requires_grad_(True)

    def step(forward, inp):
        out = forward(inp)
        out.float().square().sum().backward()  # through AOTAutograd's compiled backward when compiled
        return out.detach()

    eager_out = step(ours, x)
    eager_grads = [ours.lora_a.weight.grad.clone(), ours.lora_b.weight.grad.clone()]
    ours.zero_grad(set_to_none=True)
    compiled_out = step(torch.compile(ours.forward, backend="inductor", fullgraph=True), x)
    assert (compiled_out == eager_out).float().mean() > 0.99
    base = torch.nn.functional.linear(x, ours.weight)
    assert (compiled_out != base).float().mean() > 0.5 * (eager_out != base).float().mean()
    for got, want in zip([ours.lora_a.weight.grad, ours.lora_b.weight.grad], eager_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
