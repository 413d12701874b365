"""lowercache's own imports kept blind to the user's modules, and the user's code given its own modules back.

A ``colorsys.py`` on ``PYTHONPATH`` (or beside the working directory of
``python -m lowercache.cli``) shadows the standard library's for everything
the process imports. Plain ``python s.py`` works when the script does not
need the real one, but lowercache's own imports (rich imports ``colorsys``)
would fail with a traceback. So lowercache imports its modules and their
dependencies with ``sys.path`` stripped of what the user put there
(``PYTHONPATH`` and ``sys.path[0]``), then forgets every module imported so
whose name the user's full path resolves to another file: the user's code,
run later in the same process (a model factory, a script under ``run``),
imports its own module, exactly as plain ``python`` would give it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

_OWN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory lowercache is imported from


def _norm(entry: str) -> str:
    return os.path.normpath(os.path.abspath(entry or os.curdir))


def user_entries(path: list[str]) -> set[str]:
    """The entries of ``path`` the user put there: ``sys.path[0]`` (the script's or working directory) and ``PYTHONPATH``."""
    found = {_norm(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if path:
        found.add(_norm(path[0]))
    found.discard(_OWN_ROOT)  # lowercache itself must stay importable (a checkout on PYTHONPATH)
    return found


def _origin(spec: Any) -> str | None:
    origin = getattr(spec, "origin", None)
    return os.path.realpath(origin) if isinstance(origin, str) and os.path.isabs(origin) else origin


def _resolves_elsewhere(name: str) -> bool:
    """True when a fresh import of top-level ``name`` through the current ``sys.meta_path`` and ``sys.path`` finds another file."""
    module = sys.modules.get(name)
    loaded = _origin(getattr(module, "__spec__", None))
    if loaded is None:
        return False  # a namespace package or a module made in memory: nothing on a path to compare
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(name, None) if find is not None else None
        except (ImportError, ValueError):
            return False
        if spec is not None:
            return _origin(spec) != loaded
    return False


def _names_in(entries: set[str]) -> set[str] | None:
    """Top-level names the user's entries could provide (file names up to the first dot); None when one cannot be listed."""
    names: set[str] = set()
    for entry in entries:
        try:
            listing = os.listdir(entry)
        except FileNotFoundError:
            continue
        except OSError:
            return None  # a zip archive, or unreadable: every name is a candidate
        names.update(name.partition(".")[0] for name in listing)
    return names


@contextlib.contextmanager
def own_imports() -> Iterator[None]:
    """Import lowercache's modules in the body with the user's path entries left out; then forget those the user's shadow."""
    saved = list(sys.path)
    user = user_entries(saved)
    if not user:
        yield
        return
    before = set(sys.modules)
    sys.path[:] = [p for p in saved if _norm(p) not in user]
    try:
        yield
    finally:
        sys.path[:] = saved
        new = {name.partition(".")[0] for name in set(sys.modules) - before}
        candidates = _names_in(user)
        for top in sorted(new if candidates is None else new & candidates):  # a listing, not a path search per name
            if top in sys.modules and _resolves_elsewhere(top):
                for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                    del sys.modules[name]
