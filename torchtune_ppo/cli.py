"""The configs shipped with the package: list them, copy one, run one by name.

The YAML files of ``recipes/configs/<family>/<name>.yaml`` install as the package data
``torchtune_ppo.configs`` (``pyproject.toml``) and are named as torchtune names its own:
``tiny/ppo_tiny_sentiment`` (``.yaml`` optional).

- ``tune-ppo ls``: the recipe and every shipped config, with the one-line description the
  config opens with.
- ``tune-ppo cp <name> [dest]``: copy a config (or the recipe, ``ppo_full_finetune``) to edit.
- ``tune-ppo export <checkpoint> <dest>``: a checkpoint's trained models as Hugging Face folders
  (:mod:`torchtune_ppo.checkpointing.export`).
- ``tune run ppo_full_finetune --config <name>``: the recipe's ``__main__`` block rewrites a
  ``--config`` value that is not a file (with or without ``.yaml``) but a shipped name into
  that config's path (:func:`resolve_config_arg`) before torchtune's ``config.parse`` reads it,
  and logs the absolute path of the file used.

torchtune 0.6.1's own ``tune ls`` / ``tune cp`` read a hard-coded registry of torchtune's
recipes (``torchtune/_recipe_registry.py``, no plugin hook), hence this small command.
"""

import argparse
import atexit
import contextlib
import os
import re
import shlex
import shutil
import sys
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Dict, List, Optional, Sequence

RECIPE = "ppo_full_finetune"
# `tune run` appends the current folder to the END of sys.path, so an installed
# `ppo_full_finetune` shadows a copy of the same name there: copies get another name.
RECIPE_COPY = "my_ppo.py"
SUFFIX = ".yaml"


def configs_root():
    """The folder of shipped configs, as an ``importlib.resources`` Traversable.

    A wheel install holds them in ``torchtune_ppo/configs``. In a source checkout (an editable
    install, or the repository on ``sys.path``) they are the checkout's ``recipes/configs``:
    setuptools' editable finder cannot import ``torchtune_ppo.configs`` there (a folder with no
    ``__init__.py`` mapped outside its parent package), so it is read from the folder itself.
    """
    try:
        return resources.files("torchtune_ppo.configs")
    except ModuleNotFoundError:
        import torchtune_ppo

        checkout = Path(torchtune_ppo.__file__).resolve().parent.parent / "recipes" / "configs"
        if checkout.is_dir():
            return checkout
        raise


