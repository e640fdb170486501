"""``--config <value>``: a file at that path in the current folder (``.yaml`` optional) comes
before a shipped config of the same name, and the run says which file it used."""

import logging
import os

import pytest

from torchtune_ppo import cli

TINY = "tiny/ppo_tiny_sentiment"


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def _config_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Config: ")]


@pytest.mark.parametrize("value", [TINY, TINY + ".yaml"])
def test_a_file_here_wins_over_the_shipped_config_of_that_name(here, caplog, value):
    local = here / "tiny" / "ppo_tiny_sentiment.yaml"
    local.parent.mkdir()
    local.write_text("x: 1\n")
    with caplog.at_level(logging.INFO):
        argv = cli.resolve_config_arg(["r", "--config", value, "a=1"])
    assert os.path.samefile(argv[2], local) and argv[3:] == ["a=1"]
    (line,) = _config_lines(caplog)
    assert line.startswith(f"Config: {local} ") and f"not the shipped config {TINY}" in line


@pytest.mark.parametrize("value", [TINY, TINY + ".yaml"])
def test_a_shipped_name_runs_the_shipped_config_and_says_so(here, caplog, value):
    shipped = cli.shipped_configs()[TINY]
    with caplog.at_level(logging.INFO):
        argv = cli.resolve_config_arg(["r", f"--config={value}"])
    assert argv == ["r", f"--config={shipped}"]
    assert _config_lines(caplog) == [f"Config: {os.path.abspath(shipped)} (shipped config {TINY})"]


def test_a_file_of_another_name_is_logged_with_its_absolute_path(here, caplog):
    (here / "my_run.yaml").write_text("x: 1\n")
    with caplog.at_level(logging.INFO):
        assert cli.resolve_config_arg(["r", "--config", "my_run"])[2] == "my_run.yaml"
    assert _config_lines(caplog) == [f"Config: {here / 'my_run.yaml'}"]


def test_only_rank_0_says_which_config(here, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO):
        cli.resolve_config_arg(["r", "--config", TINY])
    assert _config_lines(caplog) == []
