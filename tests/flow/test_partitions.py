"""On the benchmark's models, the partitions proposed by search are torch's: the same partitions, in the same order,
with their nodes in the same order, and the bytes are stock's."""

from __future__ import annotations

import pytest
import lowercache
from lowercache.bench import models
from lowercache.speedups import partitioner

from tests.helpers.oracle import reference


def _described(partitions: list) -> list:
    return [(p.id, [(n.name, order) for n, order in p.nodes.items()]) for p in partitions]


@pytest.mark.parametrize("target", ["tosa-int", "tosa-fp", "ethos-u55-128", "ethos-u85-256"])
@pytest.mark.parametrize("model", models.SMALL)
def test_the_flows_partitions_are_torchs(model, target, monkeypatch):
    """Each time the flow proposes partitions (the speed-up on), torch's own code proposes them again on the same graph."""
    ours = partitioner._propose_partitions
    compared = []

    def both(self):
        assert type(self.dependency_viewer) is partitioner.DependencyViewer
        found = ours(self)
        stock = partitioner._originals["propose_partitions"](self)  # torch's, reading the closure the viewer builds
        assert _described(found) == _described(stock)
        compared.append(len(found))
        return found

    monkeypatch.setattr(partitioner, "_propose_partitions", both)  # what the speed-up installs when the flow starts
    module, example = models.MODELS[model]()
    artifacts = lowercache.lower(module, example, target=target, use_cache=False)
    assert compared and all(compared)
    assert artifacts.pte == reference(model, target)
