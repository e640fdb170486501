"""The package as a user who installs it (not a clone) gets it: the shipped configs.

The configs of ``recipes/configs`` install as the package data ``torchtune_ppo.configs``;
``tune-ppo ls|cp`` lists and copies them and the recipe's ``--config <name>`` runs one by name
(``torchtune_ppo/cli.py``). The fast tests check the pieces in this checkout; the slow one
builds the wheel, installs it into a fresh virtual environment and uses it from an empty
folder outside the repository.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from torchtune_ppo import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny/ppo_tiny_sentiment"


def test_pyproject_packages_list_every_folder_with_code():
    """`packages` is an explicit list (a package mapped onto recipes/configs cannot be found by
    `packages.find`): a new folder of torchtune_ppo with a .py file must be added to it, or the
    wheel installs without it."""
    tomllib = pytest.importorskip("tomllib")
    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    code = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "torchtune_ppo").rglob("*.py")
            if "__pycache__" not in p.parts}
    assert not code - listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(code - listed)}"
    assert setuptools_cfg["package-dir"]["torchtune_ppo.configs"] == "recipes/configs"
    stale = {p for p in listed - {"torchtune_ppo.configs"} if not (ROOT / p.replace(".", "/")).is_dir()}
    assert not stale, f"listed in pyproject.toml but no such folder: {sorted(stale)}"


def test_every_shipped_config_is_listed_with_a_description():
    shipped = cli.shipped_configs()
    on_disk = {str(p.relative_to(ROOT / "recipes" / "configs").with_suffix("")).replace(os.sep, "/")
               for p in (ROOT / "recipes" / "configs").rglob("*.yaml")}
    assert set(shipped) == on_disk
    for name, entry in shipped.items():
        text = cli.description(entry.read_text(encoding="utf-8"))
        assert text and "\n" not in text and len(text) <= 140, (name, text)


def test_shipped_names_do_not_collide_with_torchtune_configs():
    """`tune run` swaps a --config value that names one of torchtune's own configs for that
    file before the recipe sees it, so a shipped name equal to one would never reach ours."""
    from torchtune._recipe_registry import get_all_recipes

    theirs = {c.name for r in get_all_recipes() for c in r.configs}
    assert not theirs & {n for name in cli.shipped_configs() for n in (name, name + ".yaml")}


def test_resolve_config_arg(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = cli.shipped_configs()[TINY]
    for value in (TINY, TINY + ".yaml", f"recipes/configs/{TINY}.yaml"):
        assert cli.resolve_config_arg(["r", "--config", value, "a=1"]) == ["r", "--config", str(tiny), "a=1"]
        assert cli.resolve_config_arg(["r", f"--config={value}"]) == ["r", f"--config={tiny}"]
    # A file of that name in the current folder comes first.
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "ppo_tiny_sentiment.yaml").write_text("x: 1\n")
    assert cli.resolve_config_arg(["r", "--config", TINY + ".yaml"])[2] == TINY + ".yaml"
    assert cli.resolve_config_arg(["r", "a=1"]) == ["r", "a=1"]
    with pytest.raises(SystemExit) as stop:
        cli.resolve_config_arg(["r", "--config", "tiny/nope"])
    message = str(stop.value.code)
    assert "'tiny/nope'" in message and all(name in message for name in cli.shipped_configs())


def _copy_sources(dest: Path) -> None:
    """What the wheel is built from, copied so that the build never meets this checkout's
    build/ (setuptools does not clean it: a deleted module would ship) or writes into it."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("recipes", "torchtune_ppo"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)


