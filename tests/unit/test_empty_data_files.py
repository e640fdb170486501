"""A data file that holds no rows (empty, ``[]``, a CSV header alone) is named, with the format
expected, instead of ``datasets``' bare ``StopIteration`` or "corresponds to no data"."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torchtune import config as tt_config

import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)
from torchtune_ppo.config import instantiate_dataset

CONFIGS = Path(__file__).parents[2] / "recipes/configs/tiny"
# torchtune's text_completion_dataset, and our prompt_dataset (with `field: train`)
SENTIMENT, ARITHMETIC = CONFIGS / "ppo_tiny_sentiment.yaml", CONFIGS / "ppo_tiny_arithmetic.yaml"
JSON_FORMAT = 'A JSON data file holds a list of objects, one per prompt ([{"prompt": "..."}, ...])'


def _dataset(config, path, tmp_path, **keys):
    cfg = OmegaConf.load(config)
    block = cfg.dataset
    block.data_files, block.cache_dir = str(path), str(tmp_path / "hf")
    for key, value in keys.items():
        if value is None:
            block.pop(key, None)
        else:
            block[key] = value
    return instantiate_dataset(block, tt_config.instantiate(cfg.tokenizer))


@pytest.mark.parametrize("text, why", [("", "the file is empty"), ("[]", "an empty JSON list, []"),
                                       ("\n\n", "only whitespace")])
def test_a_json_file_without_rows_is_named(tmp_path, text, why):
    path = tmp_path / "prompts.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        _dataset(SENTIMENT, path, tmp_path)
    message = str(info.value)
    assert message.startswith(f"dataset.data_files: {str(path)!r} holds no rows ({why}). ")
    assert JSON_FORMAT in message


@pytest.mark.parametrize("text, why", [
    ("", "the file is empty"),
    ("[]", "an empty JSON list, []"),
    ('{"train": []}', "an empty list under its field 'train', dataset.field"),
])
def test_a_prompt_dataset_file_without_rows_is_named(tmp_path, text, why):
    path = tmp_path / "problems.json"
    path.write_text(text)
    field = "train" if text.startswith("{") else None
    with pytest.raises(ValueError) as info:
        _dataset(ARITHMETIC, path, tmp_path, field=field)
    message = str(info.value)
    assert message.startswith(f"dataset.data_files: {str(path)!r} holds no rows ({why}). ")
    if field:
        assert 'under dataset.field ({"train": [{"prompt": "..."}, ...]})' in message
    else:
        assert JSON_FORMAT in message


@pytest.mark.parametrize("text, why", [("", "the file is empty"), ("prompt\n", "only a header line")])
def test_a_csv_file_without_rows_is_named(tmp_path, text, why):
    path = tmp_path / "prompts.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        _dataset(SENTIMENT, path, tmp_path, source="csv")
    message = str(info.value)
    assert message.startswith(f"dataset.data_files: {str(path)!r} holds no rows ({why}). ")
    assert "A CSV data file holds a header line naming the columns, then one line per prompt." in message


def test_a_file_with_rows_still_loads(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text('[{"prompt": "It was"}, {"prompt": "The film"}]')
    assert len(_dataset(SENTIMENT, path, tmp_path)) == 2
