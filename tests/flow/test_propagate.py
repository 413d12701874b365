"""PropagateViewCopyPermute{Up,Down} with its rounds retraced in place: every graph the pass returns is the one it
returns as stock runs it (names, arguments, users in order, every metadata key with its value and provenance), and
the bytes are stock's."""

from __future__ import annotations

import pytest
import torch

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


class _Fork(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(x.permute(0, 2, 1))
        return torch.neg(z) * torch.abs(z)


def _round_of_moves() -> tuple[object, torch.fx.GraphModule, propagate._Call]:
    """A retraced edge graph, its snapshot, then edits of the kinds a round makes, each needing a different step of
    the local update: an argument changed upstream of a node whose own arguments are the same objects, users out of
    graph order, and a new node with metadata copied from another."""
    from executorch.backends.arm._passes.propagate_view_copy_permute_pass import PropagateViewCopyPermuteDownPass
    from executorch.exir import to_edge

    pass_ = PropagateViewCopyPermuteDownPass()
    edge = to_edge(torch.export.export(_Fork(), (torch.randn(2, 3, 4),))).exported_program().graph_module
    graph_module = pass_._retrace(edge)
    state = propagate._Call(pass_)
    state.snapshot = propagate._snapshot(graph_module.graph)
    x, permute, relu, neg, absolute, mul, output = graph_module.graph.nodes
    permute.args = (x, [1, 0, 2])  # relu's arguments are the same objects, its value is not
    neg.prepend(absolute)  # relu's users are now out of graph order
    with graph_module.graph.inserting_before(output):
        again = graph_module.graph.call_function(neg.target, (mul,))
    again.meta = dict(mul.meta)
    output.args = ((again,),)
    return pass_, graph_module, state


def _positional(graph_module: torch.fx.GraphModule) -> list:
    """Each node by position: kind, target, arguments and users by position, and its value's metadata."""
    index = {n: i for i, n in enumerate(graph_module.graph.nodes)}
    return [
        (n.op, str(n.target), passgraphs.form(torch.fx.node.map_arg(n.args, lambda a: index[a])),
         [index[u] for u in n.users], passgraphs.form(n.meta.get("val")), passgraphs.form(n.meta.get("tensor_meta")))
        for n in graph_module.graph.nodes
    ]


def test_a_round_made_in_place_has_the_retraces_values_and_users():
    pass_, stock, _ = _round_of_moves()
    stock = pass_._retrace(stock)
    pass_, ours, state = _round_of_moves()
    assert propagate._update(pass_, ours, state)
    assert _positional(ours) == _positional(stock)
    assert [n.meta["val"].shape for n in ours.graph.nodes if n.op == "call_function"][1:] == [(3, 2, 4)] * 5
    # and the stock retrace that ends the pass gives the same graph from either
    assert passgraphs.describe(pass_._retrace(ours)) == passgraphs.describe(pass_._retrace(stock))


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
