"""ExecuTorch's ``GroupBasedPartitioner`` (XNNPACK's) asks whether merging two partitions would make a cycle with
``set.isdisjoint`` instead of a generator over every downstream node: the same answer, without the Python loop.

Why it is exact, and figures: docs/speedups.md#groupmerge.
"""

from __future__ import annotations

from typing import Any

from .patching import Patch
from .sourcepin import source_digest

# sha256 over the sources of GroupBasedPartitioner._can_merge_partitions and the group partitioner's
# _DependencyViewer.downstreams_of (executorch 1.5.1).
_AUDITED_DIGEST = "13704723bd1901794e396b5a925e6ab5f358502865f0e9feffeeb26c5ed09e09"
_originals: dict[str, Any] = {}


def _module() -> Any:
    from executorch.exir.backend.canonical_partitioners import group_partitioner

    return group_partitioner


def sources_digest() -> str | None:
    """Digest of the ExecuTorch sources this module reproduces."""
    g = _module()
    return source_digest(g.GroupBasedPartitioner._can_merge_partitions, g._DependencyViewer.downstreams_of)


def can_merge_partitions(self: Any, p1: Any, p2: Any, partitions_by_id: Any) -> bool:
    """``GroupBasedPartitioner._can_merge_partitions`` of ExecuTorch 1.5.1, with one line changed.

    Stock asks ``any(n in combined_nodes for n in downstream_nodes)`` of each external user's downstream set. That
    is true exactly when the two sets share a node, which is ``not combined_nodes.isdisjoint(downstream_nodes)``:
    fx nodes hash and compare by identity, so no user code runs either way, and the sets are read, not changed.
    The external users are visited in the same order and the same ``downstreams_of`` calls are made, so the
    viewer's lazily made entries are the same too.
    """
    from torch.fx.passes.utils.fuser_utils import validate_partition

    p1_nodes = set(partitions_by_id[p1].nodes.keys())
    p2_nodes = set(partitions_by_id[p2].nodes.keys())
    combined_nodes = p1_nodes.union(p2_nodes)

    user_nodes = []
    for node in combined_nodes:
        for user in node.users:
            if user not in combined_nodes:
                user_nodes.append(user)

    for external_node in user_nodes:
        downstream_nodes = self.dependency_viewer.downstreams_of(external_node)
        if not combined_nodes.isdisjoint(downstream_nodes):
            return False

    if not validate_partition(list(combined_nodes)):
        return False

    return True


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    partitioner = _module().GroupBasedPartitioner
    _originals["can_merge"] = partitioner.__dict__["_can_merge_partitions"]
    partitioner._can_merge_partitions = can_merge_partitions


def _undo() -> None:
    if "can_merge" in _originals:
        _module().GroupBasedPartitioner._can_merge_partitions = _originals.pop("can_merge")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
