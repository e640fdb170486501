"""Token embeddings whose bf16 gradient is summed in fp32 without a dense fp32 buffer.

A token embedding's gradient is dense (``[V, D]``) but only the rows of the tokens a micro-step
reads are non-zero. Compiled, inductor lowers its backward to a zeroed fp32 ``[V, D]`` buffer,
an atomic scatter-add of the token rows and a pass rounding the whole buffer to bf16: on
SmolLM2 (V = 49152, D = 576, 344 packed tokens) 113 MB zeroed, written and read back to
update 344 rows, 42 ms a call on 2 cores against 13 ms for torch's eager kernel
(benchmarks/RESULTS.md, "The token embeddings' gradient"). torch's eager kernel is fast but adds up the rows of a
repeated token in bf16, and the chat template's tokens repeat in every row.

:class:`Fp32GradEmbedding` keeps ``nn.Embedding``'s forward, weight and state dict; its backward
is one op the compiler does not look into (:func:`embedding_grad`): the rows of each distinct
token summed in fp32 (``[U, D]``, U <= the number of tokens), rounded once, and written into a
zeroed gradient of the weight's dtype. In fp32 inductor's own lowering is as fast (25 ms both
ways), so the recipe swaps it in for bf16 models on the CPU (``models/build.py``).
"""

import torch
from torch import nn


@torch.library.custom_op("torchtune_ppo::embedding_grad", mutates_args=())
def embedding_grad(grad: torch.Tensor, indices: torch.Tensor, num_weights: int) -> torch.Tensor:
    """The gradient ``[num_weights, D]`` of ``embedding(indices, weight)`` for the output's
    gradient ``grad`` (``[*indices.shape, D]``): each token's rows summed in fp32, then rounded
    to ``grad``'s dtype; the rows of tokens not in ``indices`` are 0."""
    dim = grad.shape[-1]
    tokens, slot = torch.unique(indices.reshape(-1), return_inverse=True)
    sums = torch.zeros(tokens.numel(), dim, dtype=torch.float32, device=grad.device)
    sums.index_add_(0, slot, grad.reshape(-1, dim).float())
    out = grad.new_zeros(num_weights, dim)
    out[tokens] = sums.to(grad.dtype)
    return out


@embedding_grad.register_fake
def _(grad: torch.Tensor, indices: torch.Tensor, num_weights: int) -> torch.Tensor:
    return grad.new_empty(num_weights, grad.shape[-1])


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(indices, weight)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        weight, indices = inputs
        ctx.save_for_backward(indices)
        ctx.num_weights = weight.shape[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return embedding_grad(grad, indices, ctx.num_weights), None


class Fp32GradEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight gradient is :func:`embedding_grad`'s (plain embeddings only:
    no ``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` or ``sparse``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(input)
        return _Embedding.apply(self.weight, input)


def _plain(module: nn.Module) -> bool:
    return (type(module) is nn.Embedding and module.padding_idx is None and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def use_fp32_grad_embeddings(model: nn.Module) -> int:
    """Every plain ``nn.Embedding`` of ``model`` becomes an :class:`Fp32GradEmbedding` in place
    (the same weight, so a tied output layer stays tied). Returns how many were changed."""
    found = [m for m in model.modules() if _plain(m)]
    for module in found:
        module.__class__ = Fp32GradEmbedding
    return len(found)
