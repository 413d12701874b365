"""Skipped and localized run_decompositions calls: the same program a re-trace gives, and the stock bytes."""

from __future__ import annotations

import pytest
import torch

from lowercache.speedups import decompositions
from lowercache.bench import models

from tests.helpers.graphs import ConvertsAndReshapes, churn_patch, describe, same_program
from tests.helpers.oracle import reference, run_stock, stock_pte
from tests.helpers.xnnstock import lower_here


def _audit_calls(model: str, target: str, strict: bool = False) -> dict[str, int]:
    """Lower stock; at every call that would be skipped or localized, compare the real re-trace with ours."""
    original = torch.export.ExportedProgram.run_decompositions
    audited = {"skipped": 0, "localized": 0, "functionalized": 0}

    def audit(self, table=None, *args, **kwargs):
        stock = original(self, table, *args, **kwargs)
        if decompositions.functionalizing(self, table):
            before = describe(self)
            try:
                mine = decompositions.localize_functionalization(self, original)
            except decompositions.Unsupported:
                return stock
            assert describe(self) == before  # the caller's program is left as it was
            assert mine.dialect == stock.dialect == "ATEN"
            assert mine.graph_module.meta.keys() == stock.graph_module.meta.keys()
            same_program(mine, stock)
            audited["functionalized"] += 1
            return stock
        if decompositions.skippable(self, table):
            decompositions.apply_retrace_metadata(self)
            kind = "skipped"
        else:
            try:
                decompositions.localize(self, table, original)
            except decompositions.Unsupported:
                return stock
            kind = "localized"
        same_program(self, stock)
        audited[kind] += 1
        return stock

    torch.export.ExportedProgram.run_decompositions = audit
    try:
        if target.startswith("xnnpack"):
            lower_here(*models.MODELS[model](), target)
        else:
            run_stock(*models.MODELS[model](), target, strict=strict)
    finally:
        torch.export.ExportedProgram.run_decompositions = original
    return audited


@pytest.mark.parametrize(
    ("model", "target"),
    [
        ("transformer_block", "ethos-u55-128"),
        ("transformer_block", "tosa-fp"),  # layer norm: unused outputs whose getitem names stay taken
        ("residual_cnn", "tosa-fp"),  # batch norm, parameters first read by a decomposed conv2d
        ("residual_cnn", "tosa-int"),
    ],
)
def test_skipped_and_localized_calls_give_the_program_a_retrace_gives(model, target):
    audited = _audit_calls(model, target)
    assert audited["localized"] >= 1  # the second call: conv2d / transpose / _unsafe_view decomposed
    assert audited["skipped"] >= 1  # the third call, nothing left to decompose
    assert audited["functionalized"] == 1  # the first call, float parameters or not


@pytest.mark.parametrize("target", ["xnnpack-int8", "xnnpack"])
def test_xnnpack_calls_are_localized_as_a_retrace_gives(target):
    """XNNPACK's partitioner checks tag the q/dq nodes they would fuse (``IS_IMPLICIT_Q_DQ_TAG``) before the second
    call; a re-trace drops the tag, and so does the localized call."""
    tagged = []
    original = torch.export.ExportedProgram.run_decompositions

    def spy(self, table=None, *args, **kwargs):
        tagged.append(sum("IS_IMPLICIT_Q_DQ_TAG" in n.meta for n in self.graph.nodes))
        return original(self, table, *args, **kwargs)

    torch.export.ExportedProgram.run_decompositions = spy
    try:
        audited = _audit_calls("tiny_cnn", target)
    finally:
        torch.export.ExportedProgram.run_decompositions = original
    assert audited["functionalized"] == 1 and audited["localized"] >= 1
    assert audited["skipped"] + audited["localized"] == 2  # every call audited, none in full
    if target == "xnnpack-int8":
        assert any(tagged)  # the case this covers: a call sees the tags


@pytest.mark.parametrize("target", ["xnnpack-int8", "xnnpack"])
def test_xnnpack_calls_give_stock_bytes(target):
    module, example = models.tiny_cnn()
    stock = lower_here(module, example, target)
    decompositions.reset_stats()
    with decompositions.active():
        got = lower_here(module, example, target)
    assert decompositions.stats()["full"] == 0
    assert got == stock


def test_a_strict_exports_programs_are_localized_too():
    """Dynamo's ``example_value`` on lifted placeholders (aot_arm_compiler exports strict) is carried over
    unchanged by a re-trace: such programs are skipped and localized as others, with the same result."""
    audited = _audit_calls("residual_cnn", "ethos-u55-128", strict=True)
    assert audited == {"skipped": 1, "localized": 1, "functionalized": 1}


