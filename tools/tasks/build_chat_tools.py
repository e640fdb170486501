"""Builds the chat tools task's problems: ``torchtune_ppo/tasks/chat_tools/assets``.

    python tools/tasks/build_chat_tools.py build [--out DIR]   # problems.json, MANIFEST.json
    python tools/tasks/build_chat_tools.py check               # rebuilds in a temp folder, compares

Arithmetic that an instruct model of 135M parameters cannot do in its head, for multi-turn
rollouts with the calculator (``torchtune_ppo.envs.Calculator``): products of a 2-3 digit
number by a 2-3 digit number ("What is 347 * 29?") and sums of three 3-4 digit numbers
("What is 1234 + 567 + 8901?"), half of each, each with its exact answer and a system line that
explains the tool. ``problems.json`` holds ``train`` (800 problems for PPO) and ``heldout``
(200 that no run trains on), disjoint; records ``{"prompt", "answer", "system"}``.

The data are plain Python (``random.Random(seed)``), so a rebuild is byte-identical on any machine.
"""

import argparse
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "torchtune_ppo" / "tasks" / "chat_tools" / "assets"
SEED, N_TRAIN, N_HELDOUT = 0, 800, 200
SYSTEM_PROMPT = ("You can use a calculator: write the expression between <calc> and </calc>, like <calc>12 * 34</calc>. "
                 "The result comes back in the next message. Then give the final answer as a number.")
FILES = ("problems.json", "MANIFEST.json")


def _problem(rng: random.Random):
    """``(operands, op)``: two factors of 10-999, or three terms of 100-9999."""
    if rng.random() < 0.5:
        return (rng.randint(10, 999), rng.randint(10, 999)), "*"
    return (rng.randint(100, 9999), rng.randint(100, 9999), rng.randint(100, 9999)), "+"


def problems(seed: int = SEED):
    """``N_TRAIN + N_HELDOUT`` distinct problems ``[{"prompt", "answer", "system"}]``."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < N_TRAIN + N_HELDOUT:
        operands, op = _problem(rng)
        expression = f" {op} ".join(str(x) for x in operands)
        if expression in seen:
            continue
        seen.add(expression)
        value = operands[0] * operands[1] if op == "*" else sum(operands)
        rows.append({"prompt": f"What is {expression}?", "answer": str(value), "system": SYSTEM_PROMPT})
    return rows


def build(out: Path, seed: int = SEED) -> None:
    rows = problems(seed)
    split = {"train": rows[:N_TRAIN], "heldout": rows[N_TRAIN:]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "problems.json").write_text(json.dumps(split, indent=0) + "\n")
    manifest = {"seed": seed, "n_train": N_TRAIN, "n_heldout": N_HELDOUT,
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
        differ = [name for name in FILES if (Path(tmp) / name).read_bytes() != (ASSETS / name).read_bytes()]
    print(f"{len(differ)} files differ from {ASSETS}: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
