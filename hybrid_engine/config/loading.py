"""Reading a config source (dict, JSON file, base64 JSON, ``EngineConfig``) into one validated ``EngineConfig``.

Sources are parsed strictly (duplicate keys refused), and pydantic's errors are
turned into one ``ValueError`` naming each dotted field and the fix.

A config path must name a regular file of at most :data:`MAX_CONFIG_BYTES`,
holding a JSON object nested at most :data:`MAX_CONFIG_DEPTH` deep. It is opened
without blocking and checked on the open file, so a FIFO (which would block the
reader forever), a device (``/dev/zero`` and ``/dev/urandom`` never end,
``/dev/null`` reads as nothing) or a directory is refused by name before a byte
is read, and an empty file is an error, never the default config.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from collections.abc import Mapping
from typing import Any, Union

from pydantic import (
    ValidationError,
)

from hybrid_engine.config.schema import EngineConfig

__all__ = ["ConfigSource", "load_config"]


ConfigSource = Union[EngineConfig, Mapping[str, Any], str, "os.PathLike[str]"]


#: The largest config file read (a DeepSpeed config is a few KB).
MAX_CONFIG_BYTES = 4 * 2**20


#: The deepest nesting of objects and lists a config may have (DeepSpeed's configs nest 3 or 4 deep): deeper
#: ones are refused before they reach the recursive parts of parsing and validation (a RecursionError).
MAX_CONFIG_DEPTH = 32


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"])
        msg = err["msg"]
        if err["type"] == "value_error":
            # Our own messages already name the dotted path and the fix.
            lines.append(msg.removeprefix("Value error, "))
            continue
        text = f"{path}: {msg}" if path else msg
        if err["type"] != "missing":
            text += f" (got {err['input']!r})"
        lines.append(text)
    return "; ".join(lines)


class _Pairs(list):
    """One JSON object's ``(key, value)`` pairs in file order, so that a duplicated key survives parsing."""


def _from_pairs(value: Any, path: str, duplicates: list[str]) -> Any:
    """``value`` with its ``_Pairs`` turned into dicts; each duplicated key's dotted path added to ``duplicates``."""
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, item in value:
            where = f"{path}.{key}" if path else key
            if key in out and where not in duplicates:
                duplicates.append(where)
            out[key] = _from_pairs(item, where, duplicates)
        return out
    if isinstance(value, list):
        return [_from_pairs(item, f"{path}[{i}]", duplicates) for i, item in enumerate(value)]
    return value


def _parse_pairs(text: str, what: str) -> Any:
    """``text`` parsed keeping every object's pairs: JSON, else hjson (comments, unquoted keys, trailing
    commas) when the ``hjson`` package is installed, as DeepSpeed reads its configs."""
    try:
        return json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as exc:
        try:
            import hjson
        except ImportError:
            raise ValueError(f"{what} is not valid JSON: {exc}. DeepSpeed also reads hjson (comments, unquoted "
                             "keys); install the hjson package to load it here too") from exc
        try:
            return hjson.loads(text, object_pairs_hook=_Pairs)
        except hjson.HjsonDecodeError as hexc:
            raise ValueError(f"{what} is neither valid JSON ({exc}) nor valid hjson ({hexc})") from hexc


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests dicts/lists (or ``_Pairs``) more than ``limit`` deep; iterative, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, _Pairs):
            children: Any = [v for _, v in item]
        elif isinstance(item, Mapping):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _refuse_deep(value: Any, what: str) -> None:
    if _depth_exceeds(value, MAX_CONFIG_DEPTH):
        raise ValueError(f"{what} nests objects or lists more than {MAX_CONFIG_DEPTH} deep; a DeepSpeed config "
                         "nests 3 or 4 deep, so this is not one")


