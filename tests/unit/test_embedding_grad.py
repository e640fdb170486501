"""``Fp32GradEmbedding`` (models/embedding.py): a token embedding whose bf16 gradient sums each
token's rows in fp32 and is rounded once, eager and compiled; the bf16 CPU run trains with it."""

import pytest
import torch
from torch import nn
from torchtune.modules import TiedLinear

from torchtune_ppo.models.embedding import Fp32GradEmbedding, embedding_grad, use_fp32_grad_embeddings

V, D = 64, 16


def _case(dtype):
    """An embedding, token ids in which 4 tokens repeat ~8 times each (as a chat template's do
    across packed rows), an output gradient, and the reference weight gradient: summed in fp64
    and rounded once to ``dtype``."""
    torch.manual_seed(0)
    emb = nn.Embedding(V, D).to(dtype)
    ids = torch.cat([torch.randint(0, 4, (3, 11)), torch.randint(0, V, (3, 6))], 1)  # [3, 17]
    out_grad = torch.randn(3, 17, D).to(dtype)
    ref = torch.zeros(V, D, dtype=torch.float64).index_add_(0, ids.flatten(), out_grad.flatten(0, 1).double())
    return emb, ids, out_grad, ref.to(dtype)


def _weight_grad(run, emb, ids, out_grad):
    emb.weight.grad = None
    run(emb, ids, out_grad)
    return emb.weight.grad


def _loss(emb, ids, out_grad):
    return (emb(ids) * out_grad).sum()


def _backward(emb, ids, out_grad, loss=_loss):
    loss(emb, ids, out_grad).backward()


def test_bf16_gradient_sums_repeated_tokens_in_fp32_where_torch_sums_in_bf16():
    emb, ids, out_grad, ref = _case(torch.bfloat16)
    torchs = _weight_grad(_backward, emb, ids, out_grad)
    assert not torch.equal(torchs, ref)  # torch's kernel rounds after every repeated row
    assert use_fp32_grad_embeddings(emb) == 1 and type(emb) is Fp32GradEmbedding
    ours = _weight_grad(_backward, emb, ids, out_grad)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # fp32 sums of <= 9 bf16 rows, one rounding


def test_fp32_gradient_is_torchs():
    emb, ids, out_grad, ref = _case(torch.float32)
    torchs = _weight_grad(_backward, emb, ids, out_grad)
    use_fp32_grad_embeddings(emb)
    torch.testing.assert_close(_weight_grad(_backward, emb, ids, out_grad), torchs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torchs.double(), ref.double(), rtol=1e-5, atol=1e-5)


def test_forward_weight_and_state_dict_are_nn_embeddings():
    emb, ids, _, _ = _case(torch.bfloat16)
    weight, before = emb.weight, emb(ids)
    holder = nn.Module()
    holder.tok_embeddings, holder.output = emb, TiedLinear(emb)
    holder.padded = nn.Embedding(V, D, padding_idx=0)
    keys = list(holder.state_dict())
    assert use_fp32_grad_embeddings(holder) == 1  # the padded one is not a plain embedding
    assert type(holder.padded) is nn.Embedding and holder.output.tied_module is emb and emb.weight is weight
    assert list(holder.state_dict()) == keys
    assert torch.equal(emb(ids), before)
    with torch.no_grad():  # frozen or no grad: torch's own forward, nothing saved for backward
        assert emb(ids).grad_fn is None
    assert use_fp32_grad_embeddings(holder) == 0  # a second call changes nothing


def test_compiled_gradient_equals_eager():
    """fullgraph through AOTAutograd: the op's fake shape stands in while tracing, and the
    compiled backward runs the op itself (inductor's own lowering of the embedding's backward is
    the 113 MB fp32 buffer this replaces)."""
    emb, ids, out_grad, ref = _case(torch.bfloat16)
    use_fp32_grad_embeddings(emb)
    loss = torch.compile(_loss, backend="aot_eager", fullgraph=True)  # as the loss step: forward compiled

    def compiled(emb, ids, out_grad):
        _backward(emb, ids, out_grad, loss)
    torch.testing.assert_close(_weight_grad(compiled, emb, ids, out_grad), ref, rtol=0, atol=0)
    ids2 = torch.randint(0, V, (2, 9))  # another shape recompiles; the gradient stays exact
    ref2 = torch.zeros(V, D).index_add_(0, ids2.flatten(), out_grad[:2, :9].flatten(0, 1).float()).bfloat16()
    torch.testing.assert_close(_weight_grad(compiled, emb, ids2, out_grad[:2, :9]), ref2, rtol=0, atol=0)


def test_the_op_checks_its_inputs_by_opcheck():
    _, ids, out_grad, _ = _case(torch.bfloat16)
    torch.library.opcheck(embedding_grad, (out_grad, ids, V), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype, expected", [("bf16", Fp32GradEmbedding), ("fp32", nn.Embedding)])
def test_the_run_trains_bf16_models_with_it(make_recipe, dtype, expected):
    """The trained policy and value model of a bf16 CPU run; the frozen reference and reward
    models never (they take no gradient); fp32 runs are unchanged."""
    recipe, _ = make_recipe(dtype=dtype)
    models = recipe._models
    assert type(models.policy.tok_embeddings) is expected and type(models.value.tok_embeddings) is expected
    assert type(models.ref_policy.tok_embeddings) is nn.Embedding
    assert type(models.reward.tok_embeddings) is nn.Embedding
