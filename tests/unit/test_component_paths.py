"""Every ``_component_`` path that a shipped config, the README or a docs page names resolves through
torchtune's own lookup, with no deprecation warning; the paths that shipped before this
release still resolve, with a FutureWarning, to the same objects."""

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path

import torchtune_ppo.rewards

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "recipes" / "configs").rglob("*.yaml"))
# `_component_: a.b.c` in YAML, in flow mappings ({_component_: a.b.c, ...}) and in comments.
_COMPONENT = re.compile(r"_component_\s*:\s*['\"]?([A-Za-z_][\w.]*)")


def _named_paths():
    found = {}
    for f in CONFIGS + [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        for m in _COMPONENT.finditer(f.read_text()):
            found.setdefault(m.group(1), str(f.relative_to(ROOT)))
    return found


PATHS = _named_paths()

# Old path -> the path that replaces it. The datasets alias lives in torchtune_ppo/__init__.py,
# the reward factories' in torchtune_ppo/rewards/__init__.py.
OLD_PATHS = {
    "torchtune_ppo.datasets.prompt_dataset": "torchtune_ppo.data.prompt_dataset",
    "torchtune_ppo.rewards.exact_match": "torchtune_ppo.rewards.ExactMatch",
    "torchtune_ppo.rewards.format_match": "torchtune_ppo.rewards.FormatMatch",
    "torchtune_ppo.rewards.weighted_sum": "torchtune_ppo.rewards.WeightedSum",
}
# What each warning must name: the replacement (for a moved module, the module).
REPLACEMENT_NAMED = {**OLD_PATHS, "torchtune_ppo.datasets.prompt_dataset": "moved to torchtune_ppo.data;"}


def test_the_files_name_components():
    assert len(CONFIGS) >= 6, CONFIGS
    assert {"torchtune_ppo.rewards.ExactMatch", "torchtune_ppo.data.prompt_dataset",
            "torchtune_ppo.models.ClassifierHFCheckpointer"} <= set(PATHS)
    assert not set(OLD_PATHS) & set(PATHS), "a shipped file still names a deprecated path"


@pytest.mark.parametrize("path", sorted(PATHS), ids=sorted(PATHS))
def test_shipped_path_resolves(path):
    top = path.split(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{top} is not installed here ({PATHS[path]} names {path})")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # shipped files name current paths only
        obj = _get_component_from_path(path)
    assert callable(obj), f"{PATHS[path]}: {path} is {obj!r}"


def _forget_alias(monkeypatch, old):
    """Undo an earlier resolution's caching, so that this one reaches the module __getattr__."""
    module, _, name = old.rpartition(".")
    if module == "torchtune_ppo.rewards":
        monkeypatch.delitem(vars(torchtune_ppo.rewards), name, raising=False)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_resolves_with_a_future_warning(old, monkeypatch):
    new = OLD_PATHS[old]
    _forget_alias(monkeypatch, old)
    with pytest.warns(FutureWarning, match=re.escape(REPLACEMENT_NAMED[old])) as record:
        obj = _get_component_from_path(old)
    assert obj is _get_component_from_path(new)
    if old.startswith("torchtune_ppo.rewards."):
        assert len(record) == 1 and new in str(record[0].message)
        with warnings.catch_warnings():  # warned once: the next lookup is a plain attribute
            warnings.simplefilter("error", FutureWarning)
            assert _get_component_from_path(old) is obj


PROMPTS = ["1+1=", "2+2=", "3-5=", "9+9="]
RESPONSES = ["2", "the answer is 4", "2", "x"]
REFERENCES = ["2", "4", "-2", "18"]


@pytest.mark.parametrize("old_block", [
    {"_component_": "torchtune_ppo.rewards.exact_match", "extract": "last_number"},
    {"_component_": "torchtune_ppo.rewards.exact_match", "extract": "after_marker", "marker": "is",
     "reward": 2.0, "penalty": -1.0},
    {"_component_": "torchtune_ppo.rewards.format_match", "pattern": r"^-?\d+$"},
    {"_component_": "torchtune_ppo.rewards.weighted_sum", "weights": [1.0, 0.5], "rewards": [
        {"_component_": "torchtune_ppo.rewards.exact_match"},
        {"_component_": "torchtune_ppo.rewards.format_match", "pattern": r"^-?\d+$", "fullmatch": True}]},
], ids=["exact_match", "exact_match_marker", "format_match", "weighted_sum"])
def test_old_reward_path_builds_the_same_reward(old_block):
    def renamed(block):
        if isinstance(block, dict):
            return {k: OLD_PATHS.get(v, v) if k == "_component_" else renamed(v) for k, v in block.items()}
        return [renamed(b) for b in block] if isinstance(block, list) else block

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old = config.instantiate(OmegaConf.create(old_block))
    new = config.instantiate(OmegaConf.create(renamed(old_block)))
    assert type(old) is type(new) and repr(old) == repr(new)

    def score(fn):
        return fn(PROMPTS, RESPONSES, references=REFERENCES, prompt_tokens=[[]] * 4, response_tokens=[[]] * 4)

    assert score(old) == score(new)
    assert len(set(score(new))) > 1  # the batch tells a right answer from a wrong one
