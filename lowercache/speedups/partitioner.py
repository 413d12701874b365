"""``CapabilityBasedPartitioner.propose_partitions`` with reachability held as bit sets, since every question it asks
of its precomputed closure (which partitions hold a node downstream of these) has the same answer from them.

Why it is exact, and figures: docs/speedups.md#partitioner.
"""

from __future__ import annotations

import collections
import itertools
import operator
from typing import Any, Iterable

from .patching import Patch
from .sourcepin import source_digest

# sha256 over the sources of _DependencyViewer, CapabilityBasedPartitioner.__init__ and .propose_partitions,
# and Partition in torch.fx.passes.infra.partitioner (torch 2.13.0).
_AUDITED_DIGEST = "4e588c391def00c85a40788bb2caabd1020aa6286f70edd79a71f1b1726ee250"
_originals: dict[str, Any] = {}


def _module() -> Any:
    from torch.fx.passes.infra import partitioner

    return partitioner


def sources_digest() -> str | None:
    """Digest of the torch sources whose behaviour this module reproduces."""
    p = _module()
    return source_digest(p._DependencyViewer, p.CapabilityBasedPartitioner.__init__,
                         p.CapabilityBasedPartitioner.propose_partitions, p.Partition)


class DependencyViewer:
    """torch's ``_DependencyViewer`` that keeps reachability as bit sets and builds torch's closure only when read.

    Both are made from each node's users as they are at construction (what
    torch's closure is built from), so they hold the same reachability
    whatever happens to the graph later. A graph whose nodes are not in
    topological order (torch's one-pass closure would miss paths) is marked,
    and ``propose_partitions`` then takes torch's own code.
    """

    def __init__(self, graph_module: Any) -> None:
        nodes = list(graph_module.graph.nodes)
        self.nodes = nodes
        self.index = {node: i for i, node in enumerate(nodes)}
        self.users = {node: tuple(node.users) for node in nodes}
        self.topological = all(self.index.get(user, -1) > i for i, node in enumerate(nodes) for user in self.users[node])
        self._down: list[int] | None = None
        self._closure: Any = None

    @property
    def down(self) -> list[int]:
        """Per node (by index), the bit set of the nodes downstream of it (itself excluded)."""
        if self._down is None:
            index, down = self.index, [0] * len(self.nodes)
            for i in range(len(self.nodes) - 1, -1, -1):
                bits = 0
                for user in self.users[self.nodes[i]]:
                    j = index[user]
                    bits |= (1 << j) | down[j]
                down[i] = bits
            self._down = down
        return self._down

    @property
    def downstreams(self) -> Any:
        """The closure torch builds, built now from the users seen at construction."""
        if self._closure is None:
            closure = collections.defaultdict(set)
            for node in reversed(self.nodes):
                for output_node in self.users[node]:
                    closure[node].add(output_node)
                    closure[node].update(closure[output_node])
            self._closure = closure
        return self._closure

    def downstreams_of(self, node: Any) -> set:
        return self.downstreams[node]

    def reach(self, starts: Iterable[Any]) -> tuple[int, list]:
        """The bit set of ``starts`` and every node downstream of one; and the starts not seen at construction
        (for torch they reach only themselves)."""
        bits, unseen = 0, []
        index, down = self.index, self.down
        for node in starts:
            i = index.get(node)
            if i is None:
                unseen.append(node)
            else:
                bits |= (1 << i) | down[i]
        return bits, unseen


class _Members:
    """Each live partition's nodes as a bit set, kept in step with ``assignment``."""

    def __init__(self, viewer: DependencyViewer):
        self.index = viewer.index
        self.bits: dict[int, int] = {}

    def add(self, partition_id: int, node: Any) -> None:
        i = self.index.get(node)
        if i is not None:
            self.bits[partition_id] = self.bits.get(partition_id, 0) | (1 << i)

    def remove(self, partition_id: int, node: Any) -> None:
        i = self.index.get(node)
        if i is not None:
            self.bits[partition_id] &= ~(1 << i)

    def merge(self, merge_id: int, removed_id: int) -> None:
        self.bits[merge_id] = self.bits.get(merge_id, 0) | self.bits.pop(removed_id, 0)

    def hit(self, reach: int) -> list[int]:
        """The live partitions holding a node of ``reach``."""
        return [partition_id for partition_id, bits in self.bits.items() if bits & reach]


