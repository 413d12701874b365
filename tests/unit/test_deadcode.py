"""Dead-code elimination removes exactly what stock removes, asking about side effects only for unused nodes."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph

from lowercache.speedups import deadcode


def build() -> torch.fx.GraphModule:
    """Used and unused nodes, a chain that dies once its end is removed, and an unused mutation."""
    g = Graph()
    x = g.placeholder("x")
    buf = g.placeholder("buf")
    a = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    dead1 = g.call_function(torch.ops.aten.mul.Tensor, (a, a))
    g.call_function(torch.ops.aten.neg.default, (dead1,))  # unused: then dead1 is unused too
    g.call_function(torch.ops.aten.add_.Tensor, (buf, x))  # unused but mutates: impure, kept
    g.call_function(torch.ops.aten.relu.default, (x,))  # unused
    b = g.call_function(torch.ops.aten.sub.Tensor, (a, x))
    g.output((b,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def describe(gm: torch.fx.GraphModule) -> list:
    return [(n.name, n.op, str(n.target), str(n.args), list(u.name for u in n.users)) for n in gm.graph.nodes]


@pytest.fixture
def spy(monkeypatch):
    """The operators torch's side-effect test (what ``Node.is_impure`` asks for an operator node) is asked about."""
    import torch._library.utils as library_utils

    asked: list[str] = []
    original = library_utils.is_impure

    def is_impure(op, **kwargs):
        asked.append(op._opname)
        return original(op, **kwargs)

    monkeypatch.setattr(library_utils, "is_impure", is_impure)
    return asked


def test_audited_digest_matches_installed_torch():
    assert deadcode.sources_digest() == deadcode._AUDITED_DIGEST


def test_same_graph_and_result_as_stock_asking_only_unused_nodes(spy):
    stock, ours = build(), build()
    stock_changed = stock.graph.eliminate_dead_code()
    stock_asked = list(spy)
    spy.clear()
    with deadcode.active():
        ours_changed = ours.graph.eliminate_dead_code()
    assert ours_changed is stock_changed is True
    assert describe(ours) == describe(stock)
    assert [n.name for n in ours.graph.nodes] == ["x", "buf", "add_tensor", "add__tensor", "sub_tensor", "output"]
    # stock asks about every operator node; this only about those without users
    assert sorted(stock_asked) == ["add", "add_", "mul", "neg", "relu", "sub"]
    assert sorted(spy) == ["add_", "mul", "neg", "relu"]


def test_nothing_dead_returns_false_like_stock():
    stock, ours = build(), build()
    stock.graph.eliminate_dead_code()
    ours.graph.eliminate_dead_code()
    with deadcode.active():
        assert ours.graph.eliminate_dead_code() is stock.graph.eliminate_dead_code() is False
    assert describe(ours) == describe(stock)


def test_callers_own_side_effect_test_is_used_unchanged(spy):
    gm = build()
    with deadcode.active():
        gm.graph.eliminate_dead_code(is_impure_node=lambda node: node.op != "call_function" or "relu" in node.name)
    names = [n.name for n in gm.graph.nodes]
    assert "relu_default" in names and "add__tensor" not in names  # the caller's rule, not the default one
    assert spy == []


def test_other_torch_sources_leave_dce_stock(monkeypatch, spy):
    monkeypatch.setattr(deadcode, "_AUDITED_DIGEST", "0" * 64)
    gm = build()
    with deadcode.active():
        assert Graph.eliminate_dead_code is not deadcode._eliminate_dead_code
        gm.graph.eliminate_dead_code()
    assert len(spy) == 6
    assert Graph.eliminate_dead_code is not deadcode._eliminate_dead_code


def test_undo_restores_stock():
    stock = Graph.eliminate_dead_code
    with deadcode.active():
        assert Graph.eliminate_dead_code is deadcode._eliminate_dead_code
    assert Graph.eliminate_dead_code is stock
