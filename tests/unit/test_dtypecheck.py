"""The edge dtype check is skipped only for the very graph it passed, unchanged; failures always raise."""

from __future__ import annotations

import pytest
import torch

import executorch.exir.verification.verifier as verifier
from executorch.exir import to_edge

from lowercache.speedups import dtypecheck, retrace

STOCK = verifier._check_tensor_args_matching_op_allowed_dtype


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) + 1.0


def edge_graph_module() -> torch.fx.GraphModule:
    return to_edge(torch.export.export(Model(), (torch.randn(2, 4),))).exported_program().graph_module


def checks(gm) -> dict[str, int]:
    before = dtypecheck.stats()
    verifier._check_tensor_args_matching_op_allowed_dtype(gm)
    return {k: v - before[k] for k, v in dtypecheck.stats().items()}


def first_call(gm):
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def change_args(gm):
    node = first_call(gm)
    node.args = tuple(node.args)  # equal, but a new object: the check runs again


def change_val(gm):
    node = first_call(gm)
    node.meta["val"] = node.meta["val"].clone()


def change_target(gm):
    from executorch.exir.dialects._ops import ops as exir_ops

    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "relu" in str(n.target))
    node.target = exir_ops.edge.aten.sigmoid.default


def insert_node(gm):
    node = first_call(gm)
    with gm.graph.inserting_after(node):
        clone = gm.graph.call_function(node.target, node.args, node.kwargs)
    clone.meta["val"] = node.meta["val"]


def replace_attribute(gm):
    node = next((n for n in gm.graph.nodes if n.op == "get_attr"), None)
    if node is None:  # the edge program lifts constants: add one fetched attribute
        gm.extra = torch.ones(1)
        with gm.graph.inserting_before(first_call(gm)):
            gm.graph.get_attr("extra")
        return
    setattr(gm, str(node.target), getattr(gm, str(node.target)).clone())


@pytest.mark.parametrize("change", [change_args, change_val, change_target, insert_node, replace_attribute], ids=lambda f: f.__name__)
def test_a_changed_graph_is_checked_again(change):
    gm = edge_graph_module()
    with dtypecheck.active():
        assert checks(gm) == {"checked": 1, "skipped": 0}
        assert checks(gm) == {"checked": 0, "skipped": 1}  # the same graph, unchanged
        change(gm)
        assert checks(gm) == {"checked": 1, "skipped": 0}


def test_a_failing_graph_raises_every_time():
    gm = edge_graph_module()
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.users)
    placeholder.meta["val"] = placeholder.meta["val"].to(torch.int32)  # the op now sees mismatched dtypes
    with pytest.raises(Exception):
        STOCK(gm)
    with dtypecheck.active():
        for _ in range(2):
            with pytest.raises(Exception):
                verifier._check_tensor_args_matching_op_allowed_dtype(gm)


def test_installed_only_while_active_and_forgets_after():
    gm = edge_graph_module()
    with dtypecheck.active():
        assert verifier._check_tensor_args_matching_op_allowed_dtype is not STOCK
        checks(gm)
    assert verifier._check_tensor_args_matching_op_allowed_dtype is STOCK
    with dtypecheck.active():
        assert checks(gm) == {"checked": 1, "skipped": 0}  # nothing remembered across lowerings


def _edge_ops(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "EdgeOpOverload" in type(n.target).__name__)


def test_a_check_takes_the_values_a_retrace_recorded():
    """Ops whose values a retrace recorded are not run again by the check."""
    from executorch.exir.pass_base import ExportPass

    with retrace.reuse_fake_propagation(), dtypecheck.active():
        gm = ExportPass()(edge_graph_module()).graph_module  # records every op's dispatch
        retrace.reset_stats()
        assert checks(gm) == {"checked": 1, "skipped": 0}
        counts = retrace.stats()
    assert counts["reused"] > 0 and counts["reused"] + counts["redispatched_ineligible"] == _edge_ops(gm), counts
    with dtypecheck.active():  # no retrace records in play: every op runs
        retrace.reset_stats()
        checks(edge_graph_module())
        assert retrace.stats()["reused"] == 0


class _Mixed(torch.nn.Module):
    def forward(self, x, y):
        return torch.relu(x + y)


def test_a_violation_among_reused_values_reads_as_stock():
    """A node rewired to an input of another dtype is run again; the error is stock's, word for word."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.pass_base import ExportPass

    def violating(gm):
        relu = next(n for n in gm.graph.nodes if "relu" in str(n.target))
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        relu.args = (x,)  # an int32 input; the node's float val is left as it was
        return gm

    example = (torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3))
    program = to_edge(torch.export.export(_Mixed(), example), compile_config=EdgeCompileConfig(_check_ir_validity=False))
    with pytest.raises(verifier.SpecViolationError) as stock:
        STOCK(violating(ExportPass()(program.exported_program().graph_module).graph_module))
    with retrace.reuse_fake_propagation(), dtypecheck.active():
        gm = violating(ExportPass()(program.exported_program().graph_module).graph_module)
        retrace.reset_stats()
        with pytest.raises(verifier.SpecViolationError) as ours:
            verifier._check_tensor_args_matching_op_allowed_dtype(gm)
        counts = retrace.stats()
    assert str(ours.value) == str(stock.value)
    assert counts["redispatched_changed"] == 1 and counts["reused"] == 2, counts  # the relu ran; the cast and the add did not
