"""``retraceskip``: every retrace it skips, audited against the real retrace; a body that changed anything retraces.

Each skipped retrace of an XNNPACK lowering (``xnnpack``, ``xnnpack-int8``) and of an Arm TOSA pipeline (INT, FP,
Ethos-U) runs the stock retrace beside it and compares the graphs node by node: name, op, target, arguments, users and
every metadata key and value but provenance (which never leaves ``preprocess``). Bytes: ``test_xnnpack_speedups.py``
and ``test_speedups.py`` lower with the speed-up on and off and compare every payload and the .pte with stock's.
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


# (factory, target, fewest skips): XNNPACK's manager retraces after nearly every pass; in the Arm pipeline a pass is
# skipped only where its ``call_operator`` hands every node on as it is (``fastcopy``'s gates, ``passregistry``'s
# declared conditions).
CASES = [(f, t, 10) for f in ("tiny_cnn", "transformer_block") for t in ("xnnpack", "xnnpack-int8")] + [
    ("tiny_cnn", "ethos-u55-128", 2), ("transformer_block", "ethos-u55-128", 2), ("transformer_block", "tosa-fp", 2),
    ("residual_cnn", "tosa-int", 2)]


@pytest.mark.parametrize("factory, target, fewest", CASES)
def test_every_skipped_retrace_equals_the_real_one(audited, factory, target, fewest):
    module, example = getattr(models, factory)()
    retraceskip.reset_stats()
    lowercache.lower(module, example, target=target, use_cache=False)
    stats = retraceskip.stats()
    assert audited["skips"] == stats["skipped"] >= fewest and stats["changed"] >= 1, stats
    assert audited["differences"] == []


@pytest.mark.parametrize("mode, in_scope", [(None, True), ("JSON", False)])
def test_the_tosa_debug_dump_turns_the_arm_skip_off(monkeypatch, mode, in_scope):
    """The TOSA debug dump writes each node's provenance, which a retrace extends: with it on, the Arm pipeline runs
    outside the skip's scope (no retrace output is remembered, so none is skipped)."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setitem(retraceskip._originals, "arm_transform",
                        lambda manager, program, gm: seen.append(getattr(retraceskip._tls, "outputs", None)))
    manager = SimpleNamespace(compile_spec=SimpleNamespace(tosa_debug_mode=mode), passes=[])
    program = SimpleNamespace(graph_module=object())
    retraceskip._arm_transform(manager, program, program.graph_module)
    assert (seen[0] is not None) is in_scope
    assert getattr(retraceskip._tls, "outputs", None) is None


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


def test_a_hook_the_release_lacks_is_not_an_error(monkeypatch):
    """ExecuTorch 1.4's ExportPass has no ``call_size_operator``: a pass is still judged by the hooks it has, and one
    that defines a hook ExportPass lacks is not taken for bare."""
    from executorch.exir.pass_base import ExportPass, _ExportPassBase

    for name in ("call_size_operator", "call_size_operator_all"):
        monkeypatch.delattr(_ExportPassBase, name)

    class Plain(ExportPass):
        pass

    class Sizing(ExportPass):
        def call_size_operator(self, *args, **kwargs):
            return 0

    assert retraceskip._bare(Plain()) and not retraceskip._bare(Sizing())
