"""What identifies a run's prompt data, kept in every checkpoint, and how a resume compares it.

A resume puts the run back at the saved batch of the saved epoch: that only means something
over the same data. The config's ``dataset.*`` keys are compared on resume
(:mod:`torchtune_ppo.checkpointing.resume_config`), but a data file edited in place keeps its
name. :func:`data_identity` records, once at start, each local data file's path, size and
sha256 (read in chunks) and the dataset's row count; for data that is not in local files (a
Hub dataset) the source, split, rows and the ``datasets`` fingerprint. The embedded tasks'
built-in data are asset files (``${ppo_asset:...}``), so they are local files here.

:func:`data_changes` lists what differs between the saved identity and the current one, and
:func:`check_resumed_data` turns a difference into a refusal that names the file, or, with
``resume_accept_data_change: true``, into a warning. A file moved unchanged (the same size and
sha256 at another path) is the same data: :func:`moved_files` finds the saved files at the
paths a config now names, for the resume's check of the config.
"""

import glob
import hashlib
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from omegaconf import ListConfig

__all__ = ["DataChangedError", "check_resumed_data", "data_changes", "data_identity", "local_data_files", "moved_files"]

_SHOWN = 12  # hex digits of a sha256 shown in a message


class DataChangedError(ValueError):
    """The data differs from the data a checkpoint was trained on."""


def local_data_files(cfg_dataset: Mapping[str, Any]) -> List[Path]:
    """The local files a dataset block reads, in the order given.

    ``data_files`` may be a path, a glob, a list of them, or a split -> path(s) mapping; with
    no ``data_files``, a ``source`` that is a local file or folder (every file under it).
    Anything else (a Hub name, a URL) is not local.
    """
    files = cfg_dataset.get("data_files")
    if isinstance(files, Mapping):
        files = [f for v in files.values() for f in (v if _is_list(v) else [v])]
    elif isinstance(files, str):
        files = [files]
    elif not _is_list(files):
        files = []
    found: List[Path] = []
    for f in files:
        if not isinstance(f, str):
            continue
        if Path(f).is_file():
            found.append(Path(f))
        elif any(c in f for c in "*?["):
            found += [Path(p) for p in sorted(glob.glob(f, recursive=True)) if Path(p).is_file()]
    source = cfg_dataset.get("source")
    if not found and not files and isinstance(source, str):
        path = Path(source)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
    return [p.resolve() for p in found]


def data_identity(cfg_dataset: Mapping[str, Any], dataset: Any) -> Dict[str, Any]:
    """What identifies the data of ``cfg_dataset``, as plain data for a checkpoint.

    Each local file is read once, in chunks, for its sha256.

    Args:
        cfg_dataset (Mapping[str, Any]): the ``dataset`` block (resolved paths).
        dataset (Any): the built dataset; ``len(dataset)`` is the row count a run reads.

    Returns:
        Dict[str, Any]: ``{"rows", "source", "split", "files": [{"path", "size", "sha256"}],
        "fingerprint"}``; ``fingerprint`` (the ``datasets`` library's, of the loaded data) only
        when no file is local, else None.
    """
    files = [{"path": str(p), "size": p.stat().st_size, "sha256": _sha256(p)} for p in local_data_files(cfg_dataset)]
    fingerprint = None
    if not files:  # torchtune's datasets and ours keep the Hugging Face dataset in `_data`
        value = getattr(getattr(dataset, "_data", None), "_fingerprint", None)
        fingerprint = value if isinstance(value, str) else None
    source = cfg_dataset.get("source")
    return {"rows": len(dataset), "source": source if isinstance(source, str) else None,
            "split": str(cfg_dataset.get("split", "train")), "files": files, "fingerprint": fingerprint}


