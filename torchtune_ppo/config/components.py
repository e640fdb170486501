"""Each component block's keys against the arguments of its ``_component_``, before anything is built.

``torchtune.config.instantiate`` passes a block's keys as keyword arguments, so a typo
(``optimizer.lrr``) fails as a bare ``TypeError`` that names neither the key nor the block, and
only when that block is built: the optimizer's after every model has loaded.
:func:`check_component_arguments` reads every mapping with a ``_component_`` in the config, at
the top level and nested (``reward.rewards[0]`` of ``WeightedSum``), and refuses a key that its
callable does not take, naming the full key and the closest valid names.

Only extra keys are errors: an argument left out may have a default or be given by the recipe
(:data:`PASSED_BY_THE_RECIPE`). A callable that takes ``**kwargs`` accepts any key, except a
dataset builder's ``**load_dataset_kwargs``, which ``datasets.load_dataset`` reads: those keys
must be its arguments or fields of the builder's config (``field`` of ``json``, ...). A
``_component_`` that does not import is refused, naming the key, the module or name missing and
the names close to it; one whose package is not installed here only when the run is for this
machine (a run may be planned for another).

:func:`import_component` is the one resolver of dotted paths: the config checks, the
checkpointers' classes and ``torchtune_ppo.rewards.from_path`` all read paths through it.
"""

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import pkgutil
import sys
from typing import Any, Iterator, Mapping, Optional, Set, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["PASSED_BY_THE_RECIPE", "check_component_arguments", "import_component"]

# Arguments the recipe gives a block's callable itself: a config that sets them is refused.
PASSED_BY_THE_RECIPE = {
    "optimizer": ("params",),
    "lr_scheduler": ("optimizer", "num_training_steps"),
    "dataset": ("tokenizer",),
}
_LOAD_DATASET_KWARGS = "load_dataset_kwargs"
_CLOSE = 3  # names suggested


def check_component_arguments(cfg: DictConfig, *, installed_only: bool = False) -> None:
    """Refuse a key of a component block that its ``_component_`` does not take.

    Args:
        cfg (DictConfig): the recipe config (interpolations are not resolved).
        installed_only (bool): also refuse a ``_component_`` whose package is not installed here
            (a run on this machine would fail to build it, after its models have loaded); off, such
            a block is left alone (a run planned for another machine).

    Raises:
        ValueError: naming the full key (e.g. ``optimizer.lrr``), the component, the closest
            valid names and every valid name; or naming a ``_component_`` that does not import,
            with the names close to it (:func:`import_component`).
    """
    tree = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, (DictConfig, ListConfig)) else cfg
    for key, block in _component_blocks(tree):
        _check_block(key, block, installed_only)


