"""``groupmerge``: ExecuTorch's ``GroupBasedPartitioner`` gives the same answer to every merge question, and so the
same partitions in the same order, with the speed-up as without, on random graphs with random groups."""

from __future__ import annotations

import random

import pytest
import torch
from torch.fx.passes.infra.partitioner import Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from lowercache.speedups import groupmerge

OPS = [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.relu.default]


class Supported(OperatorSupportBase):
    def __init__(self, names: set[str]):
        self.names = names

    def is_node_supported(self, submodules, node) -> bool:
        return node.name in self.names


def _random_case(rng: random.Random):
    """A random DAG, the nodes a backend takes, and groups of supported nodes that must stay together."""
    g = torch.fx.Graph()
    nodes = [g.placeholder(f"x{i}") for i in range(rng.randint(1, 3))]
    for _ in range(rng.randint(3, rng.choice([15, 60]))):
        window = nodes[-rng.choice([2, 6, len(nodes)]):]
        op = rng.choice(OPS)
        args = (rng.choice(window),) if op is torch.ops.aten.relu.default else (rng.choice(window), rng.choice(window))
        nodes.append(g.call_function(op, args))
    g.output(tuple(rng.sample(nodes, k=min(3, len(nodes)))))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    supported = {n.name for n in ops if rng.random() < 0.8}
    free = [n for n in ops if n.name in supported]
    rng.shuffle(free)
    groups = []
    while free and rng.random() < 0.7:  # groups may span distant nodes, as shared choose_qparams groups do
        size = rng.randint(2, 4)
        groups.append(free[:size])
        free = free[size:]
    return gm, supported, [grp for grp in groups if grp]


def _partitions(gm, supported, groups, single):
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    partitioner = GroupBasedPartitioner(gm, Supported(supported), allows_single_node_partition=single,
                                        node_groups=groups or None)
    return [[n.name for n in p.nodes] for p in partitioner.propose_partitions()]


@pytest.mark.quick
def test_the_speed_up_is_on_for_the_audited_source():
    assert groupmerge.sources_digest() == groupmerge._AUDITED_DIGEST


@pytest.mark.parametrize("seed", range(6))
def test_partitions_equal_stock(seed):
    rng = random.Random(seed)
    for case in range(40):
        gm, supported, groups = _random_case(rng)
        single = case % 2 == 0
        stock = _partitions(gm, supported, groups, single)
        groupmerge.enable()
        try:
            fast = _partitions(gm, supported, groups, single)
        finally:
            groupmerge.disable()
        assert fast == stock, (seed, case)


def test_every_merge_question_has_stock_answer():
    """Random pairs of node sets, merges that would close a cycle among them, asked both ways."""
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

    rng = random.Random(7)
    answers = {True: 0, False: 0}
    for _ in range(60):
        gm, supported, _ = _random_case(rng)
        partitioner = GroupBasedPartitioner(gm, Supported(supported))
        ops = [n for n in gm.graph.nodes if n.op == "call_function"]
        for _ in range(20):
            a, b = rng.sample(ops, k=min(len(ops), rng.randint(1, 3))), rng.sample(ops, k=min(len(ops), rng.randint(1, 3)))
            partitions = {0: Partition(id=0, nodes=a), 1: Partition(id=1, nodes=[n for n in b if n not in a] or b)}
            stock = GroupBasedPartitioner._can_merge_partitions(partitioner, 0, 1, partitions)
            assert groupmerge.can_merge_partitions(partitioner, 0, 1, partitions) == stock
            answers[stock] += 1
    assert min(answers.values()) > 50, answers  # both answers were asked for
