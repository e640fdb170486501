"""What share of a LoRA adapter's change survives bf16: torchtune's ``LoRALinear`` against the one
rounding of ``OneRoundingLoRALinear``, on SmolLM2-135M-Instruct's own activations.

torchtune's ``LoRALinear`` returns ``F.linear(x, W) + term``: the base product is rounded to bf16
first, and a term under half a bf16 spacing of it rounds back to the same output.
``torchtune_ppo.lora.OneRoundingLoRALinear`` computes ``torch.addmm(term, x, W^T)``, one rounding
of the fp32 sum. Here the shipped LoRA config's adapters (rank 16, alpha 32, on q/k/v/output and
the MLP: 210 layers) get a random ``lora_b`` of std ``sigma`` (about ``sigma / lr`` Adam steps at
``lr``; the config's lr is 1e-4), each layer is fed its input from a bf16 forward of 8 chat
arithmetic prompts, and per ``sigma`` the script prints the share of outputs that land elsewhere
than the single rounding of ``x W^T + term`` and the share of the adapter's term the rounded
output keeps (the regression of ``output - F.linear(x, W)`` on ``term``, mean over layers).

    python benchmarks/precision/lora_adapter_rounding.py
"""

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torchtune.models.convert_weights import hf_to_tune
from torchtune.modules.peft import LoRALinear

from torchtune_ppo import lora
from torchtune_ppo.models import lora_smollm2_135m, smollm2_tokenizer

SMOLLM2 = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR", Path.home() / ".cache/torchtune_ppo/SmolLM2-135M-Instruct"))
PAIRS = [(12, 35), (7, 88), (123, 456), (9, 9), (31, 4), (77, 23), (5, 61), (250, 250)]


def layer_inputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    """Each LoRA layer's input in a forward of ``tokens``."""
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0].detach()))
             for m in model.modules() if isinstance(m, LoRALinear)]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return inputs


@torch.no_grad()
def measure(inputs: dict, sigma: float, generator: torch.Generator) -> tuple:
    """(outputs off the single rounding: torchtune's share, addmm's share; term kept: torchtune, addmm)."""
    off = [0, 0]
    kept = [0.0, 0.0]
    n = 0
    for m, x in inputs.items():
        m.lora_b.weight.copy_(sigma * torch.randn(m.lora_b.weight.shape, generator=generator))
        term = (m.alpha / m.rank) * m.lora_b(m.lora_a(x))
        base = F.linear(x, m.weight)
        single = (x.float() @ m.weight.float().t() + term.float()).to(torch.bfloat16)
        theirs = LoRALinear.forward(m, x)  # torchtune's own forward
        ours = m(x)  # the recipe's bf16 class (round_adapters_once)
        want = term.float()
        for i, y in enumerate((theirs, ours)):
            off[i] += (y != single).sum().item()
            kept[i] += ((y.float() - base.float()) * want).sum().item() / (want * want).sum().item()
        n += single.numel()
    return off[0] / n, off[1] / n, kept[0] / len(inputs), kept[1] / len(inputs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sigmas", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3])
    args = p.parse_args()
    torch.manual_seed(0)  # lora_a's initialisation
    model = lora_smollm2_135m(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                              lora_rank=16, lora_alpha=32, max_seq_len=256)
    state = hf_to_tune(load_file(str(SMOLLM2 / "model.safetensors")), num_heads=9, num_kv_heads=3, dim=576)
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all("lora" in k for k in missing), missing[:3]
    model = model.to(torch.bfloat16)
    tok = smollm2_tokenizer(str(SMOLLM2))
    ids = [tok.encode("<|im_start|>system\nAnswer with the number only.<|im_end|>\n<|im_start|>user\n"
                      f"What is {a} + {b}?<|im_end|>\n<|im_start|>assistant\nThe answer is {a + b}.",
                      add_bos=False, add_eos=False) for a, b in PAIRS]
    length = min(len(i) for i in ids)
    tokens = torch.tensor([i[:length] for i in ids])
    inputs = layer_inputs(model, tokens)
    lora.round_adapters_once(model)
    print(f"{len(inputs)} LoRA layers, {tokens.numel()} tokens, bf16")
    generator = torch.Generator().manual_seed(1)
    for sigma in args.sigmas:
        off_tt, off_ours, kept_tt, kept_ours = measure(inputs, sigma, generator)
        print(f"lora_b std {sigma:.0e}: outputs off the single rounding: torchtune {off_tt:.1%}, addmm {off_ours:.2%}; "
              f"the adapter's term kept: torchtune {kept_tt:.2f}, addmm {kept_ours:.2f}", flush=True)


if __name__ == "__main__":
    main()
