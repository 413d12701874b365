"""Memoized input mappings of ``ExportGraphSignature`` while a lowering runs.

``is_buffer``, ``is_param``, ``get_buffer`` and the Arm passes' constant
helpers ask ``graph_signature.inputs_to_buffers`` (or ``_parameters``,
``_lifted_tensor_constants``) once per node they look at, and each call
rebuilds the whole mapping from every input spec: about 26,000 rebuilds of
a 660-entry mapping in a DeiT-tiny lowering, some 2 s.

Here each mapping is built once per state of the signature and handed out
again while that state holds. The state is checked on every call, cheaply
and without trusting anything it cannot see change:

- the same ``input_specs`` list object, holding the same specs in the same
  order (the same objects, or equal ones: a spec's equality is that of its
  kind, argument, target and persistence);
- no attribute of any input spec or argument object has been set since (a
  counter that the patched ``__setattr__`` of ``InputSpec`` and of every
  argument class bumps; dataclass construction sets attributes the same way).

Those are everything the mappings read (spec kind, argument type and name,
target), so a memoized mapping equals the one the property would build. The
mapping is handed out read-only, as torch's is.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Mapping

from .patching import Patch

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
_originals: dict[Any, dict[str, Any]] = {}


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


def _memoized(name: str, build: Callable[[Any], Mapping[str, str]]) -> property:
    def get(self: Any) -> Mapping[str, str]:
        key = id(self)
        state = _memo.get(key)
        if state is None or not state.holds_for(self):
            state = _memo[key] = _State(self, key)
        mapping = state.mappings.get(name)
        if mapping is None:
            mapping = state.mappings[name] = types.MappingProxyType(dict(build(self)))
            _stats["built"] += 1
        else:
            _stats["served"] += 1
        return mapping

    get.__doc__ = f"``{name}``, built once per state of the input specs (lowercache.signature)."
    return property(get)


def _apply() -> None:
    from torch.export import graph_signature

    cls = graph_signature.ExportGraphSignature
    if any(getattr(graph_signature, c).__setattr__ is not object.__setattr__ for c in _ARGUMENT_CLASSES):
        return  # an argument class with its own __setattr__: changes could not be counted
    _originals[cls] = {name: vars(cls)[name] for name in _PROPERTIES}
    for name, prop in _originals[cls].items():
        setattr(cls, name, _memoized(name, prop.fget))
    for class_name in _ARGUMENT_CLASSES:
        owner = getattr(graph_signature, class_name)
        _originals[owner] = {"__setattr__": None}
        owner.__setattr__ = _counting_setattr


def _undo() -> None:
    for owner, attributes in _originals.items():
        for name, value in attributes.items():
            if value is None:
                delattr(owner, name)  # back to object.__setattr__
            else:
                setattr(owner, name, value)
    _originals.clear()
    _memo.clear()


def stats() -> dict[str, int]:
    """Mappings built and served from the memo since the process started."""
    return dict(_stats)


_patch = Patch(_apply, _undo)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
