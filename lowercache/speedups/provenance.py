"""Shared provenance: ``from_node`` chains are shared rather than deep-copied on every retrace, since nothing mutates a NodeSource.

Why it is exact, and figures: docs/speedups.md#provenance.
"""

from __future__ import annotations

from typing import Any

from torch.fx.traceback import NodeSource

from .patching import Patch

_original_init = NodeSource.__init__


class _NodeView:
    """What NodeSource reads from a node, minus the chain it would deep-copy."""

    __slots__ = ("name", "target", "graph", "meta")

    def __init__(self, node: Any):
        self.name = node.name
        self.target = node.target
        self.graph = node.graph
        self.meta: dict[str, Any] = {}


def _shared_init(self: NodeSource, node: Any, pass_name: str = "", action: Any = None) -> None:
    if node is None or "from_node" not in node.meta:
        _original_init(self, node, pass_name, action)
        return
    _original_init(self, _NodeView(node), pass_name, action)
    self.from_node = list(node.meta["from_node"])


def _apply() -> None:
    NodeSource.__init__ = _shared_init


def _undo() -> None:
    NodeSource.__init__ = _original_init


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
shared_provenance = _patch.active
