"""Splitting a partition out of a program re-sorts the whole graph: the sorted graph is made of the very nodes,
moved into a new graph in the order torch's copy would make, instead of a copy of each.

``create_submodule_from_nodes`` (ExecuTorch) ends with torch's ``legalize_graph``, which builds a new graph by
``node_copy`` of every node in a topological order: once per partition, so 50 copies of a DeiT-tiny's graph for
XNNPACK (about 1 s of its lowering). Nothing but the graph module holds the old nodes after the call, so moving
them gives the same graph: the same order, names, arguments, users in order, metadata (a shallow copy, as
``node_copy`` makes), name space and lookup table.

Why it is exact, and figures: docs/speedups.md#legalize.
"""

from __future__ import annotations

import collections
import copy
import operator
from typing import Any

from .patching import Patch
from .sourcepin import source_digest

# sha256 over the sources below (torch 2.13.0, executorch 1.5.1).
_AUDITED_DIGEST = "85d5be6bad518665d95a70de38c0be80c5f7923d292416f963e613f7957ee161"
_originals: dict[str, Any] = {}


def _modules() -> tuple[Any, Any, Any, Any]:
    import torch.fx
    from executorch.exir import lowered_backend_module
    from executorch.exir.backend import backend_api
    from torch.fx.passes import tools_common

    return torch.fx, tools_common, lowered_backend_module, backend_api


def sources_digest() -> str | None:
    """Digest of the sources this module reproduces (the sort, the copy it stands for) and of the callers whose use of
    the graph afterwards the argument rests on."""
    fx, tools_common, lowered, backend_api = _modules()
    graph, node = fx.Graph, fx.Node
    return source_digest(tools_common.legalize_graph, graph.__init__, graph.node_copy, graph.create_node,
                         node.__init__, fx.graph._Namespace.create_name,
                         lowered.create_submodule_from_nodes, backend_api._partition_and_lower_one_graph_module,
                         backend_api._create_partitions_in_graph_module)


def _prioritized() -> list[Any]:
    import torch

    return [operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod, operator.le,
            operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
            torch.ops.aten.sym_constrain_range.default, torch.ops.aten.sym_constrain_range_for_size.default,
            torch.ops.aten._assert_async.msg, torch.ops.aten.scalar_tensor.default, torch.ops.aten._assert_scalar.default]


def _order(nodes: list[Any], prioritized: list[Any]) -> list[Any]:
    """``legalize_graph``'s order: its queue, its in-degrees, its preference for the prioritized operators."""
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue: collections.deque = collections.deque()
    for node in nodes:
        if indeg[node] == 0:
            queue.append(node)
    order = []
    while len(queue) > 0:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    return order


def legalize_graph(gm: Any) -> Any:
    """torch's ``legalize_graph`` for ``create_submodule_from_nodes``: the same graph, of the same nodes moved.

    Stock's own call runs instead when the graph has a cycle (its error), when a node takes an argument from another
    graph (its error), when a node carries an attribute of its own (a copy would drop it) or when the new graph's
    name space would rename a node (a copy would rename it).
    """
    import torch.fx
    from torch.fx.node import map_arg

    old = gm.graph
    nodes = list(old.nodes)
    order = _order(nodes, _prioritized())
    if len(order) < len(nodes) or any(vars(node) for node in order):
        return _originals["legalize_graph"](gm)
    members = set(nodes)
    if any(used not in members for node in order for used in node._input_nodes):
        return _originals["legalize_graph"](gm)  # an argument from another graph: stock's copy fails on it
    new = torch.fx.Graph()
    space = new._graph_namespace
    for node in order:
        if space.create_name(node.name, None) != node.name:
            return _originals["legalize_graph"](gm)
    same = lambda x: x  # noqa: E731  (node_copy maps each argument node to its copy: here, to itself)
    empty = torch.fx.immutable_collections.immutable_dict
    table = new._find_nodes_lookup_table
    for node in order:  # as node_copy, create_node and Node.__init__ make each copy, in the copies' order
        # new argument containers, as map_arg makes them; setting them takes the node off its inputs' users and
        # puts it back last, so every node's users end in this order, the order a copy's users are made in
        node._update_args_kwargs(map_arg(node.args, same) or (), map_arg(node.kwargs, same) or empty())
        object.__setattr__(node, "graph", new)
        object.__setattr__(node, "meta", copy.copy(node.meta))
        object.__setattr__(node, "_repr_fn", None)
        space.associate_name_with_obj(node.name, node)
        new._insert(node)
        table.insert(node)
        new._len += 1
    old._len = 0  # each move took its node off the old graph's list (stock's kept its nodes, which nothing reads again)
    new._codegen = old._codegen
    gm.graph = new
    return gm


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    _, tools_common, lowered, _ = _modules()
    if lowered.legalize_graph is not tools_common.legalize_graph:
        return
    _originals["legalize_graph"] = lowered.legalize_graph
    lowered.legalize_graph = legalize_graph


def _undo() -> None:
    if "legalize_graph" in _originals:
        _, _, lowered, _ = _modules()
        lowered.legalize_graph = _originals.pop("legalize_graph")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
