"""A strict export with the discarded guards' CSE skipped: the same program, the same violations, CSE kept elsewhere."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo import guards

from lowercache.bench import models
from lowercache.cache.hashing import canon, node_form
from lowercache.lowering.stored import programstore
from lowercache.speedups import exportguards

from tests.helpers.graphs import without_varying_meta


_CSE_NAME = re.compile(r"^\s*_var\d+ = ", re.MULTILINE)  # a name CSE gives a repeated sub-expression (``running_var`` is not one)


def _strict(module: torch.nn.Module, example: tuple) -> torch.export.ExportedProgram:
    return torch.export.export(module, example, strict=True)


def _forms(program: torch.export.ExportedProgram) -> tuple:
    return (
        [node_form(node) for node in program.graph.nodes],
        canon(program.graph_module.meta),
        without_varying_meta(programstore.encode(program, "spec").blobs["program.json"]),
        {k: v.tolist() for k, v in program.state_dict.items()},
    )


@pytest.fixture
def uncse_calls(monkeypatch):
    """Each guard function built inside a constraint check: its number of guard parts, and whether CSE named any."""
    calls = []
    real = guards.build_guard_function

    def counting(code_parts, closure_args):
        made = real(code_parts, closure_args)
        if exportguards._dropping_now():
            calls.append((len(code_parts), bool(_CSE_NAME.search(made[1]))))
        return made

    monkeypatch.setattr(guards, "build_guard_function", counting)
    return calls


@pytest.mark.parametrize("model", ["residual_cnn", "transformer_block"])
def test_strict_export_is_unchanged(model, uncse_calls):
    module, example = models.MODELS[model]()  # one module: its objects' ids are in nn_module_stack
    _strict(module, example)  # the process's first dynamo compile differs in its compile id from later ones
    stock = _forms(_strict(module, example))
    assert not uncse_calls
    with exportguards.active():
        assert exportguards.enabled()
        ours = _forms(_strict(module, example))
    assert not exportguards.enabled()
    assert sum(parts for parts, _ in uncse_calls) > 20  # the shape guards (one per static dimension) went through it
    assert not any(named for _, named in uncse_calls)  # and CSE named nothing there
    assert ours == stock


def test_guard_code_outside_the_constraint_check_keeps_cse(uncse_calls):
    parts = ["L['x'].size()[0] == 2", "L['x'].size()[1] == 3", "L['x'].stride()[0] == 3"]
    stock = guards.build_guard_function(parts, "")
    with exportguards.active():
        assert guards.build_guard_function(parts, "") == stock
        fn = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True)
        assert fn(torch.ones(2, 3)).tolist() == [[2.0] * 3] * 2
    assert not uncse_calls
    assert "_var0" in stock[1]  # L['x'] and L['x'].size() are used more than once: CSE names them


def test_guard_code_without_cse_decides_as_with_it():
    parts = ["L['x'].size()[0] == 2", "L['x'].size()[1] == 3", "L['x'].stride()[0] == 3"]
    stock = guards.build_guard_function(parts, "")
    with exportguards.active(), exportguards._dropping():
        without = guards.build_guard_function(parts, "")
    assert _CSE_NAME.search(stock[1]) and not _CSE_NAME.search(without[1])
    made = []
    for _, code in (stock, without):
        scope: dict = {}
        exec(code, {}, scope)
        made.append(scope["___make_guard_fn"]())
    for x in (torch.ones(2, 3), torch.ones(3, 2), torch.ones(2, 3).t().contiguous().t(), torch.ones(2, 4)):
        assert made[0]({"x": x}) == made[1]({"x": x})
    assert made[1]({"x": torch.ones(2, 3)}) and not made[1]({"x": torch.ones(2, 4)})


class _Specializes(torch.nn.Module):
    def forward(self, x):
        return x.reshape(2, -1) if x.shape[0] == 4 else x


def _violation() -> str:
    batch = torch.export.Dim("batch")
    with pytest.raises(Exception) as raised:
        torch.export.export(_Specializes(), (torch.ones(4, 3),), dynamic_shapes={"x": {0: batch}}, strict=True)
    return f"{type(raised.value).__name__}: {raised.value}"


def test_a_constraint_violation_raises_as_stock():
    stock = _violation()
    with exportguards.active():
        ours = _violation()
    assert "batch" in stock and "specializ" in stock.lower(), stock
    assert ours == stock
