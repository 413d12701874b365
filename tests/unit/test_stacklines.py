"""Stack summaries made with the line left for its first reader give stock's frames, lines and node stack traces."""

from __future__ import annotations

import contextlib

import torch
from torch.utils import _traceback
from torch.utils._traceback import CapturedTraceback

from lowercache.speedups import stacklines


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(y.mean(dim=(2, 3)))


def _nested(depth: int, work):
    """``work`` called ``depth`` frames down (a server child's stack is about 25 frames deeper than a script's)."""
    return work() if depth == 0 else _nested(depth - 1, work)


def _summary() -> list:
    captured = CapturedTraceback.extract()
    summary = captured.summary()
    return [tuple(frame) for frame in summary], "".join(summary.format())


def _stack_traces() -> list:
    program = torch.export.export(_Net().eval(), (torch.randn(1, 3, 8, 8),))
    return [(node.name, node.meta.get("stack_trace")) for node in program.graph.nodes]


def _stock_then_ours(depth: int, work) -> list:
    """``work``'s result at ``depth`` without the speed-up, then with it: called from the same line, so the frames match."""
    results = []
    for patch in (contextlib.nullcontext(), stacklines.active()):
        with patch:
            results.append(_nested(depth, work))
    return results


def test_audited_digest_matches_installed_sources():
    assert stacklines.sources_digest() == stacklines._AUDITED_DIGEST


def test_the_same_frames_lines_and_text_as_stock_and_lines_looked_up_only_when_read():
    stock, ours = _stock_then_ours(30, _summary)
    assert ours == stock and len(stock[0]) > 30 and sum(bool(line) for *_, line in stock[0]) > 30
    assert _traceback._extract_symbolized_tb is not stacklines._extract_symbolized_tb  # undone on the way out
    with stacklines.active():
        assert _traceback._extract_symbolized_tb is stacklines._extract_symbolized_tb
        lazy = _nested(30, lambda: CapturedTraceback.extract().summary())
    assert all(frame._line is None for frame in lazy)  # nothing looked up until read
    assert sum(bool(frame.line) for frame in lazy) > 30


def test_an_export_records_stocks_stack_trace_on_every_node():
    stock, ours = _stock_then_ours(25, _stack_traces)
    assert ours == stock
    assert any(trace and "self.conv(x)" in trace for _, trace in stock)