def data_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """What differs between two :func:`data_identity` results, one line per file (or source).

    Returns:
        List[str]: e.g. ``"'/data/p.json': rows 200 -> 180, size 5120 -> 4608 bytes, sha256
        1a2b3c4d5e6f... -> 9f8e7d6c5b4a..."``; empty when the data are the same.
    """
    old_files = {f["path"]: f for f in saved.get("files") or []}
    new_files = {f["path"]: f for f in current.get("files") or []}
    rows = _change("rows", saved.get("rows"), current.get("rows"))
    # One file on each side: the rows are that file's (a renamed file is compared by position).
    single = len(old_files) == len(new_files) == 1
    if single and set(old_files) != set(new_files):
        (old,), (new,) = old_files.values(), new_files.values()
        old_files, new_files = {new["path"]: old}, {new["path"]: new}
    for path in [p for p in new_files if p not in old_files]:  # moved unchanged: the same file
        twin = next((q for q in old_files if q not in new_files and _same_bytes(old_files[q], new_files[path])), None)
        if twin is not None:
            old_files[path] = old_files.pop(twin)
    changes = []
    for path in [*new_files, *(p for p in old_files if p not in new_files)]:
        old, new = old_files.get(path), new_files.get(path)
        if old is None:
            changes.append(f"{path!r}: not read by the saved run (a file added)")
        elif new is None:
            changes.append(f"{path!r}: read by the saved run, not now (a file removed)")
        else:
            parts = [rows] if single and rows else []
            parts += [p for p in (_change("size", old.get("size"), new.get("size"), " bytes"),
                                  _change("sha256", old.get("sha256"), new.get("sha256"))) if p]
            if parts:
                changes.append(f"{path!r}: {', '.join(parts)}")
    if not old_files and not new_files:  # not local: the source as the datasets library loaded it
        parts = [p for p in (rows, _change("datasets fingerprint", saved.get("fingerprint"),
                                           current.get("fingerprint"))) if p]
        if parts:
            changes.append(f"{current.get('source')!r} split {current.get('split')!r}: {', '.join(parts)}")
    elif rows and not single:
        changes.append(f"the dataset: {rows}")
    return changes


def check_resumed_data(saved: Optional[Mapping[str, Any]], current: Mapping[str, Any], *, checkpoint: str,
                       position: str, accept: bool, log: Any) -> None:
    """Compares the data of a resume with the data its checkpoint was trained on.

    Args:
        saved (Optional[Mapping[str, Any]]): the checkpoint's :func:`data_identity`; None for a
            checkpoint saved before identities were recorded (a note is logged).
        current (Mapping[str, Any]): this run's :func:`data_identity`.
        checkpoint (str): the checkpoint folder, for messages.
        position (str): where the run resumes in the data, e.g. ``"epoch 2, 3 batches in"``.
        accept (bool): ``resume_accept_data_change``: warn instead of refusing.
        log: has ``info`` and ``warning``.

    Raises:
        DataChangedError: the data differ and ``accept`` is False; names each changed file
            and what changed (rows, size, sha256), and the three ways on.
    """
    if saved is None:
        log.info(f"{checkpoint} records no identity of its data (saved by an older version): the data "
                 "cannot be checked against it. Keep the data files as they were, or the resumed run "
                 "is not the same run.")
        return
    changes = data_changes(saved, current)
    if not changes:
        return
    what = "dataset.data_files" if current.get("files") or saved.get("files") else "dataset"
    listed = "".join(f"\n  {c}" for c in changes)
    said = (f"{what}: the data changed since {checkpoint} was saved:{listed}\n"
            f"The run would resume at its saved position ({position}), counted in batches of the saved data.")
    if accept:
        log.warning(f"{said} Continuing over the changed data, as resume_accept_data_change=True asks.")
        return
    raise DataChangedError(
        f"{said} Put the data back as they were, start a fresh run in another output_dir, or set "
        "resume_accept_data_change=True to continue over the changed data from there."
    )


def moved_files(saved: Mapping[str, Any], cfg_dataset: Mapping[str, Any]) -> Optional[List[Tuple[str, str]]]:
    """Whether the local files of ``cfg_dataset`` are the files a checkpoint's identity records,
    at other paths: the saved data, moved or copied unchanged.

    Args:
        saved (Mapping[str, Any]): the checkpoint's :func:`data_identity`.
        cfg_dataset (Mapping[str, Any]): the resuming run's ``dataset`` block (resolved paths).

    Returns:
        Optional[List[Tuple[str, str]]]: ``(saved path, path now)`` for each saved file, when every
        file the block reads has the size and sha256 of one the saved run read, one for one; None
        when the saved run read no local file or the files differ. Each file is hashed only when
        the sizes already agree.
    """
    old = list(saved.get("files") or [])
    now = local_data_files(cfg_dataset)
    if not old or len(now) != len(old):
        return None
    sizes = sorted(f.get("size") for f in old)
    if sorted(p.stat().st_size for p in now) != sizes:
        return None
    left = {str(p): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in now}
    pairs = []
    for entry in old:
        match = next((p for p, f in left.items() if _same_bytes(entry, f)), None)
        if match is None:
            return None
        pairs.append((entry["path"], match))
        del left[match]
    return pairs


def _same_bytes(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("sha256") is not None and a.get("size") == b.get("size") and a.get("sha256") == b.get("sha256")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _change(what: str, old: Any, new: Any, unit: str = "") -> Optional[str]:
    if old == new:
        return None
    if what == "sha256" or what.endswith("fingerprint"):
        old, new = (f"{v[:_SHOWN]}..." if isinstance(v, str) else v for v in (old, new))
    return f"{what} {old} -> {new}{unit}"


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple, ListConfig))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)