def test_localized_functionalization_is_the_real_call():
    program = torch.export.export(ConvertsAndReshapes(), (torch.randn(6),))
    forms = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"aten._assert_tensor_metadata.default", "aten.to.dtype", "aten.reshape.default"} <= forms
    original = torch.export.ExportedProgram.run_decompositions
    before = describe(program)
    mine = decompositions.localize_functionalization(program, original)
    assert describe(program) == before
    stock = original(program, {})
    same_program(mine, stock)
    asserted = next(n for n in mine.graph.nodes if "assert_tensor_metadata" in str(n.target))
    assert asserted.args[1:] == (None, None, torch.float32) and "val" not in asserted.meta  # as a trace records it


def test_functionalization_of_a_float_program_is_the_real_call():
    """Parameters require grad; the trace runs without grad, so operators' tensor_meta loses it."""
    module, example = models.transformer_block()
    program = torch.export.export(module, example)
    grads = [n for n in program.graph.nodes if n.op == "call_function" and n.meta["tensor_meta"].requires_grad]
    assert grads and any(n.meta["val"].requires_grad for n in program.graph.find_nodes(op="placeholder"))
    original = torch.export.ExportedProgram.run_decompositions
    sequence = torch.autograd._get_sequence_nr()
    mine = decompositions.localize_functionalization(program, original)
    assert all(n.meta["tensor_meta"].requires_grad for n in grads)  # the caller's program is left as it was
    stock = original(program, {})
    assert torch.autograd._get_sequence_nr() == sequence  # the real call recorded no autograd node
    same_program(mine, stock)


def test_functionalization_with_operator_values_that_require_grad_runs_in_full():
    module, example = models.tiny_cnn()
    program = torch.export.export(module, example)
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    node.meta["val"] = node.meta["val"].detach().requires_grad_(True)  # not what export gives: no known trace form
    with pytest.raises(decompositions.Unsupported, match="requires grad"):
        decompositions.localize_functionalization(program, torch.export.ExportedProgram.run_decompositions)


@pytest.mark.parametrize(
    ("op", "args", "kwargs", "form"),
    [
        (torch.ops.aten.amax.default, ("x", [-1], False), {}, (("x", [-1]), {})),  # trailing default dropped
        (torch.ops.aten.amax.default, ("x",), {"keepdim": True}, (("x", [], True), {})),  # gap filled
        (torch.ops.aten.sum.dim_IntList, ("x", [1]), {"dtype": None}, (("x", [1]), {})),  # keyword at default
        (torch.ops.aten.hardtanh.default, ("x", 0.0, 6.0), {}, (("x", 0.0, 6.0), {})),
        (torch.ops.aten.hardtanh.default, ("x", -1.0), {}, None),  # -1.0 against the default -1: not sure
        (torch.ops.aten.amax.default, ("x",), {"bogus": 1}, None),
    ],
)
def test_dispatch_form(op, args, kwargs, form):
    assert decompositions.dispatch_form(op, args, kwargs) == form


def test_trace_names_are_the_names_a_trace_gives():
    module, example = models.residual_cnn()
    program = torch.export.export(module, example).run_decompositions({})
    table = dict(torch.export.default_decompositions())
    for traced in (program, program.run_decompositions(table)):
        names, _ = decompositions.trace_names(traced.graph)
        assert [names[n] for n in traced.graph.nodes] == [n.name for n in traced.graph.nodes]
    batch_norms = [n for n in program.graph.nodes if "batch_norm" in str(n.target)]
    assert batch_norms and all(len(n.users) < len(n.meta["val"]) for n in batch_norms)  # unused outputs were there


def test_calls_outside_the_localized_form_run_in_full_untouched():
    module, example = models.tiny_cnn()
    exported = torch.export.export(module, example)
    table = dict(torch.export.default_decompositions())
    original = torch.export.ExportedProgram.run_decompositions
    before = describe(exported)
    with pytest.raises(decompositions.Unsupported, match="post-dispatch"):
        decompositions.localize(exported, table, original)  # fresh from export: functionalizing call
    decomposed = exported.run_decompositions({})
    with pytest.raises(decompositions.Unsupported, match="table"):
        decompositions.localize(decomposed, {}, original)
    decomposed.graph_module.graph.find_nodes(op="placeholder")[0].meta["unknown_key"] = 1
    kept = describe(decomposed)
    with pytest.raises(decompositions.Unsupported, match="unknown_key"):
        decompositions.localize(decomposed, table, original)
    assert describe(exported) == before and describe(decomposed) == kept


@pytest.mark.parametrize("target", ["tosa-fp", "ethos-u55-128"])
def test_skipped_and_localized_calls_give_stock_bytes(target):
    decompositions.reset_stats()
    with decompositions.active():
        got = run_stock(*models.residual_cnn(), target)
    counts = decompositions.stats()
    assert counts["localized"] >= 2 and counts["full"] == 0  # the first call too, float or quantized
    assert counts["skipped"] >= 1
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


