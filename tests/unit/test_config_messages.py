"""Messages of config validation that name the key and what would be valid: ``turns.cache_tokens``
below the responses, a ``_component_`` whose module does not exist (one resolver of dotted paths
for the config checks, the checkpointers and ``from_path``), and a ``+key=value`` override."""

import re

import pytest
from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo import rewards
from torchtune_ppo.config import checks, components, validate_config
from torchtune_ppo.config.checks import check_cli_overrides

from conftest import TINY_CONFIG

TOOLS = TINY_CONFIG.parent / "ppo_tiny_tools.yaml"


def _cfg(config=TINY_CONFIG, *overrides):
    return OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist(list(overrides)))


# ---- turns.cache_tokens --------------------------------------------------------------------


def test_cache_tokens_below_max_generated_tokens_is_refused_by_name_before_any_model_loads():
    with pytest.raises(ValueError, match=re.escape(
            "turns.cache_tokens must be null (2 * max_generated_tokens = 48) or an integer >= "
            "max_generated_tokens (24), got 1")):
        validate_config(_cfg(TOOLS, "max_generated_tokens=24", "turns.cache_tokens=1"), check_machine=False)
    # the smallest valid value, and null, pass
    assert validate_config(_cfg(TOOLS, "max_generated_tokens=24", "turns.cache_tokens=24"),
                           check_machine=False).turns.cache_tokens == 24
    assert validate_config(_cfg(TOOLS, "max_generated_tokens=24"), check_machine=False).turns.cache_tokens is None


# ---- a _component_ that does not import ----------------------------------------------------


def test_a_component_whose_package_does_not_exist_is_named_with_its_key():
    with pytest.raises(ValueError, match=re.escape(
            "env._component_: cannot import 'torchtune_ppo_envs.Calculator': no module named "
            "'torchtune_ppo_envs' is installed here. Did you mean 'torchtune_ppo'")):
        validate_config(_cfg(TOOLS, "env._component_=torchtune_ppo_envs.Calculator"))


def test_a_component_whose_module_does_not_exist_names_the_closest_module():
    with pytest.raises(ValueError, match=re.escape(
            "env._component_: cannot import 'torchtune_ppo.envs.calculater.Calculator': torchtune_ppo.envs has "
            "no 'calculater'. Did you mean 'torchtune_ppo.envs.calculator'")):
        validate_config(_cfg(TOOLS, "env._component_=torchtune_ppo.envs.calculater.Calculator"))


def test_a_package_missing_here_is_left_alone_for_a_run_planned_elsewhere():
    # validate_config(check_machine=False) plans a run for another machine, which may have it
    cfg = validate_config(_cfg(TINY_CONFIG, "optimizer._component_=not_installed_here.optim.Adam"),
                          check_machine=False)
    assert cfg.optimizer._component_ == "not_installed_here.optim.Adam"


def test_a_module_that_fails_to_import_shows_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "broken_env_module.py").write_text("raise RuntimeError('no licence file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=re.escape(
            "env._component_: importing 'broken_env_module.Env' failed: RuntimeError: no licence file")):
        validate_config(_cfg(TOOLS, "env._component_=broken_env_module.Env"))


class Holder:
    @staticmethod
    def length(prompts, responses, **kwargs):
        return [float(len(r)) for r in responses]


def test_one_resolver_reads_every_dotted_path(monkeypatch):
    assert checks.import_component is components.import_component
    original, seen = components.import_component, []

    def spy(path, key, **kwargs):
        seen.append((path, key))
        return original(path, key, **kwargs)

    monkeypatch.setattr(components, "import_component", spy)
    assert rewards.from_path(f"{__name__}.Holder.length") is Holder.length  # an attribute chain
    assert seen == [(f"{__name__}.Holder.length", "from_path's path")]
    with pytest.raises(ValueError, match=re.escape(
            "from_path's path: cannot import 'torchtune_ppo.rewards.ExactMatc': torchtune_ppo.rewards has no "
            "'ExactMatc'. Did you mean 'torchtune_ppo.rewards.ExactMatch'")):
        rewards.from_path("torchtune_ppo.rewards.ExactMatc")


def test_a_path_without_a_dot_is_refused_by_its_key():
    with pytest.raises(ValueError, match=re.escape(
            "reward._component_ must be a dotted import path (package.module.name), got 'ExactMatch' (a string).")):
        components.import_component("ExactMatch", "reward._component_")


# ---- +key=value ----------------------------------------------------------------------------


def test_a_plus_override_on_the_command_line_says_to_drop_the_plus():
    with pytest.raises(ValueError) as info:
        check_cli_overrides(["--config", "x.yaml", "+eval.every_n_steps=2", "seed=1"])
    message = str(info.value)
    assert message.startswith("+eval.every_n_steps: torchtune's command line takes key=value, with no '+'")
    assert "write eval.every_n_steps=<value>" in message


def test_a_plus_key_in_the_config_is_named_without_the_plus():
    # what OmegaConf makes of `+eval.every_n_steps=2`: a key named '+eval'
    with pytest.raises(ValueError) as info:
        validate_config(_cfg(TINY_CONFIG, "+eval.every_n_steps=2"), check_machine=False)
    message = str(info.value)
    assert message.startswith("+eval.every_n_steps: torchtune's command line takes key=value, with no '+'")
    assert "write eval.every_n_steps=<value>" in message and "unknown config key" not in message
    with pytest.raises(ValueError, match=re.escape("and 'evals' is not a config key either (valid keys: [")):
        check_cli_overrides(["+evals.every_n_steps=2"])
