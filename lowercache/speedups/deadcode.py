"""Dead-code elimination that keeps an operator node with users without asking whether it is impure, since stock keeps it whatever the answer.

Why it is exact, and figures: docs/speedups.md#deadcode.
"""

from __future__ import annotations

from typing import Any, Callable

from .sourcepin import source_digest
from .patching import Patch

# sha256 over the sources of Graph.eliminate_dead_code and Node.is_impure (torch 2.13.0).
_AUDITED_DIGEST = "77a59f571c67df23518ba2f39af5641ac2ef63b0dc803af356edf96100c338ff"
_originals: dict[str, Any] = {}


def sources_digest() -> str | None:
    """Digest of the torch sources whose behaviour this module relies on."""
    from torch.fx import Graph, Node

    return source_digest(Graph.eliminate_dead_code, Node.is_impure)


def _impure_random() -> bool:
    """The ``impure_random`` the stock default passes to ``Node.is_impure``."""
    import torch

    if torch._guards.TracingContext.try_get():
        return torch._inductor.config.fallback_random
    return True


def _eliminate_dead_code(self: Any, is_impure_node: Callable[[Any], bool] | None = None) -> bool:
    original = _originals["eliminate_dead_code"]
    if is_impure_node is not None:
        return original(self, is_impure_node)
    impure_random = _impure_random()

    def kept_or_impure(node: Any) -> bool:
        if node.op == "call_function" and node.users:
            return True  # has users: kept whatever the answer
        return node.is_impure(impure_random)

    return original(self, kept_or_impure)


def _apply() -> None:
    from torch.fx import Graph

    if sources_digest() == _AUDITED_DIGEST:
        _originals["eliminate_dead_code"] = Graph.eliminate_dead_code
        Graph.eliminate_dead_code = _eliminate_dead_code


def _undo() -> None:
    from torch.fx import Graph

    original = _originals.pop("eliminate_dead_code", None)
    if original is not None:
        Graph.eliminate_dead_code = original


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
