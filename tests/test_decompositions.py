"""Skipped run_decompositions calls: the same program a re-trace gives, and the stock bytes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from lowercache import decompositions, models

from .conftest import churn_patch, reference, stock_pte


def _form(value):
    """A comparable form of a metadata value: tensors by their metadata, ops by name."""
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value) is FakeTensor, value.dtype, tuple(value.shape), value.stride(), value.device, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_form(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _form(v)) for k, v in value.items()))
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, torch._ops.OpOverload):
        return ("op", str(value))
    return repr(value)


def _describe(program: torch.export.ExportedProgram) -> list:
    """Every node's name, op, target, arguments and metadata (provenance aside)."""
    return [
        (n.op, n.name, str(n.target), _form(n.args), _form(n.kwargs), {k: _form(v) for k, v in n.meta.items() if k != "from_node"})
        for n in program.graph.nodes
    ]


def _audit_calls(model: str, target: str) -> int:
    """Lower stock; at every skippable call, compare the real re-trace with the skip's result."""
    original = torch.export.ExportedProgram.run_decompositions
    audited = 0

    def audit(self, table=None, *args, **kwargs):
        nonlocal audited
        if not decompositions.skippable(self, table):
            return original(self, table, *args, **kwargs)
        stock = original(self, table, *args, **kwargs)
        decompositions.apply_retrace_metadata(self)
        assert _describe(self) == _describe(stock)
        assert self.graph_signature == stock.graph_signature
        assert list(self.state_dict) == list(stock.state_dict) and list(self.constants) == list(stock.constants)
        audited += 1
        return stock

    torch.export.ExportedProgram.run_decompositions = audit
    try:
        stock_pte(*models.MODELS[model](), target)
    finally:
        torch.export.ExportedProgram.run_decompositions = original
    return audited


@pytest.mark.parametrize(
    ("model", "target"),
    [("transformer_block", "ethos-u55-128"), ("residual_cnn", "tosa-fp"), ("residual_cnn", "tosa-int")],
)
def test_skip_gives_the_program_a_retrace_gives(model, target):
    assert _audit_calls(model, target) >= 1  # the call this module exists for was seen and compared


@pytest.mark.parametrize("target", ["tosa-fp", "ethos-u55-128"])
def test_skipping_gives_stock_bytes(target):
    decompositions.reset_stats()
    with decompositions.active():
        got = stock_pte(*models.residual_cnn(), target)
    assert decompositions.stats()["skipped"] >= 1
    assert got == reference("residual_cnn", target)


def test_calls_that_must_decompose_or_functionalize_are_not_skipped():
    module, example = models.tiny_cnn()
    exported = torch.export.export(module, example)
    # Fresh from export: not yet post-dispatch ATen, so even an empty table functionalizes.
    assert not decompositions.skippable(exported, {})
    assert not decompositions.skippable(exported, torch.export.default_decompositions())
    decomposed = exported.run_decompositions({})
    table = dict(torch.export.default_decompositions())
    present = {n.target for n in decomposed.graph.nodes if n.op == "call_function"} & set(table)
    assert present  # conv2d and linear are still there to decompose
    assert not decompositions.skippable(decomposed, table)
    assert not decompositions.skippable(decomposed, {})  # an empty table is not a table to skip
    core = decomposed.run_decompositions(table)
    assert decompositions.skippable(core, table)
    core.graph_module.graph.find_nodes(op="placeholder")[0].meta["unknown_key"] = 1
    assert not decompositions.skippable(core, table)  # metadata a re-trace might drop


def test_only_executorchs_own_call_is_skipped():
    module, example = models.tiny_cnn()
    table = dict(torch.export.default_decompositions())
    core = torch.export.export(module, example).run_decompositions(table)
    assert decompositions.skippable(core, table)
    decompositions.reset_stats()
    with decompositions.active():
        again = core.run_decompositions(table)  # a script's own call keeps its stock result: a new program
    assert again is not core
    assert decompositions.stats()["skipped"] == 0


def test_patch_is_reference_counted():
    stock = torch.export.ExportedProgram.run_decompositions
    churn_patch(decompositions.enable, decompositions.disable)
    assert torch.export.ExportedProgram.run_decompositions is stock
