"""Dirty-region retracing: reused fake propagation gives the stock bytes, and is really used."""

from __future__ import annotations


import pytest
import torch

from lowercache.bench import models
from lowercache.speedups import retrace

from tests.helpers.graphs import PAIRS, Cond, churn_patch
from tests.helpers.oracle import run_stock, stock_pte


def _lower_both(module_fn, target):
    assert not retrace.enabled()
    expected = stock_pte(*module_fn(), target)
    retrace.reset_stats()
    with retrace.reuse_fake_propagation():
        got = run_stock(*module_fn(), target)
    assert not retrace.enabled()
    return expected, got, retrace.stats()


@pytest.mark.parametrize(("model", "target"), PAIRS)
def test_pte_bytes_identical_and_reuse_happens(model, target):
    expected, got, counts = _lower_both(models.MODELS[model], target)
    assert got == expected
    assert counts["reused"] > 0, counts
    assert counts["redispatched"] > 0, counts  # first retraces and changed nodes still dispatch


# Two targets keep the test file near three minutes; the structure edit takes the
# full INT + Vela path, the weights edit (same graph, other constants) the FP one.
@pytest.mark.parametrize(("edit", "target"), [("structure", "ethos-u55-128"), ("weights", "tosa-fp")])
def test_edit_variants_identical(edit, target):
    expected, got, counts = _lower_both(lambda: models.residual_cnn(edit=edit), target)
    assert got == expected
    assert counts["reused"] > 0, counts


def test_combines_with_shared_provenance():
    from lowercache.speedups.provenance import shared_provenance

    expected = stock_pte(*models.tiny_cnn(), "ethos-u55-128")
    retrace.reset_stats()
    with shared_provenance(), retrace.reuse_fake_propagation():
        got = run_stock(*models.tiny_cnn(), "ethos-u55-128")
    assert got == expected
    assert retrace.stats()["reused"] > 0


# --- ExportPass-level checks: graphs, names and meta compared node by node ---------


def describe(gm: torch.fx.GraphModule) -> list:
    """Everything of a graph that the lowering can observe, nested graphs included."""
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        leaves = val if isinstance(val, (list, tuple)) else [val]
        metas = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                metas.append((str(leaf.shape), str(leaf.stride()), leaf.dtype, leaf.device, leaf.storage_offset()))
            else:
                metas.append(repr(leaf))
        keys = sorted(k for k in node.meta if k not in ("stack_trace", "from_node", "seq_nr", "nn_module_stack", "val", "source_fn_stack", "torch_fn"))
        out.append((node.op, node.name, str(node.target), str(node.args), str(node.kwargs), metas, keys))
    for name, child in gm.named_children():
        if isinstance(child, torch.fx.GraphModule):
            out.append(("child", name, describe(child)))
    return out


def _run_passes(make_gm, passes, reuse):
    gm = make_gm()
    ctx = retrace.reuse_fake_propagation() if reuse else _null()
    with ctx:
        for p in passes:
            gm = p()(gm).graph_module
    return gm


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _exported(module, example, dynamic_shapes=None):
    def make():
        return torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False).graph_module

    return make


class _Small(torch.nn.Module):
    def forward(self, x):
        a = torch.relu(x)
        b = torch.sum(a, dim=[1])
        c = a.permute(1, 0)  # an aliasing op
        d = torch.split(x, 1, dim=0)  # list output + getitem
        return b, c * 2, d[0] + 1


def _passes():
    from executorch.exir.pass_base import ExportPass

    class ReluToSigmoid(ExportPass):
        def call_operator(self, op, args, kwargs, meta):
            if op == torch.ops.aten.relu.default:
                op = torch.ops.aten.sigmoid.default
            return super().call_operator(op, args, kwargs, meta)

    class StaleArgs(ExportPass):
        """Rewrites a node in call() and leaves its ``val`` stale, as some passes do."""

        def call(self, gm):
            for node in gm.graph.nodes:
                if node.target == torch.ops.aten.sum.dim_IntList:
                    node.args = (node.args[0], [0])  # val still says shape (3,)
            return super().call(gm)

    return ExportPass, ReluToSigmoid, StaleArgs