def shipped_configs() -> Dict[str, object]:
    """Every shipped config, ``{"tiny/ppo_tiny_sentiment": <Traversable>, ...}``, sorted."""
    found: Dict[str, object] = {}

    def walk(folder, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                if not entry.name.startswith(("_", ".")):
                    walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(SUFFIX):
                found[prefix + entry.name[: -len(SUFFIX)]] = entry

    walk(configs_root(), "")
    return dict(sorted(found.items()))


def description(text: str) -> str:
    """The first sentence of the comment a config opens with ("" when it opens with none); a
    sentence over 100 characters stops at its first colon, if any."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        line = line.lstrip("#").strip()
        if not line:
            if lines:
                break
            continue
        lines.append(line)
    paragraph = " ".join(lines)
    first = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = first.group(1) if first else paragraph
    if len(sentence) > 100 and ": " in sentence:
        sentence = sentence.split(": ", 1)[0]
    return sentence


def _name(value: str) -> str:
    """A shipped config's name from what a user may type: with or without ``.yaml``, or the
    repository path ``recipes/configs/<name>.yaml`` of the README of a clone."""
    name = value.replace("\\", "/")
    for prefix in ("./", "recipes/configs/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name


def unknown_config_message(value: str) -> str:
    names = ", ".join(shipped_configs())
    return (f"--config {value!r}: there is no such file in {os.getcwd()}, and it is not the name "
            f"of a config shipped with torchtune_ppo. Shipped configs: {names}. Give a path to "
            f"a YAML file or one of these names ({SUFFIX} optional); `tune-ppo ls` describes "
            "them and `tune-ppo cp <name> .` copies one to edit.")


_KEEP_OPEN = contextlib.ExitStack()
atexit.register(_KEEP_OPEN.close)


def config_path(value: str) -> str:
    """The file a ``--config`` value means: ``value`` itself when it is a file (relative to the
    current folder, as torchtune's ``tune run --config <path>`` reads it), else ``value`` +
    ``.yaml`` when that is a file, else the shipped config of that name.

    Raises:
        FileNotFoundError: none of them; the message lists the shipped names.
    """
    for path in (value, value + SUFFIX):
        if os.path.isfile(path):
            return path
    entry = shipped_configs().get(_name(value))
    if entry is None:
        raise FileNotFoundError(unknown_config_message(value))
    if isinstance(entry, Path):
        return str(entry)
    # Installed as a zip: a real file for as long as the process runs.
    return str(_KEEP_OPEN.enter_context(resources.as_file(entry)))


def config_used(value: str, path: str) -> str:
    """The line that says which file a ``--config`` value ran: its absolute path, and whether it
    is a shipped config, or a file that the shipped config of the same name gave way to."""
    where, name = os.path.abspath(path), _name(value)
    entry = shipped_configs().get(name)
    if entry is None:
        return f"Config: {where}"
    if isinstance(entry, Path) and os.path.samefile(entry, path):
        return f"Config: {where} (shipped config {name})"
    if os.path.isfile(value) or os.path.isfile(value + SUFFIX):
        return f"Config: {where} (a file here, not the shipped config {name})"
    return f"Config: {where} (shipped config {name})"  # installed as a zip


def resolve_config_arg(argv: Sequence[str]) -> List[str]:
    """``argv`` with each ``--config`` value that names a shipped config (and is not a file)
    replaced by that config's path; ``--config X`` and ``--config=X`` both. A file at the given
    path (``.yaml`` optional) comes first. Logs the absolute path of each config file used (on
    rank 0 under torchrun).

    The recipe's ``__main__`` block calls it before torchtune's ``config.parse`` reads
    ``sys.argv``: ``sys.argv = resolve_config_arg(sys.argv)``.

    Raises:
        SystemExit: a value that is neither a file nor a shipped name, with one paragraph
            listing the shipped names (no traceback).
    """
    args = list(argv)
    used = []
    try:
        for i, arg in enumerate(args):
            if arg == "--config" and i + 1 < len(args):
                value = args[i + 1]
                args[i + 1] = config_path(value)
                used.append(config_used(value, args[i + 1]))
            elif arg.startswith("--config="):
                value = arg[len("--config="):]
                args[i] = "--config=" + config_path(value)
                used.append(config_used(value, args[i][len("--config="):]))
    except FileNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    if used and os.environ.get("RANK", "0") == "0":
        from torchtune import utils

        log = utils.get_logger("INFO")
        for line in used:
            log.info(line)
    return args


def recipe_file() -> Path:
    """The installed recipe, ``ppo_full_finetune.py`` (found without importing it)."""
    spec = find_spec(RECIPE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"error: the recipe module {RECIPE!r} is not installed")
    return Path(spec.origin)


def _ls(args: argparse.Namespace) -> None:
    configs = shipped_configs()
    width = max(len("CONFIG"), *map(len, configs)) + 2
    left = len(RECIPE) + 2
    columns = shutil.get_terminal_size().columns if sys.stdout.isatty() else 0
    print(f"{'RECIPE':<{left}}{'CONFIG':<{width}}DESCRIPTION")
    for i, (name, entry) in enumerate(configs.items()):
        text = description(entry.read_text(encoding="utf-8"))
        row = f"{RECIPE if i == 0 else '':<{left}}{name:<{width}}"
        if columns > len(row) + 20 and len(row) + len(text) > columns:
            import textwrap

            text = textwrap.fill(text, columns - 1, initial_indent=row,
                                 subsequent_indent=" " * len(row))
            print(text)
        else:
            print(row + text)
    first = "tiny/ppo_tiny_sentiment" if "tiny/ppo_tiny_sentiment" in configs else next(iter(configs))
    print(f"\nRun one:   tune run {RECIPE} --config {first}\n"
          f"Copy one:  tune-ppo cp {first} .   (the recipe too: tune-ppo cp {RECIPE} .)")


def _with_suffix(dest: Path, suffixes: Sequence[str]) -> Path:
    """``dest`` as given when its name ends with one of ``suffixes``, else with the first one
    added: a dot elsewhere in the name (``exp.lr3e-4``) is part of the name, not an extension."""
    return dest if dest.name.endswith(tuple(suffixes)) else dest.with_name(dest.name + suffixes[0])


def _cp(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    dest = Path(args.destination)
    into_folder = dest.is_dir() or args.destination.endswith(("/", os.sep))
    if args.name.removesuffix(".py") == RECIPE:
        src = recipe_file()
        dest = dest / RECIPE_COPY if into_folder else _with_suffix(dest, (".py",))
        if dest.name == RECIPE + ".py":
            parser.error(f"a copy named {RECIPE}.py would not run: `tune run` appends the current "
                         f"folder to the end of sys.path, so the installed {RECIPE} module "
                         f"shadows it. Give it another name, e.g. {RECIPE_COPY}.")
        if "." in dest.name[: -len(".py")]:
            parser.error(f"a copy named {dest.name} would not run: `tune run` imports a recipe "
                         f"file as a module, and a dot in its name reads as a package. Give it a "
                         f"name without dots before .py, e.g. {dest.name[:-3].replace('.', '_')}.py.")
        run = f"tune run {shlex.quote(str(dest))} --config <config>"
    else:
        entry = shipped_configs().get(_name(args.name))
        if entry is None:
            parser.error(f"{args.name!r} is neither the recipe ({RECIPE}) nor a shipped config. "
                         f"Shipped configs: {', '.join(shipped_configs())}.")
        src = entry
        dest = dest / entry.name if into_folder else _with_suffix(dest, (SUFFIX, ".yml"))
        run = f"tune run {RECIPE} --config {shlex.quote(str(dest))}"
    if dest.is_dir():
        raise SystemExit(f"error: cannot copy to {dest.absolute()}: it is a folder; give another "
                         "destination")
    exists = (f"error: {dest.absolute()} already exists; give --force to overwrite it, or "
              "another destination")
    if dest.exists() and not args.force:
        if args.no_clobber:
            print(f"File already exists at {dest.absolute()}, not overwriting.")
            return
        raise SystemExit(exists)
    try:
        if args.make_parents:
            dest.parent.mkdir(parents=True, exist_ok=True)
        out = open(dest, "wb" if args.force else "xb")  # "x": never a file made meanwhile
    except FileExistsError as error:
        if error.filename != str(dest):
            raise SystemExit(f"error: cannot create the folder {dest.parent.absolute()}: "
                             f"{Path(error.filename).absolute()} is a file") from None
        raise SystemExit(exists) from None
    except OSError as error:
        missing = not dest.parent.is_dir()
        hint = (f" (no folder {dest.parent.absolute()}; --make-parents creates it)"
                if missing and not args.make_parents else "")
        raise SystemExit(f"error: cannot copy to {dest.absolute()}: "
                         f"{error.strerror or error}{hint}") from None
    with out:
        out.write(src.read_bytes())
    print(f"Copied file to {dest}\nRun it with: {run}")


def _export(args: argparse.Namespace) -> None:
    from torchtune_ppo.checkpointing.export import export_checkpoint

    try:
        written = export_checkpoint(args.checkpoint, args.dest, adapter=args.adapter)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    for name, folder in written.items():
        print(f"Exported {name} to {folder}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tune-ppo",
        description=(
            f"The configs shipped with torchtune_ppo's recipe ({RECIPE}): list them, copy one\n"
            "(or the recipe) to edit. torchtune 0.6.1's `tune ls` and `tune cp` only know\n"
            "torchtune's own recipes (a hard-coded registry with no way to add one), so they do\n"
            f"not show these. `tune run {RECIPE} --config <name>` runs a shipped config by\n"
            "name from any folder (a file of that name in the current folder comes first)."),
        epilog=("examples:\n"
                "  tune-ppo ls\n"
                "  tune-ppo cp tiny/ppo_tiny_sentiment .\n"
                f"  tune-ppo cp {RECIPE} {RECIPE_COPY}\n"
                f"  tune run {RECIPE} --config tiny/ppo_tiny_sentiment num_ppo_steps=10\n"
                f"  tune run {RECIPE_COPY} --config ppo_tiny_sentiment.yaml"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="commands", dest="command", required=True)
    commands.add_parser("ls", help="list the recipe and the shipped configs, with descriptions",
                        description="List the recipe and the shipped configs, each with the "
                                    "description it opens with.")
    cp = commands.add_parser(
        "cp", help="copy a shipped config (or the recipe) to edit",
        description=(f"Copy a shipped config, or the recipe ({RECIPE}), to a file or folder. A "
                     f"recipe copied into a folder is named {RECIPE_COPY}: a copy named "
                     f"{RECIPE}.py would be shadowed by the installed module."))
    cp.add_argument("name", help=f"a config name from `tune-ppo ls` ({SUFFIX} optional) or {RECIPE}")
    cp.add_argument("destination", nargs="?", default=".",
                    help="file or folder to copy to (default: the current folder)")
    clobber = cp.add_mutually_exclusive_group()
    clobber.add_argument("-n", "--no-clobber", action="store_true",
                         help="leave an existing file as it is and exit 0 (without -n or -f an "
                              "existing file is an error)")
    clobber.add_argument("-f", "--force", action="store_true",
                         help="overwrite an existing file")
    cp.add_argument("--make-parents", action="store_true",
                    help="create the destination's parent folders if they do not exist")
    export = commands.add_parser(
        "export", help="write a checkpoint's trained models as Hugging Face folders",
        description=("Write <dest>/policy and <dest>/value (a critic-free run has none) in Hugging Face "
                     "format from a checkpoint of either checkpoint_format, through the run's own "
                     "checkpointers (the folder the run started from must still be there). A LoRA model is "
                     "merged, or with --adapter written as its adapters in PEFT's layout."))
    export.add_argument("checkpoint", help="a checkpoints/step_<N> folder, or a run's output_dir (its newest)")
    export.add_argument("dest", help="an empty or new folder")
    export.add_argument("--adapter", action="store_true", help="LoRA models: the adapters, not merged weights")
    args = parser.parse_args(argv)
    try:
        if args.command == "ls":
            _ls(args)
        elif args.command == "export":
            _export(args)
        else:
            _cp(cp, args)
    except BrokenPipeError:  # `tune-ppo ls | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
