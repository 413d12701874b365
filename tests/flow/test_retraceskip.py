"""``retraceskip``: every retrace it skips, audited against the real retrace; a body that changed anything retraces.

Each skipped retrace of an XNNPACK ``xnnpack`` and ``xnnpack-int8`` lowering (a CNN and a transformer block) runs the
stock retrace beside it and compares the graphs node by node: name, op, target, arguments, users and every metadata
key and value but provenance (which never leaves ``preprocess``). Bytes: ``test_xnnpack_speedups.py`` lowers with the
speed-up on and off and compares every payload and the .pte with stock's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lowercache
from lowercache.bench import models
from lowercache.speedups import retraceskip

from tests.helpers.graphs import describe

pytestmark = pytest.mark.timeout(900)


def _picture(graph_module: torch.fx.GraphModule) -> list:
    """``describe``'s rows (a module has the graph a program has), each with its node's users in order."""
    return [(*row, [u.name for u in n.users]) for row, n in zip(describe(graph_module), graph_module.graph.nodes)]


@pytest.fixture
def audited(monkeypatch):
    """Every skip also runs the real retrace and compares; the lowering goes on with the skip's result."""
    found = {"skips": 0, "differences": []}
    skipped = retraceskip._skipped

    def audit(pass_, graph_module):
        real = retraceskip._originals["call"](pass_, graph_module).graph_module
        found["skips"] += 1
        if _picture(real) != _picture(graph_module) or dict(real.named_buffers()).keys() != dict(graph_module.named_buffers()).keys():
            found["differences"].append(type(pass_).__name__)
        return skipped(pass_, graph_module)

    monkeypatch.setattr(retraceskip, "_skipped", audit)
    return found


@pytest.mark.parametrize("target", ["xnnpack", "xnnpack-int8"])
@pytest.mark.parametrize("factory", ["tiny_cnn", "transformer_block"])
def test_every_skipped_retrace_equals_the_real_one(audited, factory, target):
    module, example = getattr(models, factory)()
    retraceskip.reset_stats()
    lowercache.lower(module, example, target=target, use_cache=False)
    stats = retraceskip.stats()
    assert audited["skips"] == stats["skipped"] >= 10 and stats["changed"] >= 1, stats
    assert audited["differences"] == []


def _changes():
    def meta_value(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        node.meta["debug_handle"] = node.meta.get("debug_handle", 0) + 1000

    def name_made_and_erased(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        with gm.graph.inserting_after(node):
            extra = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
        gm.graph.erase_node(extra)

    def value_replaced(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        node.meta["val"] = node.meta["val"].clone()

    return {"meta_value": meta_value, "name_made_and_erased": name_made_and_erased, "value_replaced": value_replaced}


@pytest.mark.parametrize("change", sorted(_changes()))
def test_a_body_that_changed_the_graph_retraces(change, monkeypatch):
    """A pass of XNNPACK's list whose body changes metadata, the name space or a value before its retrace is not
    skipped, and gives what it gives without the speed-up."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack._passes.propagate_custom_meta_pass import PropagateCustomMetaPass
    from executorch.exir import to_edge
    from executorch.exir.pass_base import ExportPass

    body = _changes()[change]

    class Touching(ExportPass):
        def call(self, graph_module):
            body(graph_module)
            return super().call(graph_module)

    module, example = models.tiny_cnn()
    program = to_edge(torch.export.export(module, example)).exported_program()

    def lowered(on: bool):
        edge = copy.deepcopy(program)  # one export: a second would number its nodes (seq_nr) on from the first
        retraceskip.reset_stats()
        if on:
            retraceskip.enable()
        try:
            out = XNNPACKPassManager(edge, [PropagateCustomMetaPass, Touching]).transform()
        finally:
            if on:
                retraceskip.disable()
        return _picture(out.graph_module), retraceskip.stats()

    with_skip, stats = lowered(True)
    assert stats == {"retraced": 2, "skipped": 0, "changed": 1}, stats
    assert with_skip == lowered(False)[0]
