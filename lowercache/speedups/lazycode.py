"""Deferred GraphModule code generation while lowering, since the pass pipelines interpret graphs and generated code is a function of the graph alone.

Why it is exact, and figures: docs/speedups.md#lazycode.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .patching import Patch

_STALE = "_lowercache_code_stale"
_originals: dict[str, Any] = {}
_stock: dict[str, Any] = {}  # torch's own methods, kept for modules that outlive the patch


def materialize(gm: Any) -> Any:
    """Generate ``gm``'s code now (stock ``recompile``); returns its PythonCode."""
    gm.__dict__.pop(_STALE, None)
    return _stock["recompile"](gm)


class _DeferredCode:
    """What a deferred ``recompile()`` returns: the PythonCode, produced on first use."""

    def __init__(self, gm: Any) -> None:
        self._gm = gm
        self._code: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._code is None:
            self._code = materialize(self._gm)
        return getattr(self._code, name)


class _DeferredForward:
    """``forward`` of a stale module: any access (a call, ``inspect.signature``,
    which tracers use to name placeholders) generates the code first."""

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        materialize(instance)
        return type(instance).forward.__get__(instance, owner)


_deferred_forward = _DeferredForward()


def _deferred_recompile(self: Any) -> Any:
    from torch.fx.graph import _PyTreeCodeGen
    from torch.fx.graph_module import GraphModule

    if isinstance(self._graph._codegen, _PyTreeCodeGen):
        self._in_spec = self._graph._codegen.pytree_info.in_spec
        self._out_spec = self._graph._codegen.pytree_info.out_spec
    self.__dict__[_STALE] = True
    type(self).forward = _deferred_forward
    for child in self.children():
        if isinstance(child, GraphModule):
            child.recompile()
    return _DeferredCode(self)


def _code(self: Any) -> str:
    if self.__dict__.get(_STALE):
        materialize(self)
    return _stock["code"].fget(self)


# What a stale module's ``str()`` gives a message the root logger discards: nobody reads it.
DISCARDED = "<GraphModule: code not generated for a discarded debug message>"
# ExecuTorch's functions that put a whole module in a root ``logging.debug`` f-string, by their code objects.
_DEBUG_SITES: list[Any] = []
_DEBUG_SITE_NAMES = ("executorch.exir.backend.backend_api:_create_partitions_in_graph_module",)


def _discarded(frame: Any) -> bool:
    """``str()`` was called to build a root-logger debug message that logging will drop.

    ``_create_partitions_in_graph_module`` formats the whole graph module into
    ``logging.debug(f"Partitioned graph module: {gm}")`` once per partition; the
    root logger drops it unless debug is on, which is read here, right before the
    call. Materializing for it would generate the whole program's code once per
    partition (50 times on DeiT-tiny for XNNPACK).
    """
    if frame is None or logging.getLogger().isEnabledFor(logging.DEBUG):
        return False
    if not _DEBUG_SITES:
        from .sourcepin import code_of

        _DEBUG_SITES.extend(code_of(name) for name in _DEBUG_SITE_NAMES)
    return frame.f_code in _DEBUG_SITES


def _str(self: Any) -> str:
    if self.__dict__.get(_STALE):
        if _discarded(sys._getframe(1)):
            return DISCARDED
        materialize(self)
    return _stock["__str__"](self)


def _apply() -> None:
    """Defer ``recompile``; ``code`` and ``str`` materialize stale modules, and stay
    installed after the patch is undone, so a module that outlives the lowering
    still gets its code on first use (they change nothing for other modules)."""
    from torch.fx.graph_module import GraphModule

    if not _stock:
        _stock.update(recompile=GraphModule.recompile, code=GraphModule.code, __str__=GraphModule.__str__)
        GraphModule.code = property(_code)
        GraphModule.__str__ = _str
    _originals["recompile"] = GraphModule.recompile
    GraphModule.recompile = _deferred_recompile


def _undo() -> None:
    from torch.fx.graph_module import GraphModule

    GraphModule.recompile = _originals.pop("recompile")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
