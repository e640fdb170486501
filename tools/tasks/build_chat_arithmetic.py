"""Builds the chat arithmetic task's problems: ``torchtune_ppo/tasks/chat_arithmetic/assets``.

    python tools/tasks/build_chat_arithmetic.py build [--out DIR]   # writes problems.json, MANIFEST.json
    python tools/tasks/build_chat_arithmetic.py check               # rebuilds in a temp folder, compares

Arithmetic questions for an instruct model in chat form ("What is 17 - 8?"), each with its
answer: sums and differences of a number below 50 and a digit (SmolLM2-135M-Instruct answers
about 4 in 10 of these correctly at the start, 2-digit by 2-digit ones almost never), shuffled
with a fixed seed and split into a training set for PPO and a held-out set that no run trains on. The data are
plain Python (``random.Random(seed)``), so a rebuild is byte-identical on any machine.
"""

import argparse
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "torchtune_ppo" / "tasks" / "chat_arithmetic" / "assets"
SEED, N_TRAIN, N_HELDOUT = 0, 800, 200


def problems(seed: int = SEED):
    """Every ``a + b`` and ``a - b`` with 0 <= a < 50, 0 <= b < 10, shuffled: ``[{"prompt", "answer"}]``."""
    rows = [{"prompt": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)}
            for a in range(50) for b in range(10) for op in "+-"]
    random.Random(seed).shuffle(rows)
    return rows


def build(out: Path) -> None:
    rows = problems()
    split = {"train": rows[:N_TRAIN], "heldout": rows[N_TRAIN:N_TRAIN + N_HELDOUT]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "problems.json").write_text(json.dumps(split, indent=0) + "\n")
    manifest = {"seed": SEED, "n_train": N_TRAIN, "n_heldout": N_HELDOUT,
                "sha256": {"problems.json": hashlib.sha256((out / "problems.json").read_bytes()).hexdigest()}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "check"])
    parser.add_argument("--out", type=Path, default=ASSETS)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out)
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        differ = [name for name in ("problems.json", "MANIFEST.json")
                  if (Path(tmp) / name).read_bytes() != (ASSETS / name).read_bytes()]
    print(f"{len(differ)} files differ from {ASSETS}: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
