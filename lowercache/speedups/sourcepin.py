"""Digests of the upstream sources a speed-up was audited against.

A speed-up reproduces what a torch or ExecuTorch function does, so it is exact
only for the source it was read from. Every speed-up names those functions
and pins a sha256 of their source; when the installed source differs (another
release), the digest differs and the speed-up stays off.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from typing import Any, Iterable


# Digests by the function objects themselves: a function's code does not change while it lives, so the first
# reading of its source stands for it; the warm server's children would otherwise read and tokenize the
# same sources again per command.
_digests: dict[tuple[Any, ...], str | None] = {}


def source_digest(*fns: Any) -> str | None:
    """sha256 over the installed sources of ``fns``, in order; None when one has no source."""
    try:
        return _digests[fns]
    except KeyError:
        digest = _digests[fns] = _read_digest(fns)
        return digest
    except TypeError:  # an unhashable object
        return _read_digest(fns)


def _read_digest(fns: tuple[Any, ...]) -> str | None:
    h = hashlib.sha256()
    try:
        for fn in fns:
            h.update(inspect.getsource(fn).encode())
    except (OSError, TypeError):
        return None
    return h.hexdigest()


def resolve(target: str) -> Any:
    """The function ``module:Qual.name`` names, unwrapped from property, staticmethod and classmethod."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        owner = obj
        obj = vars(owner)[part] if isinstance(owner, type) and part in vars(owner) else getattr(owner, part)
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return obj


def code_of(target: str) -> Any:
    """The code object of the function ``module:Qual.name`` names, under any decorator that keeps ``__wrapped__``: how a
    speed-up knows its caller (``sys._getframe(1).f_code``) is that function."""
    return inspect.unwrap(resolve(target)).__code__


def targets_digest(targets: Iterable[str]) -> str | None:
    """sha256 over the installed sources of ``module:qualname`` targets; None when one is missing
    or has no source, ``"patched"`` when one is currently lowercache's own replacement."""
    try:
        fns = [resolve(t) for t in targets]
    except (ImportError, AttributeError, KeyError):
        return None
    if any(getattr(fn, "__module__", "").startswith("lowercache.") for fn in fns):
        return "patched"
    return source_digest(*fns)
