"""The files of a checkpoint directory: tags, ``latest``, atomic writes, the sha256 manifest.

Invariants, at every stage (the engine's own files at stage 0, DeepSpeed's and
ours at ZeRO 1-3):

* **A tag is a plain name.** ``tag=`` and the tag read back from ``latest`` are
  checked alike (:func:`check_tag`): no path separators, no ``.``/``..``, no
  blank or padded names, not ``latest`` itself. A ``latest`` file holding an
  absolute path or ``../..`` cannot redirect a load to another directory.
* **``latest`` only ever names a complete checkpoint, and is never half-written.**
  It is written last, through a temporary file and ``os.replace``, with the file
  and its directory fsynced (:func:`write_atomically`). A process killed at any
  point of a save leaves ``latest`` naming either the previous checkpoint or
  the new one, both complete. A ``latest`` that is empty, binary, oversized or
  not a regular file is a ``ValueError`` naming it and the tags present, never
  "no checkpoint" (a resume script would silently start again from step 0).
* **A tag directory is complete when its manifest is there.** A save first
  marks the directory incomplete (:data:`INCOMPLETE_FILE`) and removes any old
  manifest, writes every file, then writes the manifest (sha256 and size of
  each file, atomically) and drops the mark. Loading verifies every file
  against it before anything is loaded, so a flipped byte or a truncated file
  is a ``ValueError`` naming the file, not wrong weights. The digests detect
  corruption, not an attacker (who can rewrite the manifest too): what keeps a
  checkpoint from running code is the ``weights_only`` unpickler
  (:mod:`hybrid_engine.training.checkpoint`).
* **Leftovers are cleaned.** A save removes the ``.tmp`` files killed saves
  left behind (``save_dir/latest.tmp``, ``<tag>/hybrid_engine_*.tmp``); the
  directories of interrupted saves stay, marked incomplete, and are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["INCOMPLETE_FILE", "LATEST_FILE", "MANIFEST_FILE", "begin_save", "check_tag", "checkpoint_tags",
           "describe_tags", "digests", "finish_save", "read_latest", "refusal", "rng_problem", "tag_files", "verify",
           "warn_unverified", "write_atomically", "write_latest"]

LATEST_FILE = "latest"
MANIFEST_FILE = "hybrid_engine_manifest.json"
INCOMPLETE_FILE = "hybrid_engine_save_incomplete"
TMP_SUFFIX = ".tmp"
MANIFEST_FORMAT = 1
#: Names a tag may not take: the file recording the last tag, its temporary file, DeepSpeed's universal one.
RESERVED_TAGS = frozenset({LATEST_FILE, LATEST_FILE + TMP_SUFFIX, "latest_universal"})
MAX_TAG_BYTES = 255  # one path component on common filesystems
MAX_LATEST_BYTES = 4096
MAX_MANIFEST_BYTES = 64 * 2**20
_CHUNK = 2**20


def check_tag(tag: Any, what: str = "tag") -> None:
    """Raise ``ValueError`` unless ``tag`` is ``None`` or a name one directory of ``save_dir`` can take."""
    if tag is None:
        return
    if not isinstance(tag, str):
        raise ValueError(f"{what} must be a str naming a directory of save_dir, got {type(tag).__name__}")
    problem = _tag_problem(tag)
    if problem is not None:
        raise ValueError(f"{what} must be a plain directory name, got {tag!r}: {problem}")


def _tag_problem(tag: str) -> str | None:
    if not tag.strip():
        return "it is blank"
    if tag != tag.strip():
        return "it has leading or trailing whitespace (latest is read back stripped)"
    if not tag.isprintable():
        return "it has control characters"
    if "/" in tag or "\\" in tag or (os.altsep and os.altsep in tag):
        return "it has a path separator (absolute paths and subdirectories are refused)"
    if tag in (".", ".."):
        return "it names the directory itself or its parent"
    if tag in RESERVED_TAGS:
        return f"{tag!r} is reserved (save_dir/{LATEST_FILE} records the last tag)"
    if len(tag.encode("utf-8", "surrogatepass")) > MAX_TAG_BYTES:
        return f"it is longer than {MAX_TAG_BYTES} bytes"
    return None


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def checkpoint_tags(root: Path) -> list[str]:
    """The directories of ``root`` holding a checkpoint (a manifest, a stage-0 state file or DeepSpeed's model
    states) and not marked incomplete, in natural order (``global_step9`` before ``global_step10``)."""
    try:
        entries = [e for e in os.scandir(root) if e.is_dir()]
    except OSError:
        return []
    found = []
    for entry in entries:
        directory = Path(entry.path)
        if (directory / INCOMPLETE_FILE).exists():
            continue
        if ((directory / MANIFEST_FILE).is_file() or (directory / "hybrid_engine_states.pt").is_file()
                or any(directory.glob("*model_states.pt"))):
            found.append(entry.name)
    return sorted(found, key=_natural)


def describe_tags(root: Path) -> str:
    tags = checkpoint_tags(root)
    if not tags:
        return f"{root} holds no checkpoint directory"
    shown = ", ".join(tags[-10:])
    return f"checkpoints in {root}: {'... ' if len(tags) > 10 else ''}{shown}"


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``path.tmp``: ``write(file)``, fsync, ``os.replace``, fsync the directory. A
    reader sees the old file or the whole new one, whenever the writer is killed."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def _remove_leftovers(root: Path) -> None:
    """The temporary files saves killed half-way left: ``root/latest.tmp`` and ``hybrid_engine_*.tmp`` in
    every tag directory (only our own names: nothing else is touched)."""
    (root / (LATEST_FILE + TMP_SUFFIX)).unlink(missing_ok=True)
    try:
        directories = [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for directory in directories:
        for leftover in directory.glob(f"hybrid_engine_*{TMP_SUFFIX}"):
            if leftover.is_file():
                leftover.unlink(missing_ok=True)


def begin_save(root: Path, directory: Path) -> None:
    """Mark ``directory`` incomplete (and drop its old manifest) before any file of a save is written; clean
    what killed saves left."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / INCOMPLETE_FILE).write_bytes(b"")
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    fsync_directory(directory)
    fsync_directory(root)
    _remove_leftovers(root)