def test_export_pass_chain_matches_node_by_node():
    ExportPass, ReluToSigmoid, StaleArgs = _passes()
    make = _exported(_Small(), (torch.randn(3, 4),))
    chain = [ExportPass, ExportPass, ReluToSigmoid, ExportPass, StaleArgs, ExportPass]
    stock = _run_passes(make, chain, reuse=False)
    retrace.reset_stats()
    reused = _run_passes(make, chain, reuse=True)
    counts = retrace.stats()
    assert describe(reused) == describe(stock)
    assert reused.code == stock.code
    sums = [n for n in reused.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList]
    assert tuple(sums[0].meta["val"].shape) == (4,)  # the stale val was recomputed, not reused
    assert counts["reused"] > 0 and counts["redispatched_changed"] > 0, counts


def _edge_ops_pass():
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportPass

    class ToEdgeOps(ExportPass):
        """Every ATen op becomes its edge op, as ``to_edge``'s op replacement does."""

        def call_operator(self, op, args, kwargs, meta):
            if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
                op = getattr(getattr(exir_ops.edge.aten, op._schema.name.split("::")[1]), op._overloadname)
            return super().call_operator(op, args, kwargs, meta)

    return ToEdgeOps


def test_edge_op_reuses_what_its_aten_op_computed():
    """``edge.aten.X`` calls ``aten.X``: an ATen node retraced as its edge op needs no dispatch."""
    ExportPass, _, _ = _passes()
    ToEdgeOps = _edge_ops_pass()
    make = _exported(_Small(), (torch.randn(3, 4),))
    chain = [ExportPass, ToEdgeOps, ExportPass]
    stock = _run_passes(make, chain, reuse=False)
    with retrace.reuse_fake_propagation():
        gm = ExportPass()(make()).graph_module  # records the ATen dispatches
        ops = sum(1 for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload))
        retrace.reset_stats()
        gm = ToEdgeOps()(gm).graph_module
        counts = retrace.stats()
        gm = ExportPass()(gm).graph_module
    assert describe(gm) == describe(stock)
    assert counts["reused"] == ops and counts["redispatched"] == 0, counts
    # the edge op of another ATen op is another dispatch
    from executorch.exir.dialects._ops import ops as exir_ops

    class ReluToEdgeSigmoid(ExportPass):
        def call_operator(self, op, args, kwargs, meta):
            if op == torch.ops.aten.relu.default:
                op = exir_ops.edge.aten.sigmoid.default
            return super().call_operator(op, args, kwargs, meta)

    with retrace.reuse_fake_propagation():
        gm = ExportPass()(make()).graph_module
        retrace.reset_stats()
        ReluToEdgeSigmoid()(gm)
    assert retrace.stats()["redispatched_changed"] == 2  # the sigmoid, and the permute that views its output


def test_stale_val_with_a_record_is_not_trusted():
    """A node whose args change in place keeps a recorded val: the recomputation must win."""
    ExportPass, _, StaleArgs = _passes()
    make = _exported(_Small(), (torch.randn(3, 4),))
    with retrace.reuse_fake_propagation():
        gm = ExportPass()(make()).graph_module  # records every node's val
        (s,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList]
        assert tuple(s.meta["val"].shape) == (3,)
        gm = StaleArgs()(gm).graph_module
    (s,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList]
    assert tuple(s.meta["val"].shape) == (4,)


def test_symbolic_shapes_are_never_reused():
    ExportPass, ReluToSigmoid, _ = _passes()
    batch = torch.export.Dim("batch", min=2, max=64)
    make = _exported(_Small(), (torch.randn(3, 4),), dynamic_shapes={"x": {1: batch}})
    chain = [ExportPass, ReluToSigmoid, ExportPass]
    stock = _run_passes(make, chain, reuse=False)
    retrace.reset_stats()
    reused = _run_passes(make, chain, reuse=True)
    assert describe(reused) == describe(stock)
    assert retrace.stats()["reused"] == 0


