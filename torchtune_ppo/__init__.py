"""Building blocks of the fast PPO recipe for torchtune."""

from pathlib import Path

from omegaconf import OmegaConf

# One folder per embedded task; each ships its files in tasks/<task>/assets.
TASKS_DIR = Path(__file__).parent / "tasks"


def _tasks() -> list[str]:
    return sorted(p.name for p in TASKS_DIR.iterdir() if (p / "assets").is_dir())


def asset_path(name: str) -> str:
    """Absolute path of a file or folder shipped with an embedded task.

    Args:
        name (str): ``"<task>/<file>"``, e.g. ``"tiny_sentiment/tokenizer.model"``, or
            ``"<task>"`` for the task's whole assets folder.

    Returns:
        str: the path ``torchtune_ppo/tasks/<task>/assets/<file>``.

    Raises:
        FileNotFoundError: no such task or file; the message lists what is shipped.
    """
    task, _, rest = name.partition("/")
    assets = TASKS_DIR / task / "assets"
    if not task or not assets.is_dir():
        raise FileNotFoundError(f"ppo_asset: {name!r}: no task {task!r}; shipped tasks: {_tasks()}")
    path = assets / rest
    if not path.exists():
        files = sorted(str(p.relative_to(assets)) for p in assets.rglob("*") if p.is_file())
        raise FileNotFoundError(f"ppo_asset: {name!r}: {rest!r} is not in {assets}; {task} ships: {files}")
    return str(path)


# Configs name shipped files as ${ppo_asset:tiny_sentiment/tokenizer.model} so that they
# work from any directory and from a plain (non-editable) install.
if not OmegaConf.has_resolver("ppo_asset"):
    # omegaconf 2.4 renamed register_new_resolver; 2.3 only has the old name.
    _register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    _register("ppo_asset", asset_path)

_RUN_ID = None


def run_id() -> str:
    """A name for this process's run, fixed at first use: ``YYYYmmdd-HHMMSS-<pid>``."""
    global _RUN_ID
    if _RUN_ID is None:
        import os
        import time

        _RUN_ID = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return _RUN_ID


# Shipped configs write each fresh run to its own folder, ${ppo_run_id:}, so running the same
# command twice never meets the first run's checkpoints; resuming names the folder explicitly.
if not OmegaConf.has_resolver("ppo_run_id"):
    _register("ppo_run_id", run_id)

# `_component_` paths that shipped before the library was split into stages, kept for one
# release: torchtune resolves a dotted path by getattr first, so these names still load.
_MOVED = {"datasets": "torchtune_ppo.data"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"torchtune_ppo.{name} moved to {_MOVED[name]}; the old path will be removed "
                      "in the next release.", FutureWarning, stacklevel=2)
        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'torchtune_ppo' has no attribute {name!r}")
