"""Deferred GraphModule code generation: every way to reach the code sees stock's code."""

from __future__ import annotations

import copy
import inspect

import torch

from lowercache.speedups import lazycode


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * scale


def traced() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(Small())


def test_deferred_module_behaves_like_stock():
    stock = traced()
    x, scale = torch.randn(2, 4), torch.tensor(2.0)
    with lazycode.active():
        gm = traced()
        assert gm.__dict__.get(lazycode._STALE)  # no code generated yet
        assert inspect.signature(gm.forward) == inspect.signature(stock.forward)
        assert torch.equal(gm(x, scale), stock(x, scale))
        assert gm.code == stock.code
    assert str(gm) == str(stock)


def test_edit_then_recompile_is_seen():
    """A pass edits the graph and recompiles: the next call runs the edited graph."""
    x, scale = torch.randn(2, 4), torch.tensor(2.0)
    with lazycode.active():
        gm = traced()
        gm(x, scale)  # code generated once
        for node in gm.graph.nodes:
            if node.target is torch.relu:
                node.target = torch.sigmoid
        gm.recompile()
        assert "sigmoid" in gm.code
        expected = torch.sigmoid(gm.linear(x)) * scale
        assert torch.equal(gm(x, scale), expected)


def test_stale_module_outlives_the_patch():
    with lazycode.active():
        gm = traced()
    assert gm.__dict__.get(lazycode._STALE)
    x, scale = torch.randn(2, 4), torch.tensor(2.0)
    assert torch.equal(gm(x, scale), traced()(x, scale))
    assert gm.code == traced().code


def test_copies_and_recompile_result():
    with lazycode.active():
        gm = traced()
        clone = copy.deepcopy(gm)
        python_code = gm.recompile()
        assert "def forward" in python_code.src  # the deferred result materializes on use
        x, scale = torch.randn(2, 4), torch.tensor(2.0)
        assert torch.equal(clone(x, scale), gm(x, scale))
