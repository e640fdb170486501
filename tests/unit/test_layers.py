"""The library's layers, read from its source with ``ast``: which module may import which.

- no import cycle, counting every import (deferred ones inside functions too) and the package
  ``__init__`` that importing another package's submodule runs first;
- ``rollout/`` and ``ppo/`` never import each other: what both use is in the bottom layer,
  ``rlhf/``, which imports nothing of ``config``, ``compile``, ``distributed`` or any stage;
- ``config/`` is a floor the stages and services stand on: it imports only ``rlhf/``, ``lora``
  and ``_patches/``, never what imports it (the preflight, which checks the data, the output
  folder and the memory plan, sits above it in ``run/``);
- only the top imports ``compile`` (the recipe, ``run/``, benchmarks): the regions' callables
  are handed down, nothing below decides how it is compiled;
- no ``TYPE_CHECKING`` block (a guard that hides an import cycle);
- no private torch or torchtune name outside ``_patches/``: no import from a ``_``-prefixed
  torchtune or torch module, and no ``torch._...`` attribute;
- the recipe stays a table of contents: at most ~350 lines, no method over 40 lines, and
  ``lora.`` / ``distributed.`` only where it builds and shards.
"""

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchtune_ppo"
RECIPE = ROOT / "recipes" / "ppo_full_finetune.py"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _parents(name: str) -> List[str]:
    """The packages whose ``__init__`` runs before ``name`` is imported (not the root's)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _imported(name: str, node: ast.AST) -> List[str]:
    """The library modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".") if _is_package(name) else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        targets = [module] + [f"{module}.{a.name}" for a in node.names]
    found = []
    for t in targets:
        if t in MODULES:  # and the packages above it that are not being imported already
            found += [t, *(p for p in _parents(t) if not (name == p or name.startswith(p + ".")))]
    return found


def _edges() -> Dict[str, Set[str]]:
    edges = {}
    for name, path in MODULES.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update(_imported(name, node))
        out.discard(name)
        out.discard("torchtune_ppo")  # the root package imports no module of its own at import
        edges[name] = out
    return edges


EDGES = _edges()


def _in(name: str, folder: str) -> bool:
    return name == f"torchtune_ppo.{folder}" or name.startswith(f"torchtune_ppo.{folder}.")


def test_the_root_package_imports_nothing_of_its_own():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in imports if _imported("torchtune_ppo", n)]


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(name: str, stack: List[str]) -> None:
        state[name] = "open"
        for nxt in sorted(EDGES[name]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[name] = "done"

    for name in sorted(EDGES):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("a, b", [("rollout", "ppo"), ("ppo", "rollout")])
def test_the_stages_do_not_import_each_other(a, b):
    bad = {m: sorted(x for x in EDGES[m] if _in(x, b)) for m in EDGES if _in(m, a)}
    assert not {m: x for m, x in bad.items() if x}


def test_the_bottom_layer_imports_only_itself_and_patches():
    allowed = ("rlhf", "_patches")
    bad = {m: sorted(x for x in EDGES[m] if not any(_in(x, f) for f in allowed))
           for m in EDGES if _in(m, "rlhf")}
    assert not {m: x for m, x in bad.items() if x}


def test_config_imports_only_the_layers_below_it():
    allowed = ("config", "rlhf", "lora", "_patches")
    bad = {m: sorted(x for x in EDGES[m] if not any(_in(x, f) for f in allowed))
           for m in EDGES if _in(m, "config")}
    assert not {m: x for m, x in bad.items() if x}


def test_only_the_top_imports_compile():
    importers = sorted(m for m, out in EDGES.items() if "torchtune_ppo.compile" in out)
    assert all(_in(m, "run") for m in importers), importers


def test_no_type_checking_blocks():
    found = [_module_name(p) for p in MODULES.values() if "TYPE_CHECKING" in p.read_text()]
    assert not found


def _private_reaches(path: Path) -> List[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "torchtune"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("torch", "torchtune") and any(
                        p.startswith("_") for p in a.name.split(".")):
                    found.append(f"line {node.lineno}: import {a.name}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "torch" and node.attr.startswith("_") and not node.attr.endswith("__")):
            found.append(f"line {node.lineno}: torch.{node.attr}")
    return found


def test_private_names_only_in_patches():
    files = [p for p in [*MODULES.values(), RECIPE] if "_patches" not in p.parts]
    found = {str(p.relative_to(ROOT)): r for p in files if (r := _private_reaches(p))}
    assert not found


def test_private_attribute_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torchtune.data._utils import truncate\ntorch._dynamo.mark_dynamic(x, 0)\n")
    assert len(_private_reaches(bad)) == 2


# --- the recipe ---------------------------------------------------------------------------------


RECIPE_TREE = ast.parse(RECIPE.read_text())
RECIPE_CLASS = next(n for n in RECIPE_TREE.body if isinstance(n, ast.ClassDef))
# Where the recipe may touch LoRA or the process group: building and sharding, before any step.
def _start_up(name: str) -> bool:
    return name in ("__init__", "setup") or name.startswith("_setup")


def test_the_recipe_is_short():
    assert len(RECIPE.read_text().splitlines()) <= 350


def test_no_recipe_method_over_40_lines():
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(RECIPE_TREE)
            if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 40}
    assert not long


def test_lora_and_distributed_only_at_start_up():
    found = []
    for method in RECIPE_CLASS.body:
        if not isinstance(method, ast.FunctionDef) or _start_up(method.name):
            continue
        for node in ast.walk(method):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in (
                    "lora", "distributed"):
                found.append(f"{method.name}: {node.value.id}.{node.attr}")
    assert not found


def _inherited_private_reads(path: Path) -> List[str]:
    """``self._x`` reads in classes of ``path`` where ``_x`` is neither a method of the class nor
    assigned by it: a private attribute of a base class from another library."""
    found = []
    for cls in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
        own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        attrs = [n for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "self" and n.attr.startswith("_") and not n.attr.endswith("__")]
        own |= {a.attr for a in attrs if isinstance(a.ctx, ast.Store)}
        found += [f"{cls.name}: self.{a.attr}" for a in attrs if a.attr not in own]
    return found


def test_no_private_attribute_of_a_torchtune_base_class_outside_patches():
    subclasses = [p for p in MODULES.values() if "_patches" not in p.parts and re.search(
        r"^class \w+\((FullModelHFCheckpointer|ModelTokenizer|Transform|TransformerDecoder)", p.read_text(), re.M)]
    assert subclasses  # the classifier checkpointer and the chat tokenizer are read
    found = {str(p.relative_to(ROOT)): r for p in subclasses if (r := _inherited_private_reads(p))}
    assert not found


def test_inherited_private_read_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class C(FullModelHFCheckpointer):\n    def f(self):\n        self._own = 1\n"
                   "        return self._own + self._checkpoint_dir\n")
    assert _inherited_private_reads(bad) == ["C: self._checkpoint_dir"]