class _Weights(torch.nn.Module):
    """Weights as the quantizer's passes see them: get_attr tensors (parameters and a buffer)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.randn(4))

    def forward(self, x):
        return self.linear(x).flatten() * 2, self.linear.weight.flatten() + 1, x * self.scale


def test_get_attr_tensor_arguments_are_reused_through_the_converters_fake():
    """A node fed by a real weight reuses its val once the pass's fake mode holds the weight's fake;
    a weight swapped for one of another shape is converted afresh and its users recomputed."""
    from executorch.exir.pass_base import ExportPass

    class SwapWeight(ExportPass):
        def call(self, gm):
            (linear,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
            weight, bias = linear.args[1].target, linear.args[2].target
            setattr(gm, weight, torch.nn.Parameter(torch.randn(6, 4)))
            setattr(gm, bias, torch.nn.Parameter(torch.randn(6)))
            return super().call(gm)

    def make():
        return torch.export.export(_Weights(), (torch.randn(3, 4),), strict=False).module(check_guards=False)

    def linear_vals(gm):
        return [n.meta["val"] for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]

    chain = [ExportPass, ExportPass, SwapWeight, ExportPass]
    stock = _run_passes(make, chain, reuse=False)
    retrace.reset_stats()
    reused = _run_passes(make, chain, reuse=True)
    assert describe(reused) == describe(stock)
    assert reused.code == stock.code
    assert [tuple(v.shape) for v in linear_vals(reused)] == [(3, 6)]
    assert retrace.stats()["reused"] > 0

    # The first retrace converts the weight (no fake of it yet: ineligible), the second records
    # the dispatch, the third reuses the very object the second made.
    with retrace.reuse_fake_propagation():
        first = ExportPass()(make()).graph_module
        second = ExportPass()(first).graph_module
        third = ExportPass()(second).graph_module
    assert linear_vals(second)[0] is not linear_vals(first)[0]
    assert linear_vals(third)[0] is linear_vals(second)[0]


def test_control_flow_submodules_match():
    ExportPass, ReluToSigmoid, _ = _passes()
    make = _exported(Cond(), (torch.randn(2, 3),))
    chain = [ExportPass, ExportPass, ReluToSigmoid, ExportPass]
    stock = _run_passes(make, chain, reuse=False)
    retrace.reset_stats()
    reused = _run_passes(make, chain, reuse=True)
    assert describe(reused) == describe(stock)
    assert retrace.stats()["reused"] > 0


def test_enable_disable_reference_counted_and_restores_originals():
    from executorch.exir.pass_base import _ExportPassBase
    from torch._export.pass_base import _ExportPassBaseDeprecatedDoNotUse as TorchBase

    fx, run_node = _ExportPassBase._fx, _ExportPassBase.ExportInterpreter.run_node
    torch_fx, torch_run_node = TorchBase._fx, TorchBase.ExportInterpreter.run_node
    with retrace.reuse_fake_propagation():
        with retrace.reuse_fake_propagation():
            assert _ExportPassBase._fx is not fx and TorchBase._fx is not torch_fx
        assert retrace.enabled() and _ExportPassBase._fx is not fx
    assert not retrace.enabled()
    assert _ExportPassBase._fx is fx and _ExportPassBase.ExportInterpreter.run_node is run_node
    assert TorchBase._fx is torch_fx and TorchBase.ExportInterpreter.run_node is torch_run_node

    churn_patch(retrace.enable, retrace.disable)
    assert not retrace.enabled() and _ExportPassBase._fx is fx


def _delegated_graph():
    """The top-level graph of a TOSA-FP lowering: placeholders, one delegate call, getitems."""
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower

    module, example = models.tiny_cnn()
    spec = TosaCompileSpec("TOSA-1.0+FP")
    edge = to_edge_transform_and_lower(torch.export.export(module, example), partitioner=[TOSAPartitioner(spec)])
    gm = edge.exported_program().graph_module
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target)]
    return gm, getattr(gm, call.args[0].target)


def _delegate_val(gm):
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target)]
    return call.meta["val"]


def test_delegate_run_is_reused_only_while_its_program_is_unchanged():
    from executorch.exir.pass_base import ExportPass

    gm, lowered = _delegated_graph()
    with retrace.reuse_fake_propagation():
        first = ExportPass()(gm).graph_module
        retrace.reset_stats()
        second = ExportPass()(first).graph_module
        assert retrace.stats()["reused"] == 1  # the delegate call; nothing else in this graph is an op
        assert all(a is b for a, b in zip(_delegate_val(first), _delegate_val(second), strict=True))

        # Make the delegate's program return an earlier, differently shaped node: its run
        # now gives another shape, and the reuse must notice although nothing else changed.
        program = lowered.original_module.graph
        output = program.output_node()
        earlier = next(n for n in program.nodes if n.op == "call_function" and n.meta["val"].dim() == 4)
        output.args = ((earlier,),)
        retrace.reset_stats()
        third = ExportPass()(second).graph_module
    assert retrace.stats()["reused"] == 0
    expected = ExportPass()(second).graph_module  # no reuse at all
    assert describe(third) == describe(expected)
    assert tuple(_delegate_val(third)[0].shape) == tuple(earlier.meta["val"].shape) != tuple(_delegate_val(second)[0].shape)


def test_delegate_run_is_not_reused_under_an_unaudited_torch(monkeypatch):
    from executorch.exir.pass_base import ExportPass

    from lowercache.speedups import delegatecall

    gm, _ = _delegated_graph()
    monkeypatch.setattr(delegatecall, "_AUDITED_DIGEST", "0" * 64)
    delegatecall._audited.cache_clear()
    try:
        with retrace.reuse_fake_propagation():
            first = ExportPass()(gm).graph_module
            retrace.reset_stats()
            ExportPass()(first)
        assert retrace.stats()["reused"] == 0
    finally:
        monkeypatch.undo()
        delegatecall._audited.cache_clear()


def test_torch_deprecated_pass_base_records_and_reuses():
    """``ReplaceViewOpsWithViewCopyOpsPass`` (torch's own ExportPass base) records its dispatches:
    the ExecuTorch retrace after it reuses them, and both give the stock graphs."""
    from executorch.exir.pass_base import ExportPass
    from torch._export.passes.replace_view_ops_with_view_copy_ops_pass import ReplaceViewOpsWithViewCopyOpsPass

    make = _exported(_Small(), (torch.randn(3, 4),))
    chain = [ReplaceViewOpsWithViewCopyOpsPass, ExportPass]
    expected = _run_passes(make, chain, reuse=False)
    retrace.reset_stats()
    got = _run_passes(make, chain, reuse=True)
    assert describe(got) == describe(expected)
    counts = retrace.stats()
    # the view pass dispatches all six ops (export's values have no records); the ExportPass
    # after it reuses every one of them (unhooked, it would find no records and dispatch six)
    assert (counts["redispatched_no_record"], counts["reused"]) == (6, 6), counts


def test_delegate_signature_refuses_what_it_cannot_describe():
    from lowercache.speedups import delegatecall

    _, lowered = _delegated_graph()
    assert delegatecall.signature(lowered) is not None
    ep = lowered.original_module

    ep.module = lambda *a, **k: None  # an instance's own module(): the run would not be the one described
    assert delegatecall.signature(lowered) is None
    del ep.module
    assert delegatecall.signature(lowered) is not None

    node = next(n for n in ep.graph.nodes if n.op == "call_function" and n.target != torch.ops.higher_order.executorch_call_delegate)
    target = node.target
    node.target = torch.ops.aten.relu_.default  # mutates its input: not a pure function of metadata
    assert delegatecall.signature(lowered) is None
    node.target = target

    name = next(iter(ep.state_dict))
    real = ep.state_dict[name]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        ep.state_dict[name] = mode.from_tensor(real)  # a fake constant: its conversion is not described
    assert delegatecall.signature(lowered) is None
    ep.state_dict[name] = real
    assert delegatecall.signature(lowered) is not None
