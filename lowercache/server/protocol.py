"""What a request to the warm server may hold: each field's check, run before any of it is used."""

from __future__ import annotations

import codecs
from typing import Any

from .. import process_state, sweep
from ..config import MAX_SECONDS


# What each request may hold: a field's check returns why a value is refused, or None. Every request is checked against
# this before any of it is used, so no value a client can send (a wrong type, a huge number, a NUL) reaches code that
# could fail on it in the server; only hello, status and stop take no fields.
_MAX_ITEMS = 1 << 16  # argv, sys.path and environment entries: far beyond any command line (ARG_MAX is 2 MiB)
_MAX_COLUMNS = 1 << 16


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and "\0" not in value else "a string without NUL"


def _texts(count: int | None = None) -> Any:
    def check(value: Any) -> str | None:
        if not isinstance(value, list) or len(value) > _MAX_ITEMS or (count is not None and len(value) != count):
            return f"a list of {count or 'at most ' + str(_MAX_ITEMS)} strings"
        return next((_text(v) for v in value if _text(v) is not None), None)

    return check


def _absolute(value: Any) -> str | None:
    return _text(value) or (None if value.startswith("/") else "an absolute path")


def _environment(value: Any) -> str | None:
    if not isinstance(value, dict) or len(value) > _MAX_ITEMS:
        return "an object of strings"
    for name, text in value.items():
        if not name or "=" in name or _text(name) or _text(text):
            return "an object of strings, names without '=' or NUL"
    return None


def _whole(low: int, high: int) -> Any:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"a whole number from {low} to {high}"

    return check


def _timeout(value: Any) -> str | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_SECONDS
    return None if ok else f"null or a number of seconds from 0 to {MAX_SECONDS}"


def _codecs(lookup: Any) -> Any:
    def check(value: Any) -> str | None:  # null: the stream had none (a replaced stream), the child takes the default
        if not isinstance(value, list) or len(value) != 2 or not all(v is None or isinstance(v, str) for v in value):
            return "two names Python knows (or null)"
        try:
            for name in value:
                if name is not None:
                    lookup(name)
        except (LookupError, ValueError):  # ValueError: a NUL in the name
            return "two names Python knows (or null)"
        return None

    return check


def _flags(value: Any) -> str | None:
    return None if isinstance(value, list) and len(value) == 2 and all(isinstance(v, bool) for v in value) else "two booleans"


def _files(value: Any) -> str | None:
    def one(file: Any) -> bool:
        return isinstance(file, list) and len(file) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in file)

    def stream(files: Any) -> bool:
        return isinstance(files, list) and len(files) <= sweep.MAX_STREAM_FILES and all(one(f) for f in files)

    ok = isinstance(value, list) and len(value) == 2 and all(stream(files) for files in value)
    return None if ok else f"two lists of at most {sweep.MAX_STREAM_FILES} files (a device and an inode each)"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _identity(value: Any) -> str | None:
    return None if isinstance(value, dict) else "an object"


_COMMON = {"argv": _texts(), "cwd": _absolute, "env": _environment, "timeout": _timeout, "identity": _identity,
           "process": process_state.check}
_FIELDS: dict[str, dict[str, Any]] = {
    "hello": {},
    "status": {},
    "stop": {},
    "warm": {"targets": _texts()},
    "run": {**_COMMON, "path": _texts(), "tty": _flags, "columns": _whole(0, _MAX_COLUMNS), "lines": _whole(0, _MAX_COLUMNS),
            "encoding": _codecs(codecs.lookup), "errors": _codecs(codecs.lookup_error), "files": _files, "warned": _texts(),
            "confirm": _boolean},
    "exec": {**_COMMON, "executable": _absolute},
}
_REQUIRED = {"warm": ("targets",), "run": ("argv", "cwd", "env", "path", "process"), "exec": ("argv", "cwd", "env", "executable", "process")}


def request_error(message: Any) -> str | None:
    """Why ``message`` is not a request this server takes (one line naming the field), or None when every field is sound."""
    if not isinstance(message, dict):
        return "a request that is not a JSON object"
    op = message.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        return f"unknown request {str(op)[:40]!r}"
    fields = _FIELDS[op]
    for name, value in message.items():
        if name == "op":
            continue
        if name not in fields:
            return f"{op} request: unknown field {str(name)[:40]!r}"
        why = fields[name](value)
        if why is not None:
            return f"{op} request: field {name!r} must be {why}"
    missing = [name for name in _REQUIRED.get(op, ()) if name not in message]
    return f"{op} request: missing field(s) {', '.join(missing)}" if missing else None
