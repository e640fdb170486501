"""The compile cache file (``compile_cache``): where it goes, when it is off, and that a damaged
file costs a compile, never the run. Its use by a real run: tests/e2e/test_recipe.py."""

import pytest
from omegaconf import OmegaConf

import torchtune_ppo.compile as compile_module
from torchtune_ppo.compile import BACKEND_ENV, CACHE_FILE, CompileCache, RecompileCounter


def _cfg(tmp_path, **kw):
    return OmegaConf.create({"output_dir": str(tmp_path / "run"), "compile": True, **kw})


def test_default_is_a_file_in_the_output_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert CompileCache.from_config(_cfg(tmp_path)).path == tmp_path / "run" / CACHE_FILE
    assert CompileCache.from_config(_cfg(tmp_path, compile_cache=True)).path == tmp_path / "run" / CACHE_FILE
    named = CompileCache.from_config(_cfg(tmp_path, compile_cache=str(tmp_path / "shared.bin")))
    assert named.path == tmp_path / "shared.bin"


@pytest.mark.parametrize("cfg", [
    {"compile_cache": False},
    {"compile": False},
    {"compile": {"generate": False, "trajectory": False, "loss_step": False, "rollout": False}},
])
def test_off(tmp_path, monkeypatch, cfg):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert CompileCache.from_config(_cfg(tmp_path, **cfg)).path is None


def test_one_compiled_region_is_enough(tmp_path, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    block = {"generate": False, "trajectory": True, "loss_step": False, "rollout": False}
    assert CompileCache.from_config(_cfg(tmp_path, compile=block)).path is not None


def test_off_with_a_test_backend(tmp_path, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "eager")  # no inductor graphs to keep
    assert CompileCache.from_config(_cfg(tmp_path)).path is None


class _Log:
    def __init__(self):
        self.lines = []

    def warning(self, msg):
        self.lines.append(("warning", msg))

    def info(self, msg):
        self.lines.append(("info", msg))


def test_a_damaged_file_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    path = tmp_path / CACHE_FILE
    path.write_bytes(b"not a cache" * 100)
    log = _Log()
    monkeypatch.setattr(compile_module, "_log", log)
    counter = RecompileCounter(CompileCache(path))  # reads the file at once
    assert [level for level, _ in log.lines] == ["warning"]
    assert "could not be read" in log.lines[0][1] and str(path) in log.lines[0][1]
    assert counter._cache.loaded == 0
    assert path.read_bytes() == b"not a cache" * 100  # kept as it was until a save replaces it


def test_a_missing_file_reads_nothing_and_other_ranks_never_write(tmp_path):
    assert CompileCache(tmp_path / "absent.bin").load() == 0
    assert CompileCache(tmp_path / "absent.bin", rank_zero=False).save() is None
    assert not (tmp_path / "absent.bin").exists()
