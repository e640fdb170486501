"""How much of what the fp32 masters learned reached the bf16 model a run generates and trains with.

A bf16 run with ``master_weights`` steps fp32 masters and rounds them into the bf16 weights
after every optimizer step (``master_rounding``). The masters begin as copies of the bf16
weights, on the bf16 grid, so with round to nearest a weight changes only once its master has
moved half a spacing. For a saved SmolLM2 policy this prints, against the weights it started
from (rounded to bf16, as the run loaded them):

- the share of the policy's bf16 weights that differ from the start, and the mean distance they
  moved, in bf16 spacings of their starting value;
- from the checkpoint's masters (``training_state.pt``): the mean distance each master moved, in
  bf16 spacings of its starting weight, and the share that moved half a spacing or more (weights
  that start at exactly 0 left out);
- for an fp32 run's checkpoint (no masters): the mean distance its weights moved, in the same
  spacings (what a bf16 model would have had to follow).

    python benchmarks/precision/masters_reach_model.py <run>/checkpoints/step_20 [<another> ...]

The start is SmolLM2-135M-Instruct as ``tools/prepare_smollm2.py`` writes it (``--start``).
"""

import argparse
import os
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import load_file
from torchtune.models.convert_weights import hf_to_tune

from torchtune_ppo.models import smollm2_135m

DEFAULT = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR",
                              Path.home() / ".cache/torchtune_ppo/SmolLM2-135M-Instruct"))
HEADS = dict(num_heads=9, num_kv_heads=3, dim=576)


def tune_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """A SmolLM2 HF folder's weights under torchtune's names (every ``*.safetensors`` file)."""
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(f))
    return hf_to_tune(sd, **HEADS)


def spacing(w: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at each bf16 value ``w`` (2^(e-7))."""
    return torch.exp2(torch.floor(torch.log2(w.float().abs())) - 7)


def report(checkpoint: Path, start: Dict[str, torch.Tensor], names) -> None:
    saved = tune_weights(checkpoint / "policy")
    changed = total = 0
    model_moved, nonzero = 0.0, 0
    for name in names:
        s, w = start[name].to(torch.bfloat16), saved[name]
        changed += int((w.to(torch.bfloat16) != s).sum()) if w.dtype == torch.bfloat16 else 0
        total += s.numel()
        d = ((w.float() - s.float()).abs() / spacing(s))[s != 0]
        model_moved, nonzero = model_moved + float(d.sum()), nonzero + d.numel()
    dtype = saved[names[0]].dtype
    line = f"{checkpoint}: policy {dtype}"
    if dtype == torch.bfloat16:
        line += (f", bf16 weights changed since the start: {changed / total:.2%}, "
                 f"moved {model_moved / nonzero:.3f} spacings on average")
    state_path = checkpoint / "training_state.pt"
    masters = None
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        masters = (state.get("master_weights") or {}).get("masters")
    moved, past_half, n = 0.0, 0, 0
    for i, name in enumerate(names):
        s = start[name].to(torch.bfloat16)
        now = masters[i] if masters is not None else saved[name].float()
        ref = s.float() if masters is not None else start[name].float()  # masters began as the bf16 weights
        d = ((now.float() - ref).abs() / spacing(s))[s != 0]  # a zero's spacing is subnormal
        moved += float(d.sum())
        past_half += int((d >= 0.5).sum())
        n += d.numel()
    what = "masters" if masters is not None else "fp32 weights"
    line += f"; {what} moved {moved / n:.3f} spacings on average, {past_half / n:.2%} half a spacing or more"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", type=Path, nargs="+", help="step_<N> folders of SmolLM2 runs")
    parser.add_argument("--start", type=Path, default=DEFAULT)
    args = parser.parse_args()
    with torch.device("meta"):
        names = [n for n, _ in smollm2_135m().named_parameters()]  # the optimizer's order: policy first
    start = tune_weights(args.start)
    for checkpoint in args.checkpoints:
        report(checkpoint, start, names)


if __name__ == "__main__":
    main()