def tag_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` (relative POSIX paths, sorted) but the manifest, the
    incomplete mark and temporary files: what a manifest lists."""
    names = []
    for current, dirs, files in os.walk(directory):
        dirs.sort()
        for name in files:
            path = Path(current) / name
            rel = path.relative_to(directory).as_posix()
            if rel in (MANIFEST_FILE, INCOMPLETE_FILE) or name.endswith(TMP_SUFFIX) or not path.is_file():
                continue
            names.append(rel)
    return sorted(names)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digests(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"sha256": hex, "size": bytes}}`` of the files ``names`` under ``directory``."""
    return {name: {"sha256": _sha256(directory / name), "size": (directory / name).stat().st_size}
            for name in names}


def finish_save(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """Write ``directory``'s manifest (atomically), then drop the incomplete mark: the save is complete."""
    manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": dict(sorted(files.items()))}
    data = json.dumps(manifest, indent=1).encode()
    write_atomically(directory / MANIFEST_FILE, lambda f: f.write(data))
    (directory / INCOMPLETE_FILE).unlink(missing_ok=True)
    fsync_directory(directory)


def write_latest(root: Path, tag: str) -> None:
    """Record ``tag`` in ``root/latest``, atomically (after its checkpoint is complete)."""
    write_atomically(root / LATEST_FILE, lambda f: f.write(tag.encode()))


def _regular_file_size(path: Path) -> int | None:
    """The size of ``path`` if it is a regular file (following links), ``None`` if it does not exist. A FIFO
    or a device is never opened: reading one could block forever or never end."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("is not a regular file")
    return st.st_size


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names, checked as ``tag=`` is; ``None`` when there is no such file. Anything
    else that is not a tag (empty, binary, padded junk, a path) is a ``ValueError`` naming the file and the
    checkpoints present."""
    path = root / LATEST_FILE

    def refuse(what: str) -> ValueError:
        return ValueError(f"load_checkpoint: {path} {what}, so it names no checkpoint ({describe_tags(root)}); "
                          "pass tag= to load one of them, or write its tag into that file")

    try:
        size = _regular_file_size(path)
    except ValueError as exc:
        raise refuse(str(exc)) from None
    if size is None:
        return None
    if size > MAX_LATEST_BYTES:
        raise refuse(f"is {size} bytes long, far more than a tag")
    try:
        raw = path.read_bytes()[:MAX_LATEST_BYTES + 1]
    except OSError as exc:
        raise refuse(f"cannot be read ({type(exc).__name__}: {exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse("holds binary data, not a tag") from None
    tag = text.strip()
    if not tag:
        raise refuse("is empty")
    problem = _tag_problem(tag)
    if problem is not None:
        raise refuse(f"holds {tag[:80]!r}, which is no tag: {problem}")
    return tag


def _read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    path = directory / MANIFEST_FILE
    try:
        size = _regular_file_size(path)
        if size is None:
            return None
        if size > MAX_MANIFEST_BYTES:
            raise ValueError(f"is {size} bytes long")
        data = json.loads(path.read_bytes())
    except (ValueError, OSError) as exc:  # json's errors are ValueErrors, UnicodeDecodeError too
        raise ValueError(f"{path} is not a readable manifest ({type(exc).__name__}: {exc}), so the checkpoint "
                         "cannot be verified") from None
    files = data.get("files") if isinstance(data, dict) else None
    ok = (isinstance(files, dict) and data.get("algorithm") == "sha256"
          and all(isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("sha256"), str)
                  and isinstance(v.get("size"), int) for k, v in files.items()))
    if not ok:
        raise ValueError(f"{path} is not a manifest of sha256 digests, so the checkpoint cannot be verified")
    return files


def _inside(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and "\\" not in name


def verify(directory: Path, share: tuple[int, int] = (0, 1)) -> tuple[bool, list[str]]:
    """Check ``directory`` against its manifest without loading anything: every listed file present with
    its size and sha256, no unlisted file. ``share=(i, n)`` hashes every n-th listed file from the i-th (the
    ranks of a ZeRO run split the reading); the listing checks are done by every share. Returns
    ``(has_manifest, problems)``: no manifest and no problem is a checkpoint saved by DeepSpeed itself or
    before manifests; any problem refuses the load."""
    if (directory / INCOMPLETE_FILE).exists():
        return False, [f"the save into {directory} did not complete (it was interrupted: {INCOMPLETE_FILE} is "
                       "still there), so its files cannot be trusted"]
    try:
        files = _read_manifest(directory)
    except ValueError as exc:
        return True, [str(exc)]
    if files is None:
        return False, []
    manifest = directory / MANIFEST_FILE
    problems = []
    bad_names = [name for name in files if not _inside(name)]
    if bad_names:
        problems.append(f"{manifest} lists paths outside its directory ({', '.join(map(repr, bad_names[:3]))})")
    names = sorted(name for name in files if _inside(name))
    index, count = share
    for i, name in enumerate(names):
        path, entry = directory / name, files[name]
        try:
            size = _regular_file_size(path)
        except ValueError:
            problems.append(f"{path} is not a regular file")
            continue
        if size is None:
            problems.append(f"{path} is missing (listed in {manifest})")
        elif size != entry["size"]:
            problems.append(f"{path} is {size} bytes, but {entry['size']} were saved (truncated or changed; "
                            f"{manifest})")
        elif i % count == index and _sha256(path) != entry["sha256"]:
            problems.append(f"{path} does not match its sha256 digest in {manifest} (corrupt or changed since "
                            "the save)")
    unlisted = sorted(set(tag_files(directory)) - set(files))
    if unlisted:
        problems.append(f"{directory} holds files the save did not write ({', '.join(unlisted[:5])}; not in "
                        f"{manifest}); remove them")
    return True, problems


def refusal(directory: Path, problems: list[str]) -> ValueError:
    """One ``ValueError`` for what :func:`verify` (or an RNG check) found, with the checkpoints present."""
    unique = list(dict.fromkeys(problems))
    return ValueError(f"load_checkpoint: {'; '.join(unique)}. Nothing was loaded ({describe_tags(directory.parent)}"
                      "; pass tag= to load another)")


def warn_unverified(directory: Path) -> None:
    warnings.warn(f"load_checkpoint: {directory} has no {MANIFEST_FILE} (saved by DeepSpeed itself, or before "
                  "hybrid-engine wrote manifests), so its files are loaded unverified", UserWarning, stacklevel=5)


def rng_problem(state: Any) -> str | None:
    """Why ``state`` is not the torch RNG states a checkpoint holds (``{"cpu": ByteTensor, "device": ...}``)."""
    if not isinstance(state, dict) or "cpu" not in state:
        return "holds no RNG states (a dict with 'cpu')"
    cpu, device = state["cpu"], state.get("device")
    expected = torch.get_rng_state().numel()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.numel() != expected:
        return f"holds a CPU RNG state that is not a uint8 tensor of {expected} bytes"
    if device is not None and (not isinstance(device, torch.Tensor) or device.dtype != torch.uint8):
        return "holds a device RNG state that is not a uint8 tensor"
    return None
