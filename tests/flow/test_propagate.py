"""PropagateViewCopyPermute{Up,Down} with its rounds retraced in place: every graph the pass returns is the one it
returns as stock runs it (names, arguments, users in order, every metadata key with its value and provenance), and
the bytes are stock's."""

from __future__ import annotations

import pytest

import lowercache
from lowercache.bench import models, passgraphs
from lowercache.speedups import propagate

from tests.helpers import op_zoo
from tests.helpers.oracle import reference

NAMES = ("PropagateViewCopyPermuteDownPass", "PropagateViewCopyPermuteUpPass")
BUILDERS = {**{name: models.MODELS[name] for name in models.SMALL}, **op_zoo.ZOO, "channels_last_norm": op_zoo.channels_last_norm}
CASES = [(name, target) for name in BUILDERS for target in ("tosa-fp", "ethos-u55-128")] + [("channels_last_norm", "tosa-int")]
LOCAL: dict[tuple[str, str], int] = {}


def _graphs(name: str, target: str, speedups: str) -> tuple[list, bytes]:
    module, example = BUILDERS[name]()
    graphs, artifacts = passgraphs.graphs_after(
        NAMES, lambda: passgraphs.lowered_with(speedups, lambda: lowercache.lower(module, example, target=target, use_cache=False))
    )
    return graphs, artifacts.pte


@pytest.mark.parametrize("name, target", CASES)
def test_every_graph_the_pass_returns_is_stocks(name, target):
    stock, stock_pte = _graphs(name, target, "all,-propagate")
    propagate.reset_stats()
    ours, pte = _graphs(name, target, "all")
    LOCAL[(name, target)] = propagate.stats()["local"]
    assert [n for n, _ in ours] == [n for n, _ in stock] and ours == stock
    assert pte == stock_pte
    if name in models.SMALL:
        assert pte == reference(name, target)


def test_rounds_were_retraced_in_place():
    """The comparison above is not vacuous: rounds of moves were made in place, on more than one model."""
    if len(LOCAL) < len(CASES):
        pytest.skip("needs the comparisons above in this process")
    assert sum(1 for count in LOCAL.values() if count) >= 3, LOCAL
