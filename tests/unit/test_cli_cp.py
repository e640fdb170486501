"""``tune-ppo cp``: the destination name as given, no file overwritten without ``--force``, and
one line naming the path when the destination folder cannot be written."""

import os
import stat

import pytest

from torchtune_ppo import cli

TINY = "tiny/ppo_tiny_sentiment"


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _shipped() -> bytes:
    return cli.shipped_configs()[TINY].read_bytes()


def _refused(capsys, *argv) -> str:
    """The one-line error of a refused ``tune-ppo cp`` (a non-zero exit, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["cp", *argv])
    code = stop.value.code
    # A message given to SystemExit is printed to stderr by Python itself, with status 1.
    message = code if isinstance(code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert code not in (0, None), message
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_dot_in_the_name_is_kept_and_another_file_is_left_alone(here, capsys):
    (here / "exp.yaml").write_text("keep\n")
    cli.main(["cp", TINY, "exp.lr3e-4"])
    assert (here / "exp.lr3e-4.yaml").read_bytes() == _shipped()
    assert (here / "exp.yaml").read_text() == "keep\n"
    assert "--config exp.lr3e-4.yaml" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["mine.yaml", "mine.yml"])
def test_a_yaml_or_yml_name_is_used_as_given(here, given):
    cli.main(["cp", TINY, given])
    assert sorted(p.name for p in here.iterdir()) == [given]


def test_an_existing_file_is_refused_by_name_without_force(here, capsys):
    (here / "exp.yaml").write_text("keep\n")
    for dest in ("exp", "exp.yaml"):
        message = _refused(capsys, TINY, dest)
        assert str(here / "exp.yaml") in message and "--force" in message
    assert (here / "exp.yaml").read_text() == "keep\n"
    cli.main(["cp", TINY, "exp", "--force"])
    assert (here / "exp.yaml").read_bytes() == _shipped()


def test_no_clobber_leaves_an_existing_file_and_exits_0(here, capsys):
    (here / "exp.yaml").write_text("keep\n")
    cli.main(["cp", TINY, "exp.yaml", "-n"])
    assert (here / "exp.yaml").read_text() == "keep\n"
    assert "not overwriting" in capsys.readouterr().out


def test_copy_into_a_folder_keeps_the_shipped_name_and_refuses_a_second_copy(here, capsys):
    (here / "sub").mkdir()
    cli.main(["cp", TINY, "sub"])
    cli.main(["cp", TINY])  # the current folder
    for path in (here / "sub" / "ppo_tiny_sentiment.yaml", here / "ppo_tiny_sentiment.yaml"):
        assert path.read_bytes() == _shipped()
    path.write_text("edited\n")
    message = _refused(capsys, TINY, ".")
    assert str(path) in message and "--force" in message
    assert path.read_text() == "edited\n"


def test_the_recipe_copy_is_not_overwritten_without_force_and_keeps_its_name(here, capsys):
    cli.main(["cp", "ppo_full_finetune", "."])
    recipe = (here / cli.RECIPE_COPY).read_bytes()
    (here / cli.RECIPE_COPY).write_text("edited\n")
    assert "--force" in _refused(capsys, "ppo_full_finetune", cli.RECIPE_COPY)
    cli.main(["cp", "ppo_full_finetune", "my_ppo", "--force"])
    assert (here / cli.RECIPE_COPY).read_bytes() == recipe
    # `tune run my.v2.py` would import the module `my.v2`, the package `my`: refused.
    assert "my_v2.py" in _refused(capsys, "ppo_full_finetune", "my.v2")
    assert not (here / "my.v2.py").exists()


def test_a_missing_folder_is_named_in_one_line(here, capsys):
    message = _refused(capsys, TINY, "nope/exp")
    assert str(here / "nope" / "exp.yaml") in message and "No such file or directory" in message
    assert "--make-parents" in message
    cli.main(["cp", TINY, "nope/exp", "--make-parents"])
    assert (here / "nope" / "exp.yaml").read_bytes() == _shipped()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_a_read_only_folder_is_named_in_one_line(here, capsys):
    (here / "ro").mkdir()
    (here / "ro").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        message = _refused(capsys, TINY, "ro/exp")
    finally:
        (here / "ro").chmod(stat.S_IRWXU)
    assert str(here / "ro" / "exp.yaml") in message and "Permission denied" in message
