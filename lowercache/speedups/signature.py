"""Memoized input mappings of ``ExportGraphSignature``, rebuilt only when the input specs they are read from change.

Why it is exact, and figures: docs/speedups.md#signature.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Mapping

from .patching import AttributePatch, Patch

_PROPERTIES = ("inputs_to_parameters", "inputs_to_buffers", "inputs_to_lifted_tensor_constants")
_ARGUMENT_CLASSES = (
    "InputSpec",
    "TensorArgument",
    "TokenArgument",
    "SymIntArgument",
    "SymFloatArgument",
    "SymBoolArgument",
    "CustomObjArgument",
    "ConstantArgument",
)

_version = 0  # bumped by every attribute set on an input spec or argument
_memo: dict[int, "_State"] = {}  # id(signature) -> its memoized state
_stats = {"built": 0, "served": 0}


class _State:
    """One signature's input specs as last seen, and the mappings built from them."""

    __slots__ = ("ref", "specs", "seen", "version", "mappings")

    def __init__(self, signature: Any, key: int):
        self.ref = weakref.ref(signature, lambda _, key=key: _memo.pop(key, None))
        self.specs = signature.input_specs
        self.seen = list(self.specs)
        self.version = _version
        self.mappings: dict[str, Mapping[str, str]] = {}

    def holds_for(self, signature: Any) -> bool:
        specs = signature.input_specs
        # List equality checks identity first, so this is a pointer walk when nothing
        # changed; a spec replaced by another compares field by field, and an equal
        # spec gives the same mapping entry.
        return self.ref() is signature and self.version == _version and self.specs is specs and specs == self.seen


def _counting_setattr(self: Any, name: str, value: Any) -> None:
    global _version
    _version += 1
    object.__setattr__(self, name, value)


def _memoized(name: str) -> property:
    def get(self: Any) -> Mapping[str, str]:
        key = id(self)
        state = _memo.get(key)
        if state is None or not state.holds_for(self):
            state = _memo[key] = _State(self, key)
        mapping = state.mappings.get(name)
        if mapping is None:
            (stock,) = _properties[name].originals.values()  # torch's property, as patched over
            mapping = state.mappings[name] = types.MappingProxyType(dict(stock.fget(self)))
            _stats["built"] += 1
        else:
            _stats["served"] += 1
        return mapping

    get.__doc__ = f"``{name}``, built once per state of the input specs (lowercache.speedups.signature)."
    return property(get)


def _argument_classes() -> list[type]:
    """The classes whose attribute sets are counted; none if one has its own ``__setattr__``."""
    from torch.export import graph_signature

    classes = [getattr(graph_signature, name) for name in _ARGUMENT_CLASSES]
    counted = (object.__setattr__, _counting_setattr)  # stock, or already counting
    return classes if all(any(c.__setattr__ is f for f in counted) for c in classes) else []


def _signature_class() -> list[type]:
    """``ExportGraphSignature``, only when changes to its specs can be counted."""
    from torch.export import graph_signature

    return [graph_signature.ExportGraphSignature] if _argument_classes() else []


_properties = {name: AttributePatch(_signature_class, name, _memoized(name)) for name in _PROPERTIES}
_counting = AttributePatch(_argument_classes, "__setattr__", _counting_setattr)


def _apply() -> None:
    for patch in _properties.values():
        patch.enable()
    _counting.enable()


def _undo() -> None:
    _counting.disable()
    for patch in _properties.values():
        patch.disable()
    _memo.clear()


def stats() -> dict[str, int]:
    """Mappings built and served from the memo since the process started."""
    return dict(_stats)


_patch = Patch(_apply, _undo)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