class _DeadAfterDecomposition(torch.nn.Module):
    """``type_as`` of the same dtype decomposes to nothing, leaving ``relu`` unused: a trace drops both."""

    def forward(self, x):
        return x.type_as(torch.relu(x)) * 2


def test_nodes_a_trace_would_drop_take_the_full_call():
    program = torch.export.export(_DeadAfterDecomposition(), (torch.randn(2, 3),)).run_decompositions({})
    table = dict(torch.export.default_decompositions())
    original = torch.export.ExportedProgram.run_decompositions
    full = original(program, table)
    assert [str(n.target) for n in full.graph.nodes if n.op == "call_function"] == ["aten.mul.Tensor"]
    before = describe(program)
    with pytest.raises(decompositions.Unsupported, match="relu would lose all its uses"):
        decompositions.localize(program, table, original)
    assert describe(program) == before


def test_a_small_trace_that_raises_takes_the_full_call():
    module, example = models.tiny_cnn()
    program = torch.export.export(module, example).run_decompositions({})
    table = dict(torch.export.default_decompositions())
    before = describe(program)

    def failing(small, table):
        raise RuntimeError("no kernel")

    with pytest.raises(decompositions.Unsupported, match="small program: RuntimeError: no kernel"):
        decompositions.localize(program, table, failing)
    assert describe(program) == before


def test_trace_names_refuses_getitems_away_from_their_producer():
    module, example = models.residual_cnn()
    graph = torch.export.export(module, example).run_decompositions({}).graph
    norm = next(n for n in graph.nodes if "batch_norm" in str(n.target))
    item = next(iter(norm.users))
    decompositions.trace_names(graph)
    with graph.inserting_after(norm):  # an unrelated node between the producer and its getitem
        graph.call_function(torch.ops.aten.relu.default, (norm.args[0],)).meta["val"] = norm.args[0].meta["val"]
    assert item.prev is not norm
    with pytest.raises(decompositions.Unsupported, match="not right after it"):
        decompositions.trace_names(graph)


def test_symbolic_shapes_take_the_full_call():
    module, example = models.tiny_cnn()
    batch = torch.export.Dim("batch", min=2, max=8)
    example = (torch.cat([example[0]] * 2),)
    program = torch.export.export(module, example, dynamic_shapes=({0: batch},)).run_decompositions({})
    before = describe(program)
    with pytest.raises(decompositions.Unsupported, match="symbolic"):
        decompositions.localize(program, dict(torch.export.default_decompositions()), torch.export.ExportedProgram.run_decompositions)
    assert describe(program) == before


class _SharedBuffer(torch.nn.Module):
    """One buffer read by three operators of different kinds: a re-trace gives its placeholder
    the traced fields of the last reader (``_collect_param_buffer_metadata``), not the first."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(-1.0, 1.0, 16).reshape(4, 4))

    def forward(self, x):
        y = x * self.w
        z = torch.nn.functional.linear(y, self.w)
        return (z + self.w).reshape(16)


def test_an_input_read_by_several_operators_takes_its_last_readers_metadata():
    original = torch.export.ExportedProgram.run_decompositions
    program = torch.export.export(_SharedBuffer(), (torch.randn(4, 4),))
    mine = decompositions.localize_functionalization(program, original)
    first = original(program, {})
    same_program(mine, first)
    table = dict(torch.export.default_decompositions())  # linear decomposes: a localized second call
    second = original(first, table)
    decompositions.localize(first, table, original)
    same_program(first, second)
    placeholder = second.graph.find_nodes(op="placeholder")[0]
    assert str(placeholder.meta["original_aten"]) == "aten.add.Tensor"  # the last reader; the first is mul
    core = original(second, table)  # nothing left to decompose: the third call is skipped
    assert decompositions.skippable(second, table)
    decompositions.apply_retrace_metadata(second)
    same_program(second, core)


def test_an_input_named_like_a_builtin_takes_the_full_call():
    """Export names an nn.Sequential's input `input`, past FX's namespace; a graph copy would rename it to `input_1`."""
    module, example = models.tiny_cnn()
    torch.manual_seed(0)
    sequential = torch.nn.Sequential(module, torch.nn.Linear(10, 16)).eval()
    assert "input" in {n.name for n in torch.export.export(sequential, example).graph.find_nodes(op="placeholder")}
    stock = stock_pte(sequential, example, "ethos-u55-128")
    decompositions.reset_stats()
    with decompositions.active():
        got = run_stock(sequential, example, "ethos-u55-128")
    assert decompositions.stats()["full"] >= 1
    assert got == stock
