"""ExecuTorch's dataclass JSON encoder (XNNPACK's delegate graphs go through it) reads each class's type hints once
per lowering instead of once per field of every object it writes.

Why it is exact, and figures: docs/speedups.md#jsonhints.
"""

from __future__ import annotations

import threading
from typing import Any

from .patching import Patch
from .sourcepin import source_digest

# sha256 over the sources of _DataclassEncoder.default, _is_strict_union, _get_class_from_union and _json_to_dataclass,
# the functions of executorch.exir._serialize._dataclass that call its get_type_hints (executorch 1.5.1).
_AUDITED_DIGEST = "2950a4e65a4cd5328346dc5c0d76a7eece7d3e10918cc5ec3120a91abd3a6e9c"
_originals: dict[str, Any] = {}
_hints: dict[type, dict[str, Any]] = {}
_lock = threading.Lock()


def _module() -> Any:
    from executorch.exir._serialize import _dataclass

    return _dataclass


def sources_digest() -> str | None:
    """Digest of the ExecuTorch sources whose ``get_type_hints`` calls this module answers."""
    d = _module()
    return source_digest(d._DataclassEncoder.default, d._is_strict_union, d._get_class_from_union, d._json_to_dataclass)


def type_hints(obj: Any) -> dict[str, Any]:
    """``typing.get_type_hints(obj)``, computed once per class while the patch is on.

    The encoder asks it for every field of every dataclass it writes, of the object's class: about 13,600 times for
    DeiT-tiny's 50 XNNPACK graphs, for a few dozen classes. The answer depends on the class's annotations and its
    module's globals, which a lowering does not change; the callers only index it. Anything but a class, and a call
    that raises, goes to ``typing`` every time (nothing is kept).
    """
    if not isinstance(obj, type):
        return _originals["get_type_hints"](obj)
    found = _hints.get(obj)
    if found is None:
        found = _originals["get_type_hints"](obj)
        with _lock:
            _hints.setdefault(obj, found)
    return found


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    module = _module()
    _originals["get_type_hints"] = module.get_type_hints
    module.get_type_hints = type_hints


def _undo() -> None:
    if "get_type_hints" in _originals:
        _module().get_type_hints = _originals.pop("get_type_hints")
    _hints.clear()


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
