"""The overrides a refused resume suggests can be pasted into a shell as printed: the shell and
torchtune's command-line parser give back the saved values, lists and mappings included."""

import math
import shlex
import sys

import pytest
from omegaconf import OmegaConf
from torchtune import config as tt_config

from torchtune_ppo.checkpointing import resume_config as rc

SAVED_MODEL = {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
               "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 8, "lora_alpha": 16.0}
SAVED = {"seed": 0, "batch_size": 8, "output_dir": "/a", "resume_from_checkpoint": False,
         "policy_model": SAVED_MODEL,
         "dataset": {"_component_": "d", "data_files": ["a b.json", "it's.json", "${x}.json"]}}


def _through_torchtune(tmp_path, monkeypatch, overrides):
    """The config torchtune's ``config.parse`` makes of ``overrides`` on a command line."""
    base = tmp_path / "base.yaml"
    base.write_text("seed: 0\n")
    monkeypatch.setattr(sys, "argv", ["recipe", "--config", str(base), *overrides])
    recipe = tt_config.parse(lambda cfg: cfg)
    with pytest.raises(SystemExit) as done:  # config.parse ends with sys.exit(recipe(cfg))
        recipe()
    return OmegaConf.to_container(done.value.code, resolve=True)


def _same(a, b):
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("value", [
    ["q_proj", "v_proj"], [], ["a b", "c,d", "it's", 'say "x"', "$HOME", "*", "None", "true", "1e-5", ""],
    {"a": 1, "b": [2.5, None, True]}, [["nested", 1], {"k": "v"}],
    "torchtune.models.llama3_2.llama3_2_1b", "/data/p q.json", "${x}", "None", "0003",
    8, 1e-05, float("nan"), float("-inf"), None, False,
])
def test_a_printed_override_pasted_in_a_shell_gives_back_the_value(tmp_path, monkeypatch, value):
    printed = rc.cli_override("policy_model.lora_attn_modules", value)
    (token,) = shlex.split(printed)  # one shell word, whatever the value holds
    key, text = token.split("=", 1)
    # torchtune splits an override at every "=": the value must hold none.
    assert key == "policy_model.lora_attn_modules" and "=" not in text
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([token]), resolve=True)
    assert _same(parsed["policy_model"]["lora_attn_modules"], value), printed
    via_torchtune = _through_torchtune(tmp_path, monkeypatch, shlex.split(printed))
    assert _same(via_torchtune["policy_model"]["lora_attn_modules"], value), printed


def test_the_refused_resume_prints_overrides_that_give_back_the_saved_lists(tmp_path, monkeypatch):
    folder = tmp_path / "step_2"
    folder.mkdir()
    (folder / rc.CONFIG_FNAME).write_text(OmegaConf.to_yaml(OmegaConf.create(SAVED)))
    new = {**SAVED, "output_dir": "/a", "resume_from_checkpoint": True,
           "policy_model": {**SAVED_MODEL, "lora_attn_modules": ["q_proj", "k_proj", "v_proj"]},
           "dataset": {"_component_": "d", "data_files": ["b.json"]}}
    with pytest.raises(rc.ResumeConfigError) as err:
        rc.check_resume_config(folder, new)
    lines = str(err.value).splitlines()
    suggested = lines[lines.index(next(l for l in lines if "overrides on the command line" in l)) + 1]
    overrides = shlex.split(suggested)
    assert sorted(o.split("=", 1)[0] for o in overrides) == ["dataset.data_files", "policy_model.lora_attn_modules"]
    parsed = _through_torchtune(tmp_path, monkeypatch, overrides)
    assert parsed["policy_model"]["lora_attn_modules"] == SAVED_MODEL["lora_attn_modules"]
    assert parsed["dataset"]["data_files"] == SAVED["dataset"]["data_files"]
