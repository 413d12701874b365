"""Partitions found by search equal torch's from its precomputed closure: the same partitions, in the same order,
with their nodes in the same order, on random graphs and every option."""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch.fx.passes.infra import partitioner as fx_partitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from lowercache.speedups import partitioner

OPS = [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.relu.default,
       torch.ops.aten.view.default]


class Supported(OperatorSupportBase):
    def __init__(self, names: set[str]):
        self.names = names

    def is_node_supported(self, submodules, node) -> bool:
        return node.name in self.names


def random_graph(rng: random.Random) -> tuple[torch.fx.GraphModule, set[str]]:
    """A random DAG in topological order: operators of one to three inputs, some with tuple outputs read by getitem."""
    g = torch.fx.Graph()
    nodes = [g.placeholder(f"x{i}") for i in range(rng.randint(1, 4))]
    for i in range(rng.randint(2, rng.choice([12, 40, 150]))):
        window = nodes[-rng.choice([2, 5, 30, len(nodes)]):]
        if rng.random() < 0.1:
            split = g.call_function(torch.ops.aten.split.Tensor, (rng.choice(window), 1))
            nodes.extend(g.call_function(operator.getitem, (split, k)) for k in range(rng.randint(1, 3)))
            continue
        op = rng.choice(OPS)
        arity = 1 if op in (torch.ops.aten.relu.default, torch.ops.aten.view.default) else 2
        nodes.append(g.call_function(op, tuple(rng.choice(window) for _ in range(arity))))
    sinks = [n for n in nodes if not n.users and n.op != "placeholder"] or nodes[-1:]
    g.output(tuple(sinks))
    density = rng.choice([0.3, 0.7, 0.9, 1.0])
    supported = {n.name for n in g.nodes if n.op == "call_function" and rng.random() < density}
    return torch.fx.GraphModule(torch.nn.Module(), g), supported


def proposed(gm: torch.fx.GraphModule, supported: set[str], options: dict) -> list:
    found = fx_partitioner.CapabilityBasedPartitioner(gm, Supported(supported), **options).propose_partitions()
    return [(p.id, [(n.name, order) for n, order in p.nodes.items()]) for p in found]


OPTIONS = [
    {},
    {"allows_single_node_partition": True},
    {"skip_horizontal_fusion": True},
    {"allows_single_node_partition": True, "skip_horizontal_fusion": True},
    {"non_compute_ops": ["aten.relu.default"], "allowed_single_node_partition_ops": ["aten.mul.Tensor"]},
]


@pytest.mark.quick
def test_audited_digest_matches_installed_torch():
    assert partitioner.sources_digest() == partitioner._AUDITED_DIGEST


@pytest.mark.parametrize("seed", range(8))
def test_random_graphs_give_torchs_partitions(seed):
    rng = random.Random(seed)
    for _ in range(40):
        gm, supported = random_graph(rng)
        for options in OPTIONS:
            stock = proposed(gm, supported, options)
            with partitioner.active():
                assert partitioner.enabled()
                ours = proposed(gm, supported, options)
            assert ours == stock, options


def test_the_closure_is_torchs_when_read():
    """Anyone who reads the viewer's closure gets torch's, built from the users at construction."""
    gm, _ = random_graph(random.Random(3))
    stock = fx_partitioner._DependencyViewer(gm)
    lazy = partitioner.DependencyViewer(gm)
    last = list(gm.graph.nodes)[-2]
    later = gm.graph.call_function(torch.ops.aten.relu.default, (last,))  # an edge added later counts for neither
    assert {n: set(s) for n, s in lazy.downstreams.items()} == {n: set(s) for n, s in stock.downstreams.items()}
    for node in lazy.nodes:  # and the bit sets hold the same reachability
        bits, unseen = lazy.reach([node])
        assert not unseen and {n for i, n in enumerate(lazy.nodes) if bits >> i & 1} - {node} == stock.downstreams_of(node)
    assert lazy.reach([later]) == (0, [later])


def test_a_graph_out_of_topological_order_takes_torchs_code():
    gm, supported = random_graph(random.Random(5))
    producer, user = next((n, u) for n in gm.graph.nodes if n.op == "call_function" for u in n.users if u.op == "call_function")
    producer.prepend(user)  # a user before its producer
    stock = proposed(gm, supported, {})
    with partitioner.active():
        viewer = partitioner.DependencyViewer(gm)
        assert not viewer.topological
        assert proposed(gm, supported, {}) == stock


def test_nodes_added_after_construction_are_treated_as_torch_treats_them():
    """torch's closure is built at construction: a node added later reaches only itself."""
    for seed in range(60):
        for options in OPTIONS[:4]:
            results = []
            for on in (False, True):
                rng = random.Random(100 + seed)
                gm, supported = random_graph(rng)
                with partitioner.active() if on else _nothing():
                    p = fx_partitioner.CapabilityBasedPartitioner(gm, Supported(supported), **options)
                    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
                    anchor = nodes[rng.randrange(len(nodes))]
                    with gm.graph.inserting_after(anchor):
                        later = gm.graph.call_function(torch.ops.aten.relu.default, (anchor,))
                    after = [n for n in nodes[nodes.index(anchor) + 1:] if n.target in OPS]  # getitems keep their one producer
                    later.append(gm.graph.call_function(torch.ops.aten.neg.default, (later,)))
                    if after:  # a node of the graph reads the added ones (still in topological order)
                        user = rng.choice(after)
                        user.args = (*user.args[:-1], later.next) if len(user.args) > 1 else (later.next,)
                    supported |= {n.name for n in (later, later.next) if rng.random() < 0.7}
                    results.append([(q.id, [n.name for n in q.nodes]) for q in p.propose_partitions()])
            assert results[0] == results[1], (seed, options)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
