"""Shared provenance: chains are shared inside the block, deep-copied outside."""

from __future__ import annotations

import torch
from torch.fx.traceback import NodeSource

from lowercache.speedups.provenance import shared_provenance


def _node_with_history():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.relu, (x,))
    node.meta["from_node"] = [NodeSource(x, "earlier_pass")]
    return node


def test_chain_is_shared_inside_and_restored_after():
    node = _node_with_history()
    with shared_provenance():
        shared = NodeSource(node, "a_pass")
        assert shared.from_node[0] is node.meta["from_node"][0]
        assert shared.name == node.name and shared.pass_name == "a_pass"
    copied = NodeSource(node, "a_pass")
    assert copied.from_node[0] is not node.meta["from_node"][0]
    assert copied.to_dict() == shared.to_dict()  # equal provenance either way