def _propose_partitions(self: Any) -> list:
    """torch 2.13's ``propose_partitions`` with the two closure walks answered from bit sets."""
    viewer = self.dependency_viewer
    if type(viewer) is not DependencyViewer or not viewer.topological:
        return _originals["propose_partitions"](self)
    Partition = _module().Partition
    _get_qualified_name = _module()._get_qualified_name

    partition_map: dict[int, set[int]] = collections.defaultdict(set)
    assignment: dict[Any, int] = {}
    partitions_by_id: dict[int, Any] = {}
    nodes_order: dict[Any, int] = {}
    partitions_order: dict[int, int] = {}
    partition_users: dict[int, set[Any]] = {}
    new_partition_id = itertools.count()
    members = _Members(viewer)

    def reached(user_nodes: Iterable[Any]) -> tuple[int, list[int]]:
        """The nodes torch's walk visits (the users and their closures), and the partitions holding one of them."""
        reach, unseen = viewer.reach(user_nodes)
        hit = members.hit(reach)
        hit.extend(assignment[node] for node in unseen if node in assignment)
        return reach, hit

    def downstream_partitions(user_nodes: Iterable[Any], source_ids: Iterable[int]) -> set[int]:
        # torch: each visited node's partition and that partition's own set; a union, so once per partition
        found: set[int] = set()
        for target_id in reached(user_nodes)[1]:
            found.add(target_id)
            found.update(partition_map[target_id])
        found.difference_update(set(source_ids))
        return found

    def maybe_merge_partition(self_id: int, other_id: int) -> tuple[int, bool]:
        self_nodes = partitions_by_id[self_id].nodes
        other_nodes = partitions_by_id[other_id].nodes

        def find_cycle(all_user_nodes: set) -> bool:
            # torch: True when a visited node is in either partition, or in a partition whose set names either
            reach, hit = reached(all_user_nodes)
            if self_id in hit or other_id in hit:
                return True
            return any(self_id in partition_map[p] or other_id in partition_map[p] for p in hit)

        all_user_nodes = partition_users[self_id] | partition_users[other_id]
        all_user_nodes.difference_update(other_nodes, self_nodes)
        if find_cycle(all_user_nodes):
            return self_id, False
        merge_id, removed_id = self_id, other_id
        if len(self_nodes) < len(other_nodes):
            merge_id, removed_id = removed_id, merge_id
        partitions_by_id[merge_id].nodes.update(partitions_by_id[removed_id].nodes)
        for node in partitions_by_id[removed_id].nodes:
            assignment[node] = merge_id
        members.merge(merge_id, removed_id)
        del partitions_by_id[removed_id]
        partitions_order[merge_id] = min(partitions_order[merge_id], partitions_order[removed_id])
        del partitions_order[removed_id]
        partition_map[merge_id] = partition_map[merge_id].union(partition_map[removed_id])
        del partition_map[removed_id]
        partition_users[merge_id] = all_user_nodes
        del partition_users[removed_id]
        partition_map[merge_id].update(downstream_partitions(all_user_nodes, (merge_id, removed_id)))
        partition_map[merge_id].discard(merge_id)
        partition_map[merge_id].discard(removed_id)
        return merge_id, True

    def merge_single_node(node: Any, node_order: int | None, id: int | None) -> None:
        if node in assignment:
            partitions_by_id[assignment[node]].remove_node(node)
            members.remove(assignment[node], node)
        if id is None:
            assignment.pop(node)
        elif id not in partitions_by_id:
            assignment[node] = id
            if node_order is None:
                raise AssertionError("node_order is required for new partitions")
            partitions_by_id[id] = Partition(id=id, nodes=[node], node_orders=[node_order])
            members.add(id, node)
            partition_users[id] = set(node.users)
            partition_map[id].update(downstream_partitions(node.users, (id,)))
        else:
            assignment[node] = id
            partitions_by_id[id].add_node(node, node_order)
            members.add(id, node)

    logger = _module().logger
    logger.debug("Proposing partitions...")
    for node_order, node in enumerate(reversed(self.graph_module.graph.nodes)):
        merge_candidates: dict[int, None] = {}
        created_partition = False
        if self._is_node_supported(node) and node not in assignment:
            partition_id = next(new_partition_id)
            nodes_order[node] = partition_id
            partitions_order[partition_id] = partition_id
            merge_single_node(node, node_order, partition_id)
            merge_candidates[partition_id] = None
            created_partition = True
        if self.skip_horizontal_fusion:
            if created_partition:
                for user in node.users:
                    if user in assignment:
                        merge_candidates[assignment[user]] = None
        else:
            for partition_id, _ in sorted(partitions_order.items(), key=operator.itemgetter(1)):
                merge_candidates[partition_id] = None
        merge_candidates_list = list(merge_candidates.keys())
        if len(merge_candidates_list) > 1:
            self_id = merge_candidates_list[0]
            for other_id in merge_candidates_list[1:]:
                self_id, _ = maybe_merge_partition(self_id, other_id)

    for partition in partitions_by_id.values():
        partition.nodes = dict(sorted(partition.nodes.items(), key=operator.itemgetter(1), reverse=True))

    logger.debug("Reassigning getitem nodes to its producer node's partition...")
    while True:
        nodes_reassignment: dict[Any, int] = {}
        for node in self.graph_module.graph.nodes:
            is_tuple_output = True
            for user in node.users:
                if user.op != "call_function" or _get_qualified_name(user.target) != "_operator.getitem":
                    is_tuple_output = False
                    break
            if is_tuple_output:
                id = assignment.get(node)
                for user in node.users:
                    if assignment.get(user) != id:
                        nodes_reassignment[user] = id
        if not nodes_reassignment:
            break
        for node, id in nodes_reassignment.items():
            merge_single_node(node, None, id)

    if not self.allows_single_node_partition:
        logger.debug("Filtering out single node partitions...")
        non_compute_ops = {"torch.ops.aten.view", "_operator.getitem"}.union(set(self.non_compute_ops))
        partitions_to_remove: list[int] = []
        for id, partition in partitions_by_id.items():
            compute_node_count = 0
            for node in partition.nodes:
                if node.op == "call_function":
                    if not callable(node.target):
                        raise AssertionError(f"Expected callable target, got {type(node.target)}")
                    if _get_qualified_name(node.target) not in non_compute_ops:
                        compute_node_count += 1
                    if _get_qualified_name(node.target) in self.allowed_single_node_partition_ops:
                        compute_node_count += 1
            if compute_node_count <= 1:
                partitions_to_remove.append(id)
        for id in partitions_to_remove:
            del partitions_by_id[id]

    logger.debug("Partitions proposed:")
    for id, partition in partitions_by_id.items():
        logger.debug("partition #%s: %s", id, [node.name for node in partition.nodes])
    return [partition for partition in partitions_by_id.values() if partition.size() > 0]


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    p = _module()
    _originals["viewer"] = p._DependencyViewer
    _originals["propose_partitions"] = p.CapabilityBasedPartitioner.propose_partitions
    p._DependencyViewer = DependencyViewer
    p.CapabilityBasedPartitioner.propose_partitions = _propose_partitions


def _undo() -> None:
    if "viewer" not in _originals:
        return
    p = _module()
    p._DependencyViewer = _originals.pop("viewer")
    p.CapabilityBasedPartitioner.propose_partitions = _originals.pop("propose_partitions")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


def enabled() -> bool:
    """Whether the patch is installed right now."""
    import sys

    p = sys.modules.get("torch.fx.passes.infra.partitioner")
    return p is not None and p._DependencyViewer is DependencyViewer