def _run(cmd, cwd, env, timeout=120) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_lists_copies_and_runs_configs_by_name(tmp_path):
    # 1. Build the wheel (offline, with this environment's setuptools).
    src, dist, venv, work = (tmp_path / n for n in ("src", "dist", "venv", "work"))
    _copy_sources(src)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(dist), str(src)], tmp_path, None, timeout=300)
    (wheel,) = dist.glob("torchtune_ppo-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    for name in cli.shipped_configs():
        assert f"torchtune_ppo/configs/{name}.yaml" in files
    assert {"ppo_full_finetune.py", "torchtune_ppo/cli.py"} <= files
    assert "console_scripts" in next(zipfile.ZipFile(wheel).read(f).decode() for f in files
                                     if f.endswith(".dist-info/entry_points.txt"))

    # 2. A fresh venv with the wheel in it. torch/torchtune come from this environment, as with
    # --system-site-packages, but from wherever they are here (this environment may itself be a
    # venv): a .pth that names its site-packages. Plain path lines: its own .pth files (an
    # editable install of this checkout) are not run. Written after the install, so that pip
    # sees no torchtune-ppo already installed.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--no-build-isolation", "-q", str(wheel)], tmp_path, None, timeout=300)
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    parent = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_parent_env.pth").write_text("".join(f"{p}\n" for p in parent))
    # `tune`, as installing torchtune into the venv would write it (this script's folder, not the
    # current one, is sys.path[0]; `tune run` itself appends the current folder).
    tune = venv / "bin" / "tune"
    tune.write_text(f"#!{python}\nimport sys\nfrom torchtune._cli.tune import main\nsys.exit(main())\n")
    tune.chmod(0o755)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               OMP_NUM_THREADS="1")
    work.mkdir()

    # 3. It is the installed package that runs, not this checkout.
    where = _run([str(python), "-c", "import torchtune_ppo, torchtune_ppo.cli as c; "
                  "from importlib.util import find_spec; print(torchtune_ppo.__file__); "
                  "print(find_spec('ppo_full_finetune').origin); "
                  f"print(c.shipped_configs()[{TINY!r}])"], work, env).split()
    assert len(where) == 3 and all(Path(p).is_relative_to(venv) for p in where), where

    # 4. List, copy (a config and the recipe, under a name the installed module cannot shadow).
    listing = _run(["tune-ppo", "ls"], work, env)
    assert re.search(rf"{TINY}\s+PPO on the embedded tiny sentiment task", listing), listing
    assert all(name in listing for name in cli.shipped_configs())
    assert "hard-coded registry" in _run(["tune-ppo", "--help"], work, env)
    _run(["tune-ppo", "cp", TINY, "."], work, env)
    _run(["tune-ppo", "cp", "ppo_full_finetune", "."], work, env)
    assert (work / "my_ppo.py").read_bytes() == Path(where[1]).read_bytes()
    config = work / "ppo_tiny_sentiment.yaml"
    assert config.read_bytes() == Path(where[2]).read_bytes()
    # Edit the copy: it is the copy that runs 2 steps (no override on the command line).
    edited, n = re.subn(r"(?m)^num_ppo_steps:.*$", "num_ppo_steps: 2", config.read_text())
    assert n == 1
    config.write_text(edited)

    # 5. Run: the copied recipe on the edited copy, the installed recipe on a shipped config
    # given by name, and an unknown name; all three at once.
    runs = {
        "copy": ["tune", "run", "my_ppo.py", "--config", config.name, f"output_dir={tmp_path / 'out_copy'}"],
        "name": ["tune", "run", "ppo_full_finetune", "--config", TINY, "num_ppo_steps=2",
                 f"output_dir={tmp_path / 'out_name'}"],
        "unknown": ["tune", "run", "ppo_full_finetune", "--config", "tiny/nope"],
    }
    procs = {k: subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for k, cmd in runs.items()}
    out = {k: p.communicate(timeout=600)[0] for k, p in procs.items()}
    for k in ("copy", "name"):
        assert procs[k].returncode == 0, out[k]
        assert "Run done: 2 steps logged" in out[k], out[k]
        assert (tmp_path / f"out_{k}" / "checkpoints" / "step_2").is_dir()
    assert procs["unknown"].returncode != 0
    assert "Traceback" not in out["unknown"], out["unknown"]
    assert "'tiny/nope'" in out["unknown"] and all(n in out["unknown"] for n in cli.shipped_configs())
    assert not any(work.glob("**/checkpoints")), "the runs wrote into the working folder"
