"""The chat arithmetic task's data: the builder rebuilds the shipped files byte for byte (so
``train`` stays what recorded runs trained on), the out-of-distribution set and the wider
training set are what they say, and ``prompt_dataset`` asks each row as its own columns say."""

import json
import re
import sys
from pathlib import Path

import pytest

import torchtune_ppo
from torchtune_ppo.data.datasets import prompt_dataset

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools/tasks"))
import build_chat_arithmetic as build  # noqa: E402

ASSETS = Path(torchtune_ppo.asset_path("chat_arithmetic"))
PROBLEMS = json.loads((ASSETS / "problems.json").read_text())
VARIANTS = json.loads((ASSETS / "variants.json").read_text())
# The sha256 of problems.json that the shipped SmolLM2 runs trained on: never to change.
PROBLEMS_SHA256 = "66f1b669ac2711ac45e50036768420f1d546a74c02ebb08986677006a8d9ffb5"


def _problem(prompt: str) -> str:
    a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", prompt).groups()
    return f"{a} {op} {b}"


def test_the_builder_rebuilds_the_shipped_files_and_problems_json_is_unchanged(tmp_path):
    build.build(tmp_path)
    for name in ("problems.json", "variants.json", "MANIFEST.json"):
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), name
    manifest = json.loads((ASSETS / "MANIFEST.json").read_text())
    assert manifest["sha256"]["problems.json"] == PROBLEMS_SHA256
    import hashlib

    for name, sha in manifest["sha256"].items():
        assert hashlib.sha256((ASSETS / name).read_bytes()).hexdigest() == sha, name
    assert (len(PROBLEMS["train"]), len(PROBLEMS["heldout"])) == (manifest["n_train"], manifest["n_heldout"]) == (800, 200)


def test_the_ood_set_is_other_phrasings_of_unseen_problems_of_two_operands_below_100():
    ood, mixed = VARIANTS["ood"], VARIANTS["train_mixed"]
    assert len(ood) == build.N_OOD == 200 and len({r["problem"] for r in ood}) == 200
    seen = {_problem(r["prompt"]) for r in PROBLEMS["train"] + PROBLEMS["heldout"]} | {r["problem"] for r in mixed}
    assert not seen & {r["problem"] for r in ood}
    templates = [re.escape(t).replace(r"\{a\}", "(?P<a>\\d+)").replace(r"\{b\}", "(?P<b>\\d+)")
                 for op in "+-" for t in build.OOD_PHRASINGS[op]]
    for r in ood:
        assert set(r) == {"prompt", "answer", "problem"}
        a, op, b = r["problem"].split()
        assert 0 <= int(a) < 100 and 0 <= int(b) < 100 and int(r["answer"]) == eval(r["problem"]) >= 0
        match = next(m for m in (re.fullmatch(t, r["prompt"]) for t in templates) if m)
        assert (match["a"], match["b"]) == (a, b)  # the operands where the phrasing puts them
    assert not r["prompt"].startswith("What is ")
    # no phrasing of the ood set is trained on
    assert not set(build.OOD_PHRASINGS["+"] + build.OOD_PHRASINGS["-"]) & set(
        build.MIXED_PHRASINGS["+"] + build.MIXED_PHRASINGS["-"])


def test_the_mixed_training_set_widens_train_and_leaves_the_held_out_problems_out():
    mixed = VARIANTS["train_mixed"]
    assert len(mixed) == build.N_TRAIN_MIXED and len({r["problem"] for r in mixed}) == len(mixed)
    heldout = {_problem(r["prompt"]) for r in PROBLEMS["heldout"]}
    assert not heldout & {r["problem"] for r in mixed}
    assert all(int(r["answer"]) == eval(r["problem"]) for r in mixed)
    assert {r["system"] for r in mixed} == {None, build.SYSTEM_PROMPT}
    assert {r["prefix"] for r in mixed} == {None, build.RESPONSE_PREFIX}
    small = sum(int(r["problem"].split()[0]) < 50 and int(r["problem"].split()[2]) < 10 for r in mixed)
    assert 0.3 <= small / len(mixed) < 0.4  # the original range, and mostly wider problems
    assert sum(r["prompt"].startswith("What is ") and r["prompt"].count(" ") == 4 for r in mixed) > 100


class _ChatTokenizer:
    """A character tokenizer with a torchtune-style ``tokenize_messages`` (one role letter, then the text)."""

    def encode(self, text, add_bos=True, add_eos=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def tokenize_messages(self, messages, add_eos=False):
        return [t for m in messages for t in [ord(m.role[0].upper())] + self.encode(m.text_content)], None


def test_each_row_is_asked_with_its_own_system_line_and_reply_prefix(tmp_path):
    rows = [{"prompt": "q0", "answer": "0", "system": None, "prefix": None},
            {"prompt": "q1", "answer": "1", "system": "S", "prefix": ""},
            {"prompt": "q2", "answer": "2", "system": None, "prefix": "P"}]
    data = tmp_path / "rows.json"
    data.write_text(json.dumps({"train": rows}))
    tok = _ChatTokenizer()
    ds = prompt_dataset(tok, "json", data_files=str(data), field="train", chat=True, system_prompt="D",
                        response_prefix="R", system_column="system", prefix_column="prefix")
    # null: the block's setting; a value: the row's; an empty prefix: none
    assert [tok.decode(ds[i]["tokens"]) for i in range(3)] == ["SDUq0AR", "SSUq1A", "SDUq2AP"]
    plain = prompt_dataset(tok, "json", data_files=str(data), field="train", chat=True, system_prompt="D",
                           response_prefix="R")
    assert [tok.decode(plain[i]["tokens"]) for i in range(3)] == ["SDUq0AR", "SDUq1AR", "SDUq2AR"]
    with pytest.raises(ValueError, match=r"system_column='sys' is not a column of .*\['prompt', 'answer', 'system', "):
        prompt_dataset(tok, "json", data_files=str(data), field="train", chat=True, system_column="sys")
    with pytest.raises(ValueError, match="prefix_column is used only with chat=True"):
        prompt_dataset(tok, "json", data_files=str(data), field="train", prefix_column="prefix")
