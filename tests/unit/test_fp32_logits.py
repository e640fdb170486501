"""``fp32_logits``: the policy's output projection computes in float32 from bf16 hidden states
and weights (models/build.py ``fp32_output``); the rollout/training mismatch it changes is
measured in benchmarks/RESULTS.md."""

import pytest
import torch
from torch import nn
from torchtune.modules import TiedLinear

from torchtune_ppo.models.build import FP32Linear, FP32TiedLinear, fp32_output
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy


def _bf16_policy():
    torch.manual_seed(0)
    model = tiny_policy().to(torch.bfloat16)
    for p in model.parameters():  # weights of a trained model's size, not the init's tiny ones
        p.data.normal_(0, 0.5)
    return model


def test_untied_projection_runs_in_fp32_with_the_same_weight_and_state_dict():
    model = _bf16_policy()
    weight, keys = model.output.weight, list(model.state_dict())
    h = torch.randn(5, weight.shape[1]).to(torch.bfloat16)
    rounded = model.output(h).float()  # bf16 product, rounded to bf16, then cast
    fp32_output(model)
    assert type(model.output) is FP32Linear and model.output.weight is weight
    assert list(model.state_dict()) == keys
    logits = model.output(h)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, h.float() @ weight.float().T, rtol=1e-6, atol=1e-6)
    assert (logits - rounded).abs().max() > 1e-3  # bf16 logits were rounded; these are not
    fp32_output(model)  # a second call changes nothing
    assert type(model.output) is FP32Linear


def test_gradients_reach_the_bf16_weight():
    model = fp32_output(_bf16_policy())
    h = torch.randn(3, model.output.weight.shape[1], dtype=torch.bfloat16, requires_grad=True)
    model.output(h).logsumexp(-1).sum().backward()
    assert model.output.weight.grad.dtype == torch.bfloat16 and model.output.weight.grad.abs().sum() > 0
    assert h.grad.dtype == torch.bfloat16


def test_tied_projection_runs_in_fp32_on_the_embedding_weight():
    emb = nn.Embedding(11, 6).to(torch.bfloat16)
    holder = nn.Module()
    holder.output = TiedLinear(emb)
    fp32_output(holder)
    assert type(holder.output) is FP32TiedLinear and holder.output.tied_module is emb
    h = torch.randn(4, 6).to(torch.bfloat16)
    torch.testing.assert_close(holder.output(h), h.float() @ emb.weight.float().T, rtol=1e-6, atol=1e-6)


def test_other_projections_are_refused_by_name():
    holder = nn.Module()
    holder.output = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="fp32_logits=True .* Sequential"):
        fp32_output(holder)


@pytest.mark.parametrize("dtype, fp32_logits, expected", [
    ("bf16", True, FP32Linear), ("bf16", False, nn.Linear), ("fp32", True, nn.Linear)])
def test_the_run_builds_its_policy_and_reference_with_the_setting(make_recipe, dtype, fp32_logits, expected):
    """The policy and the reference get the fp32 projection in a bf16 run that asks for it; the
    value and reward models never (their heads are not a vocabulary); fp32 runs are unchanged."""
    recipe, _ = make_recipe(dtype=dtype, fp32_logits=fp32_logits)
    models = recipe._models
    assert type(models.policy.output) is expected and type(models.ref_policy.output) is expected
    assert type(models.value.output) is nn.Linear and type(models.reward.output) is nn.Linear