def _component_blocks(node: Any, key: str = "") -> Iterator[Tuple[str, Mapping]]:
    """``(dotted key, block)`` of every mapping with a ``_component_``, outer blocks first."""
    if isinstance(node, Mapping):
        if "_component_" in node and key:
            yield key, node
        for k, v in node.items():
            if k != "_component_":
                yield from _component_blocks(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _component_blocks(v, f"{key}[{i}]")


def _check_block(key: str, block: Mapping, installed_only: bool) -> None:
    path = block["_component_"]
    if not isinstance(path, str) or "." not in path or "${" in path:
        return  # not a dotted path: the schema's check of the key says so
    component = import_component(path, f"{key}._component_", absent_ok=not installed_only)
    if component is None:
        return
    try:
        params = inspect.signature(component).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to read
        return
    given = [k for k in block if k != "_component_"]
    top = key.split(".")[0].split("[")[0]
    passed = set(PASSED_BY_THE_RECIPE.get(top, ())) if top == key else set()
    for name in given:
        if name in passed:
            raise ValueError(
                f"{key}.{name}: the recipe passes {name!r} to {path} itself; remove it from the config."
            )
    valid = _valid_names(params, block)
    if valid is None:
        return
    valid -= passed
    unknown = [k for k in given if k not in valid]
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, sorted(valid), n=_CLOSE, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    others = f" (and {', '.join(repr(u) for u in unknown[1:])})" if len(unknown) > 1 else ""
    raise ValueError(
        f"{key}.{name}{others}: {path} takes no argument {name!r}.{hint} {_listed(params, valid, passed)}"
    )


def import_component(path: Any, key: str, *, absent_ok: bool = False) -> Any:
    """The object a dotted import path names: the one resolver of ``_component_`` paths (and of
    ``from_path``'s), so that every key that names code fails alike.

    The deepest module of the path that imports, then the rest as attributes
    (``module.Class.method``), as torchtune's ``instantiate`` reads it.

    Args:
        path (Any): e.g. ``"torch.optim.AdamW"``.
        key (str): how messages name the setting, e.g. ``"optimizer._component_"``.
        absent_ok (bool): return None when the path's top-level package is not installed here
            (a config checked for another machine), instead of refusing it.

    Returns:
        Any: the object, or None (``absent_ok`` and no such package).

    Raises:
        ValueError: naming ``key``, when ``path`` is not a dotted path, its package is not
            installed, a module fails to import (its error quoted), or a name is missing (with the
            names close to it).
    """
    if not isinstance(path, str) or "." not in path:
        from torchtune_ppo.config.schema import _show

        raise ValueError(f"{key} must be a dotted import path (package.module.name), got {_show(path)}.")
    parts = path.split(".")
    try:
        installed = importlib.util.find_spec(parts[0]) is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        if absent_ok:
            return None
        raise ValueError(f"{key}: cannot import {path!r}: no module named {parts[0]!r} is installed here."
                         f"{_close_top_level(parts[0])}")
    for depth in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:depth])
        try:
            obj = importlib.import_module(module_name)
            break
        except ModuleNotFoundError as e:
            if e.name and (module_name + ".").startswith(e.name + "."):
                continue  # `module_name` is not a module: a shorter prefix may be
            raise ValueError(f"{key}: importing {path!r} failed: {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - the module exists but fails to import: its own error
            raise ValueError(f"{key}: importing {path!r} failed: {type(e).__name__}: {e}") from e
    for i in range(depth, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            where = ".".join(parts[:i])
            raise ValueError(f"{key}: cannot import {path!r}: {where} has no {parts[i]!r}."
                             f"{_close_attributes(obj, where, parts[i])}") from None
    return obj


def _close_top_level(name: str) -> str:
    """Installed top-level modules whose names are close to ``name``, as a sentence."""
    names = {m.name for m in pkgutil.iter_modules()} | set(sys.builtin_module_names)
    close = difflib.get_close_matches(name, sorted(n for n in names if not n.startswith("_")), n=_CLOSE, cutoff=0.75)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _close_attributes(module: Any, where: str, name: str) -> str:
    names = [n for n in dir(module) if not n.startswith("_")]
    if hasattr(module, "__path__"):
        names += [m.name for m in pkgutil.iter_modules(module.__path__)]
    close = difflib.get_close_matches(name, sorted(set(names)), n=_CLOSE, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(f'{where}.{c}') for c in close)}?" if close else ""


def _valid_names(params: Mapping[str, inspect.Parameter], block: Mapping) -> Optional[Set[str]]:
    """The keys the callable takes; None when it takes any (``**kwargs``)."""
    named = {n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    var = [n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if not var:
        return named
    if var[0] != _LOAD_DATASET_KWARGS:
        return None
    loaded = _load_dataset_names(block.get("source"))
    return None if loaded is None else named | loaded


def _load_dataset_names(source: Any) -> Optional[Set[str]]:
    """What ``datasets.load_dataset(source, **kwargs)`` takes as ``kwargs``: its own arguments
    and the fields of the builder's config (of every file-based builder when ``source`` is a
    Hub name or a path, since the files decide which one reads them). None when unknown."""
    try:
        import datasets
        import datasets.packaged_modules as packaged
    except ImportError:  # pragma: no cover - torchtune depends on datasets
        return None
    if int(datasets.__version__.split(".")[0]) < 4:
        return None  # a Hub dataset may be a loading script with arguments of its own
    names = set(inspect.signature(datasets.load_dataset).parameters) - {"path", "config_kwargs"}
    builders = [m.name for m in pkgutil.iter_modules(packaged.__path__)]
    chosen = [source] if isinstance(source, str) and source in builders else builders
    for builder in chosen:
        try:
            module = importlib.import_module(f"{packaged.__name__}.{builder}.{builder}")
        except Exception:  # noqa: BLE001 - a builder with a missing extra: not this source's
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, datasets.BuilderConfig) and dataclasses.is_dataclass(obj):
                names |= {f.name for f in dataclasses.fields(obj)}
    return names


def _listed(params: Mapping[str, inspect.Parameter], valid: Set[str], passed: Set[str]) -> str:
    """A sentence: the callable's own valid names in signature order, then what else is valid."""
    own = [n for n in params if n in valid]
    text = f"Its arguments are {own}" if own else "It takes no arguments"
    if set(valid) - set(own):
        text += ", and datasets.load_dataset's arguments and its builder config's fields"
    if passed:
        text += f" ({', '.join(sorted(passed))}: given by the recipe)"
    return text + "."
