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
# Where the pass makes more than one round of moves in a row, so that rounds are made in place (counted in one process).
MOVES = {("tiny_cnn", "tosa-fp"), ("seq_zoo", "ethos-u55-128"), ("channels_last_norm", "ethos-u55-128"),
         ("channels_last_norm", "tosa-int")}


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
    stats = propagate.stats()
    assert [n for n, _ in ours] == [n for n, _ in stock] and ours == stock
    assert pte == stock_pte
    if name in models.SMALL:
        assert pte == reference(name, target)
    # not vacuous: where the pass moves nodes round after round, rounds were made in place
    assert (stats["local"] > 0) == ((name, target) in MOVES), stats


def test_audited_digest_matches_installed_sources():
    assert propagate.sources_digest() == propagate._AUDITED_DIGEST


def test_other_sources_leave_the_pass_stock(monkeypatch):
    from executorch.backends.transforms.propagate_view_copy_permute_pass import PropagateViewCopyPermutePass

    stock = PropagateViewCopyPermutePass._retrace
    monkeypatch.setattr(propagate, "_AUDITED_DIGEST", "0" * 64)
    with propagate.active():
        assert PropagateViewCopyPermutePass._retrace is stock and not propagate.enabled()
    monkeypatch.undo()
    with propagate.active():
        assert propagate.enabled()
    assert PropagateViewCopyPermutePass._retrace is stock and not propagate.enabled()
