"""Builds the chat arithmetic task's problems: ``torchtune_ppo/tasks/chat_arithmetic/assets``.

    python tools/tasks/build_chat_arithmetic.py build [--out DIR]   # problems.json, variants.json, MANIFEST.json
    python tools/tasks/build_chat_arithmetic.py check               # rebuilds in a temp folder, compares

Arithmetic questions for an instruct model in chat form ("What is 17 - 8?"), each with its
answer: sums and differences of a number below 50 and a digit (SmolLM2-135M-Instruct answers
about 4 in 10 of these correctly at the start, 2-digit by 2-digit ones almost never), shuffled
with a fixed seed and split into a training set for PPO and a held-out set that no run trains on
(``problems.json``: ``train`` and ``heldout``).

``variants.json`` holds two more sets, asked in other ways:

- ``ood``: 200 questions for evaluation only, in phrasings no training set uses ("Compute 34 + 7.",
  "What do you get when you subtract 8 from 61?"), two operands of one or two digits (a
  difference is never negative), to be asked with no reply prefix and no system line of the
  task (the chat template's own default); a reply counts by its last number.
- ``train_mixed``: 2000 training questions, a wider distribution than ``train``: the question
  in one of several phrasings (the original one among them, none of the ``ood`` ones), the
  operands in the original range (from ``train``'s problems) or in 0-99, and per question the
  task's system line (``system``) and reply prefix (``prefix``) present or null (read with
  ``prompt_dataset``'s ``system_column`` and ``prefix_column``).

No problem (the two operands and the operation) of ``ood`` is in ``train``, ``heldout`` or
``train_mixed``, and none of ``heldout`` is in ``train_mixed``. The data are plain Python
(``random.Random(seed)``), so a rebuild is byte-identical on any machine.
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
N_OOD, N_TRAIN_MIXED = 200, 2000
SMALL_SHARE = 0.3  # of train_mixed: problems of the original range, taken from `train`
SYSTEM_PROMPT, RESPONSE_PREFIX = "Answer with the number only.", "The answer is"

# Phrasings by operation; {a} and {b} are the operands, the answer a + b or a - b.
OOD_PHRASINGS = {
    "+": ["Compute {a} + {b}.", "Add {a} and {b}.", "What do you get when you add {b} to {a}?",
          "Find the sum of {a} and {b}.", "{a} plus {b} equals what?", "Work out {a} + {b}."],
    "-": ["Compute {a} - {b}.", "What do you get when you subtract {b} from {a}?",
          "Find the difference: {a} minus {b}.", "Take {b} away from {a}. What is left?",
          "{a} minus {b} equals what?", "Work out {a} - {b}."],
}
MIXED_PHRASINGS = {
    "+": ["What is {a} + {b}?", "What is {a} plus {b}?", "Calculate {a} + {b}.", "What is the sum of {a} and {b}?",
          "How much is {a} + {b}?", "{a} + {b} = ?", "Please add {b} to {a}."],
    "-": ["What is {a} - {b}?", "What is {a} minus {b}?", "Calculate {a} - {b}.",
          "What is {b} less than {a}?", "How much is {a} - {b}?", "{a} - {b} = ?", "Subtract {b} from {a}."],
}


def problems(seed: int = SEED):
    """Every ``a + b`` and ``a - b`` with 0 <= a < 50, 0 <= b < 10, shuffled: ``[{"prompt", "answer"}]``."""
    rows = [{"prompt": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)}
            for a in range(50) for b in range(10) for op in "+-"]
    random.Random(seed).shuffle(rows)
    return rows


def _key(a: int, op: str, b: int) -> str:
    """A problem in the original phrasing's form, e.g. ``"61 - 8"``: the ``problem`` column."""
    return f"{a} {op} {b}"


def _answer(a: int, op: str, b: int) -> str:
    return str(a + b if op == "+" else a - b)


def _wide(rng: random.Random):
    """Two operands of one or two digits; a difference's first operand is the larger."""
    a, b, op = rng.randrange(100), rng.randrange(100), rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    return a, op, b


def _parse(prompt: str):
    a, op, b = prompt[len("What is "):-1].split(" ")
    return int(a), op, int(b)


def ood_problems(taken, seed: int = SEED):
    """``N_OOD`` questions ``[{"prompt", "answer", "problem"}]`` of distinct problems outside ``taken``."""
    rng, rows, seen = random.Random(seed + 1), [], set(taken)
    while len(rows) < N_OOD:
        a, op, b = _wide(rng)
        if _key(a, op, b) in seen:
            continue
        seen.add(_key(a, op, b))
        rows.append({"prompt": rng.choice(OOD_PHRASINGS[op]).format(a=a, b=b), "answer": _answer(a, op, b),
                     "problem": _key(a, op, b)})
    return rows


def mixed_problems(train, taken, seed: int = SEED):
    """``N_TRAIN_MIXED`` questions ``[{"prompt", "answer", "problem", "system", "prefix"}]`` of distinct
    problems outside ``taken``: a ``SMALL_SHARE`` of them ``train``'s problems, the rest of one or
    two digits each; each in a phrasing of ``MIXED_PHRASINGS``, with the system line and the reply
    prefix each present or null (even odds)."""
    rng = random.Random(seed + 2)
    n_small = round(N_TRAIN_MIXED * SMALL_SHARE)
    chosen = [_parse(r["prompt"]) for r in rng.sample(train, n_small)]
    seen = set(taken) | {_key(*p) for p in chosen}
    while len(chosen) < N_TRAIN_MIXED:
        a, op, b = _wide(rng)
        if _key(a, op, b) not in seen:
            seen.add(_key(a, op, b))
            chosen.append((a, op, b))
    rng.shuffle(chosen)
    rows = []
    for a, op, b in chosen:
        rows.append({"prompt": rng.choice(MIXED_PHRASINGS[op]).format(a=a, b=b), "answer": _answer(a, op, b),
                     "problem": _key(a, op, b), "system": SYSTEM_PROMPT if rng.random() < 0.5 else None,
                     "prefix": RESPONSE_PREFIX if rng.random() < 0.5 else None})
    return rows


def build(out: Path) -> None:
    rows = problems()
    split = {"train": rows[:N_TRAIN], "heldout": rows[N_TRAIN:N_TRAIN + N_HELDOUT]}
    train_keys = {_key(*_parse(r["prompt"])) for r in split["train"]}
    heldout_keys = {_key(*_parse(r["prompt"])) for r in split["heldout"]}
    ood = ood_problems(train_keys | heldout_keys)
    ood_keys = {r["problem"] for r in ood}
    variants = {"ood": ood, "train_mixed": mixed_problems(split["train"], heldout_keys | ood_keys)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "problems.json").write_text(json.dumps(split, indent=0) + "\n")
    (out / "variants.json").write_text(json.dumps(variants, indent=0) + "\n")
    manifest = {"seed": SEED, "n_train": N_TRAIN, "n_heldout": N_HELDOUT, "n_ood": N_OOD,
                "n_train_mixed": N_TRAIN_MIXED,
                "sha256": {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                           for name in ("problems.json", "variants.json")}}
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
        differ = [name for name in ("problems.json", "variants.json", "MANIFEST.json")
                  if (Path(tmp) / name).read_bytes() != (ASSETS / name).read_bytes()]
    print(f"{len(differ)} files differ from {ASSETS}: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
