"""How many AdamW updates round to nothing when the weights themselves are bf16.

A bf16 number keeps 8 significant bits: between 2^e and 2^(e+1) it moves in steps of
2^(e-7), and round-to-nearest drops any change smaller than half a step. An AdamW update is
about ``lr * m / sqrt(v)``, at most about ``lr`` in size (exactly ``lr`` on the first step, where
``m / sqrt(v) = sign(g)``). This counts, over every trained weight of a checkpoint, the share
whose bf16 value is the same after ``w - u`` and after ``w + u`` for an update of size
``u = lr`` (the upper bound of a step: later steps are smaller, so the share is a lower bound
of what plain bf16 AdamW loses). With fp32 master weights (``master_weights: true``, the
default) none is lost in the masters, which accumulate the steps; the bf16 weights follow them
once a master has moved half a spacing (``master_rounding: nearest``) or, on average, as they
move (``dither``, the default; ``masters_reach_model.py`` measures what reached a run's model).

    python benchmarks/precision/bf16_updates.py [--checkpoint DIR] [--lr 1e-5 1e-4]

The default checkpoint is SmolLM2-135M-Instruct as ``tools/prepare_smollm2.py`` writes it.
"""

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

DEFAULT = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR",
                              Path.home() / ".cache/torchtune_ppo/SmolLM2-135M-Instruct"))


def lost_share(weights: torch.Tensor, update: float) -> float:
    """Share of ``weights`` (rounded to bf16 first) that an update of ``+-update`` leaves as they are."""
    w = weights.to(torch.bfloat16)
    up = (w.float() + update).to(torch.bfloat16) == w
    down = (w.float() - update).to(torch.bfloat16) == w
    return float((up & down).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-4])
    args = parser.parse_args()
    files = sorted(args.checkpoint.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {args.checkpoint}; run python tools/prepare_smollm2.py first.")
    tensors = {k: v for f in files for k, v in load_file(str(f)).items() if v.is_floating_point()}
    n = sum(t.numel() for t in tensors.values())
    flat = torch.cat([t.flatten().float() for t in tensors.values()])
    print(f"{args.checkpoint}: {len(tensors)} tensors, {n / 1e6:.1f}M weights, "
          f"median |w| {flat.abs().median():.4f}")
    print("| lr (update size) | share of weights an update leaves unchanged in bf16 |")
    print("| ---: | ---: |")
    for lr in args.lr:
        print(f"| {lr:g} | {100 * lost_share(flat, lr):.1f}% |")


if __name__ == "__main__":
    main()
