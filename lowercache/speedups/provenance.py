"""Shared provenance: stop the quadratic ``from_node`` deep copies.

Every ExportPass retrace wraps each node's provenance in a new
``torch.fx.traceback.NodeSource``, whose constructor deep-copies the node's
whole ``from_node`` chain. The chain grows by one link per pass, so a
pipeline of ~200 passes spends a large share of its time copying history
(13% of a ViT lowering, see the anatomy notes).

NodeSource objects are never mutated after construction (ExecuTorch and
torch only read them), so sharing the existing chain instead of copying it
gives equal provenance at constant cost. Provenance never reaches an output
byte; the byte-identity tests check that.
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
