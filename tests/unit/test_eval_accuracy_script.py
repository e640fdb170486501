"""The accuracy script (benchmarks/tasks/chat_arithmetic_accuracy.py) agrees with the run's own
evaluation: on the checkpoint a tiny run saved after its last step, the script's greedy accuracy
on each evaluation set is the run's last logged ``val/<set>/pass@1``.

The run is the tiny arithmetic config in this process, 2 steps, evaluating two sets side by side
(the held-out problems, and the first training problems under another name); the script reads
the ``config.yaml`` saved beside the policy, builds the config's tokenizer and policy, and
generates, decodes and grades on its own (the reward of the text before the stop token, the
run's penalties).
"""

import importlib.util
import json
from pathlib import Path

import pytest

from torchtune_ppo.run.logs import read_eval_log

from conftest import ROOT

SEEN = {"_component_": "torchtune_ppo.data.prompt_dataset", "source": "json", "split": "train",
        "data_files": "${ppo_asset:tiny_arithmetic/problems.json}", "field": "train"}


def _script():
    spec = importlib.util.spec_from_file_location("chat_arithmetic_accuracy",
                                                  ROOT / "benchmarks/tasks/chat_arithmetic_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ppo_full_finetune import PPOFullFinetuneRecipe

    from conftest import recipe_config

    out = tmp_path_factory.mktemp("script") / "run"
    cfg = recipe_config(out, "ppo_tiny_arithmetic.yaml", num_ppo_steps=2, save_every_n_steps="null",
                        **{"eval.every_n_steps": 2, "eval.max_prompts": 48, "eval.batch_size": 16,
                           "eval.best_metric": "val/heldout/pass@1", "eval.datasets.heldout": "null",
                           **{f"eval.datasets.seen.{k}": v for k, v in SEEN.items()}})
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("split", ["heldout", "seen"])
def test_the_script_reports_the_runs_last_pass_at_1(run, split, capsys):
    evals = read_eval_log(run / "logs")
    assert [step for step, _ in evals] == [0, 2]
    logged = evals[-1][1][f"val/{split}/pass@1"]
    assert 0 < logged < 1  # a count the script can miss either way
    assert _script().main([str(run / "checkpoints/step_2/policy"), "--split", split, "--batch-size", "16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["split"] == split and report["problems"] == 48 and report["max_tokens"] == 8
    assert report["correct"] / report["problems"] == logged


@pytest.mark.slow
def test_the_script_names_the_sets_it_can_grade(run, capsys):
    with pytest.raises(SystemExit):
        _script().main([str(run / "checkpoints/step_2/policy"), "--split", "ood"])
    assert "evaluates ['heldout', 'seen']" in capsys.readouterr().err


def test_the_sets_of_a_config_by_name(tmp_path):
    from omegaconf import OmegaConf

    script = _script()
    shipped = OmegaConf.load(script.CONFIG)
    sets = script.eval_sets(shipped)
    assert list(sets) == ["heldout", "ood"]
    assert sets["heldout"].field == "heldout" and sets["heldout"].response_prefix == "The answer is"
    assert sets["ood"].field == "ood" and "response_prefix" not in sets["ood"] and "system_prompt" not in sets["ood"]
    # a config of one unnamed set (eval.dataset, or its default) grades it as `heldout`
    one = OmegaConf.merge(shipped, {"eval": {"datasets": None}})
    assert list(script.eval_sets(one)) == ["heldout"] and script.eval_sets(one)["heldout"].field == "heldout"
