"""Held-out accuracy of a tiny_arithmetic policy: the shipped one, or one a run saved.

    python benchmarks/tasks/arithmetic_accuracy.py                                   # shipped policy
    python benchmarks/tasks/arithmetic_accuracy.py <output_dir>/checkpoints/step_40/policy

Greedy accuracy over the 500 held-out problems, and sampled accuracy at temperature 1 (4
samples a problem, seeded); a response counts when it ends in EOS and its last number equals
the answer, as the PPO reward scores it.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

from torchtune_ppo import asset_path
from torchtune_ppo.tasks.tiny_arithmetic import tiny_policy, tiny_tokenizer

# The task's builder (its accuracy is the one its pretraining stops on) is a build tool, kept
# out of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools/tasks"))
import build_tiny_arithmetic as build  # noqa: E402


def load_policy(folder: Path) -> torch.nn.Module:
    # model*.safetensors: a LoRA run's folder also holds adapter_model.safetensors
    files = sorted(p.name for p in folder.glob("model*.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = FullModelHFCheckpointer(checkpoint_dir=str(folder), checkpoint_files=files,
                                       model_type="LLAMA2", output_dir=tmp)
        state_dict = ckpt.load_checkpoint()[MODEL_KEY]
    model = tiny_policy()
    model.load_state_dict(state_dict)
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", nargs="?", default=asset_path("tiny_arithmetic/policy"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    problems = json.loads(Path(asset_path("tiny_arithmetic/problems.json")).read_text())["heldout"]
    heldout = [(r["prompt"], r["answer"]) for r in problems]
    policy, tokenizer = load_policy(Path(args.policy)), tiny_tokenizer()
    with torch.no_grad():
        greedy = build.accuracy(policy, tokenizer, heldout)[0]
        rng = torch.Generator().manual_seed(args.seed)
        sampled = build.accuracy(policy, tokenizer, heldout * 4, 1.0, rng)[0]
    print(json.dumps({"policy": str(args.policy), "heldout_problems": len(heldout),
                      "greedy_accuracy": round(greedy, 4), "sampled_accuracy": round(sampled, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