def _object_from(text: str, what: str) -> dict[str, Any]:
    if not text.strip():
        raise ValueError(f"config {what} is empty; an empty config is an error, not the default config: give a JSON object "
                         "such as {} for the defaults")
    duplicates: list[str] = []
    try:
        parsed = _parse_pairs(text, what)
    except RecursionError:
        raise ValueError(f"config {what} nests objects or lists deeper than can be parsed; a DeepSpeed config nests 3 or "
                         "4 deep, so this is not one") from None
    _refuse_deep(parsed, f"config {what}")
    data = _from_pairs(parsed, "", duplicates)
    if duplicates:
        raise ValueError(
            f"Duplicate keys in DeepSpeed config {what}: {', '.join(duplicates)} (JSON would keep only "
            "the last of each, and DeepSpeed refuses them); give each key once"
        )
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ValueError(f"config {what} must hold a JSON object, not {kind}")  # noqa: TRY004
    return data


def _decode_base64_config(source: str) -> str | None:
    """The text of a base64-encoded config (DeepSpeed accepts one in place of a path), or ``None``."""
    try:
        return base64.urlsafe_b64decode(source.encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError):  # binascii.Error is a ValueError
        return None


def _read_json(source: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """The config object of a JSON/hjson file, or of a base64-encoded config string (as DeepSpeed reads both),
    and where it came from, for error messages."""
    if not os.path.exists(source):
        text = _decode_base64_config(source) if isinstance(source, str) else None
        if text is not None and text.lstrip().startswith("{"):
            return _object_from(text, "(base64-encoded string)"), " (base64-encoded)"
        raise FileNotFoundError(f"config file not found: {os.fspath(source)} (nor is it a base64-encoded config)")
    if os.path.isdir(source):
        raise ValueError(f"config path {os.fspath(source)} is a directory; pass the path of the JSON config file "
                         "inside it")
    raw = _read_regular_file(os.fspath(source))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {os.fspath(source)} is not valid JSON: {exc}") from exc
    return _object_from(text, f"file {os.fspath(source)}"), f" in {os.fspath(source)}"


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe), which would block the reader until some writer closes it"),
               (stat.S_ISCHR, "a character device (such as /dev/null, /dev/zero or /dev/urandom), which reads as "
                              "nothing or never ends"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _read_regular_file(path: str) -> bytes:
    """The bytes of the regular file ``path``, at most :data:`MAX_CONFIG_BYTES`: opened without blocking (a FIFO
    would block ``open`` itself) and checked on the open descriptor, so nothing can swap the file in between."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"config file {path} cannot be opened: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((text for test, text in _FILE_KINDS if test(mode)), "not a regular file")
            raise ValueError(f"config path {path} is {kind}; pass the path of a JSON config file")
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ValueError(f"config file {path} cannot be read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB; a DeepSpeed config "
                         "is a few KB, so this is not one")
    return b"".join(chunks)


def load_config(source: ConfigSource, world_size: int | None = None) -> EngineConfig:
    """Validate ``source`` (dict, JSON file path or ``EngineConfig``) into an ``EngineConfig``.

    As with DeepSpeed, a file may be hjson (with the ``hjson`` package installed) and a
    string that is not a path may be a base64-encoded config.

    Batch sizes and ``inference_tp_size`` are checked against ``world_size``
    (default: :func:`world_size`, the launched data-parallel ranks).

    An ``EngineConfig`` is re-validated from its dump, so a config mutated after
    loading is checked again; the result is a new object. Every validation
    problem is a ``ValueError`` naming the dotted field.
    """
    where = ""
    if isinstance(source, EngineConfig):
        data: Any = source.dump_for_reload()
    elif isinstance(source, Mapping):
        _refuse_deep(source, "the config")
        data = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        data, where = _read_json(source)
    else:
        raise TypeError(
            f"load_config: argument 'source' must be a dict, a path to a JSON file or an "
            f"EngineConfig, not {type(source).__name__}"
        )
    try:
        return EngineConfig.model_validate(data, context={"world_size": world_size})
    except ValidationError as exc:
        raise ValueError(f"invalid engine config{where}: {_format_validation_error(exc)}") from exc
