"""Fast node copy: the stock bytes, the stock graphs node by node, and it really copies."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from lowercache.speedups import fastcopy, provenance, retrace
from lowercache.bench import models

from tests.helpers.graphs import PAIRS, Cond, churn_patch
from tests.helpers.oracle import reference, run_stock, stock_pte


@contextlib.contextmanager
def _mechanism(reuse: bool = True):
    """Fast copy as the flow runs it: with shared provenance and fake-value reuse."""
    fastcopy.reset_stats()
    retrace.reset_stats()
    with provenance.shared_provenance(), contextlib.ExitStack() as stack:
        if reuse:
            stack.enter_context(retrace.reuse_fake_propagation())
        stack.enter_context(fastcopy.fast_copy())
        yield
    assert not fastcopy.enabled()


@pytest.mark.parametrize(("model", "target"), PAIRS)
def test_pte_bytes_identical_and_copies_happen(model, target):
    expected = reference(model, target)
    with _mechanism():
        got = run_stock(*models.MODELS[model](), target)
    counts = fastcopy.stats()
    assert got == expected
    assert counts["copied"] > 0, counts
    assert counts["fallback_pass"] > 0, counts  # target ops and unaudited passes take the stock path
    assert counts["fallback_unaudited"] == 0, counts


def test_without_fake_value_reuse_still_identical():
    expected = reference("residual_cnn", "ethos-u55-128")
    with _mechanism(reuse=False):
        got = run_stock(*models.residual_cnn(), "ethos-u55-128")
    assert got == expected
    assert fastcopy.stats()["copied"] > 0
    assert retrace.stats()["reused"] == 0


# --- graph-level checks: everything a later step can read, node by node -------------


def _source(ns):
    """The newest link of a provenance chain: which node, under which pass, made this one.

    Deeper links are left out: the quantizer's part of the history already differs between
    two stock lowerings in one process. Fast copies hand on the old node's list either way.
    """
    return ("src", ns.name, str(ns.target), ns.pass_name, str(ns.action), len(ns.from_node))


def _canon(value):
    """A comparable rendering of a meta value."""
    from torch.fx.traceback import NodeSource

    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device, value.storage_offset(), value.requires_grad)
    if isinstance(value, NodeSource):
        return _source(value)
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_canon(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(k, _canon(v)) for k, v in value.items()])
    if isinstance(value, (int, float, str, bool, type(None), torch.dtype, torch.device)):
        return value
    return (type(value).__qualname__, re.sub(r" at 0x[0-9a-f]+", "", repr(value)))  # no addresses


def describe(gm: torch.fx.GraphModule, seq_nr: bool = True) -> list:
    """Names, ops, targets, args, kwargs, meta keys in order with their values; nested graphs too.

    ``seq_nr=False`` keeps the key but not its value: a node created without one takes the
    process-wide autograd sequence number, which the calibration run moves on between lowerings.
    """
    out = []
    for node in gm.graph.nodes:
        meta = [(k, _canon(v)) for k, v in node.meta.items()]
        # export's generated-code file names count up per process: not part of the comparison
        meta = [(k, re.sub(r"<eval_with_key>\.\d+", "<eval_with_key>", v) if k == "stack_trace" and isinstance(v, str) else v) for k, v in meta]
        if not seq_nr:
            meta = [(k, "-" if k == "seq_nr" else v) for k, v in meta]
        out.append((node.op, node.name, str(node.target), _canon(node.args), _canon(node.kwargs), meta))
    for name, child in gm.named_children():
        if isinstance(child, torch.fx.GraphModule):
            out.append(("child", name, describe(child, seq_nr)))
    return out


@contextlib.contextmanager
def _recording(log: list):
    """Record every ExportPass retrace's output graph and every Arm pass's result."""
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir.pass_base import _ExportPassBase

    retrace_call, arm_call = _ExportPassBase.call, ArmPass.__call__

    def call(self, gm):
        result = retrace_call(self, gm)
        log.append(("retrace", type(self).__name__, describe(result.graph_module, False), result.graph_module.code))
        return result

    def arm(self, gm):
        result = arm_call(self, gm)
        if result is not None:
            log.append(("arm", type(self).__name__, describe(result.graph_module, False)))
        return result

    _ExportPassBase.call, ArmPass.__call__ = call, arm
    try:
        yield
    finally:
        _ExportPassBase.call, ArmPass.__call__ = retrace_call, arm_call


@pytest.mark.parametrize(
    ("model", "target"),
    [("residual_cnn", "ethos-u55-128"), ("transformer_block", "tosa-fp"), ("transformer_block", "ethos-u55-128")],
)
def test_every_pass_output_matches_node_by_node(model, target):
    """Both Arm pipelines and the edge passes, compared after every retrace and every Arm pass.

    On the quantized targets the quantizer's passes see weights as get_attr
    tensors; nodes taking them are copied too, their get_attr nodes included.
    """
    stock_log: list = []
    with provenance.shared_provenance(), retrace.reuse_fake_propagation(), _recording(stock_log):
        expected = run_stock(*models.MODELS[model](), target)
    fast_log: list = []
    with _mechanism(), _recording(fast_log):
        got = run_stock(*models.MODELS[model](), target)
    assert got == expected
    assert len(fast_log) == len(stock_log)
    for stock, fast in zip(stock_log, fast_log):
        assert fast[:2] == stock[:2]
        assert fast == stock, f"{stock[0]} {stock[1]} differs"
    assert fastcopy.stats()["copied"] > 0
    if target != "tosa-fp":
        assert fastcopy.stats()["copied_attrs"] > 0


def _targeted_passes():
    from executorch.backends.arm._passes.arm_pass import ArmOpTargetedPass

    class _Targeted(ArmOpTargetedPass):
        _passes_required_after: set = set()

    class SumOverRows(_Targeted):
        """Rewrites ``sum`` over dim 1 into a sum over dim 0: every node downstream changes shape."""

        target_ops = {torch.ops.aten.sum.dim_IntList}

        def call_operator(self, op, args, kwargs, meta):
            if op not in self.target_ops:
                return super().call_operator(op, args, kwargs, meta)
            return super().call_operator(op, (args[0], [0]), kwargs, meta, updated=True)

    class ReluToHalf(_Targeted):
        """Follows relu with a float16 cast: downstream dtypes change."""

        target_ops = (torch.ops.aten.relu.default,)

        def call_operator(self, op, args, kwargs, meta, updated=False):
            if op not in self.target_ops:
                return super().call_operator(op, args, kwargs, meta, updated)
            out = super().call_operator(op, args, kwargs, meta, updated)
            return super().call_operator(torch.ops.aten._to_copy.default, (out,), {"dtype": torch.float16}, meta, True)

    class StaleRewrite(_Targeted):
        """Rewrites a non-target node in call() before super().call(), leaving its ``val`` stale."""

        target_ops = {torch.ops.aten.sigmoid.default}

        def call(self, graph_module):
            for node in graph_module.graph.nodes:
                if node.target == torch.ops.aten.mean.dim:
                    node.args = (node.args[0], [0])
            return super().call(graph_module)

    class Unguarded(_Targeted):
        """A call_operator that does not start with the guard: never fast-copied."""

        target_ops = {torch.ops.aten.sigmoid.default}

        def call_operator(self, op, args, kwargs, meta):
            meta = meta.copy()
            return super().call_operator(op, args, kwargs, meta)

    return SumOverRows, ReluToHalf, StaleRewrite, Unguarded


class _Small(torch.nn.Module):
    def forward(self, x):
        a = torch.relu(x)
        b = torch.sum(a, dim=[1])
        c = a.permute(1, 0)
        d = torch.split(x, 1, dim=0)
        e = torch.mean(torch.sigmoid(x) + 1, dim=[1])
        return b * 2 + 1, c * 2, d[0] + 1, e.exp()


def _run_chain(chain, first=True, copies=None, **mechanism):
    """Export ``_Small`` (3x4 input) and run ``chain`` (after a plain ExportPass when ``first``).

    ``copies``, when given, receives the fast copies made by each pass, in order.
    """
    from executorch.exir.pass_base import ExportPass

    gm = torch.export.export(_Small(), (torch.randn(3, 4),), strict=False).graph_module
    log: list = []
    ctx = _mechanism(**mechanism) if mechanism else contextlib.nullcontext()
    with ctx:
        for p in ((ExportPass,) if first else ()) + tuple(chain):
            before = fastcopy.stats()["copied"]
            gm = p()(gm).graph_module
            log.append((p.__name__, describe(gm), gm.code))
            if copies is not None:
                copies.append(fastcopy.stats()["copied"] - before)
    return log


@pytest.mark.parametrize("reuse", [True, False])
def test_targeted_passes_match_node_by_node(reuse):
    SumOverRows, ReluToHalf, StaleRewrite, Unguarded = _targeted_passes()
    chain = [SumOverRows, ReluToHalf, StaleRewrite, Unguarded, StaleRewrite]
    stock = _run_chain(chain)
    copies: list = []
    fast = _run_chain(chain, copies=copies, reuse=reuse)
    counts = fastcopy.stats()
    # 12 op nodes (13 once ReluToHalf adds a cast). The first retrace after export finds no
    # ``from_node`` yet; guarded passes copy all but their targets; StaleRewrite does not override
    # call_operator (target_ops only gate whether it runs); Unguarded copies nothing.
    assert copies == [0, 11, 11, 13, 0, 13], copies
    for (name, s_desc, s_code), (_, f_desc, f_code) in zip(stock, fast):
        assert f_desc == s_desc, name
        assert f_code == s_code, name
    assert counts["copied"] > 0 and counts["fallback_pass"] > 0, counts
    if reuse:
        assert retrace.stats()["redispatched_changed"] > 0  # downstream of the rewrites
    vals = {}
    for op, _name, target, _args, _kwargs, meta in fast[-1][1]:
        if op == "call_function":
            vals.setdefault(target, []).append(dict(meta)["val"])
    assert [v[1] for v in vals["aten.sum.dim_IntList"]] == [(4,)]  # SumOverRows: over dim 0 of a 3x4
    assert [v[1] for v in vals["aten.mean.dim"]] == [(4,)]  # StaleRewrite: recomputed, not the stale (3,)
    assert [v[3] for v in vals["aten._to_copy.default"]] == [torch.float16]  # ReluToHalf
    assert [v[3] for v in vals["aten.sum.dim_IntList"]] == [torch.float16]  # downstream dtype follows
    assert [v[1] for v in vals["aten.exp.default"]] == [(4,)]


class _Attrs(torch.nn.Module):
    """Weights as an unlifted graph holds them: parameters, a buffer, one used twice, one in a list."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.token = torch.nn.Parameter(torch.randn(1, 4))
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x):
        y = self.linear(x) + self.shift
        z = torch.cat([self.token, y, self.token], dim=0)
        return z * self.shift, torch.nn.functional.linear(z, self.linear.weight)


def test_get_attr_arguments_are_copied_with_stock_nodes_and_meta():
    """A node fed by get_attr tensors is copied; the tracer makes their get_attr nodes as stock does."""
    from executorch.exir.pass_base import ExportPass

    def run(mechanism: bool):
        gm = torch.export.export(_Attrs(), (torch.randn(3, 4),), strict=False).module(check_guards=False)
        log = []
        with _mechanism() if mechanism else contextlib.nullcontext():
            for _ in range(3):
                gm = ExportPass()(gm).graph_module
                log.append((describe(gm, False), gm.code, sorted(dict(gm.named_parameters())), sorted(dict(gm.named_buffers()))))
        return log

    stock = run(False)
    fast = run(True)
    assert fast == stock
    assert "get_attr" in [op for op, *_ in stock[-1][0]]
    counts = fastcopy.stats()
    assert counts["copied_attrs"] >= 2 * 5, counts  # two retraces after the first: linear, add, cat, mul, linear


def test_unguarded_pass_falls_back_for_every_node():
    *_, Unguarded = _targeted_passes()
    stock = _run_chain([Unguarded], first=False)
    fast = _run_chain([Unguarded], first=False, reuse=True)
    assert fast == stock
    counts = fastcopy.stats()
    assert counts["copied"] == 0 and counts["fallback_pass"] > 0, counts


def test_override_after_arm_pass_in_the_mro_is_never_skipped():
    """A guarded pass whose MRO puts another ``call_operator`` after ArmPass (a diamond) is not trusted:
    ArmPass's ``super()`` reaches that override for every node."""
    from executorch.exir.pass_base import ExportPass

    SumOverRows, *_ = _targeted_passes()

    class SigmoidToRelu(ExportPass):
        def call_operator(self, op, args, kwargs, meta):
            if op == torch.ops.aten.sigmoid.default:
                op = torch.ops.aten.relu.default
            return super().call_operator(op, args, kwargs, meta)

    class Diamond(SumOverRows, SigmoidToRelu):
        pass

    mro = Diamond.__mro__
    assert mro.index(SigmoidToRelu) > [k.__name__ for k in mro].index("ArmPass")
    assert fastcopy._chain(Diamond, fastcopy._setup()) is None
    assert len(fastcopy._chain(SumOverRows, fastcopy._setup())) == 1
    stock = _run_chain([Diamond])
    fast = _run_chain([Diamond], reuse=True)
    assert fast == stock
    assert "aten.relu.default" in stock[-1][2] and "aten.sigmoid" not in stock[-1][2]
    assert fastcopy.stats()["fallback_pass"] > 0


def test_control_flow_submodules_fall_back_and_match():
    from executorch.exir.pass_base import ExportPass

    def run(**mechanism):
        gm = torch.export.export(Cond(), (torch.randn(2, 3),), strict=False).graph_module
        ctx = _mechanism(**mechanism) if mechanism else contextlib.nullcontext()
        with ctx:
            for _ in range(3):
                gm = ExportPass()(gm).graph_module
        return describe(gm), gm.code

    stock = run()
    fast = run(reuse=True)
    assert fast == stock
    counts = fastcopy.stats()
    assert counts["fallback_nested"] > 0 and counts["copied"] > 0, counts


def test_guard_recognition():
    from executorch.exir.pass_base import ExportPass

    st = fastcopy._setup()
    assert st is not None, "installed torch / ExecuTorch sources differ from the audited ones"

    class Guard(ExportPass):
        target_ops = ()

        def call_operator(self, op, args, kwargs, meta):
            """A docstring first is fine."""
            if op not in self.target_ops or self.other(meta):
                return super().call_operator(op, args, kwargs, meta)
            return None

    class SwappedArgs(ExportPass):
        target_ops = ()

        def call_operator(self, op, args, kwargs, meta):
            if op not in self.target_ops:
                return super().call_operator(op, kwargs, args, meta)
            return None

    class LateGuard(ExportPass):
        target_ops = ()

        def call_operator(self, op, args, kwargs, meta):
            self.seen = op
            if op not in self.target_ops:
                return super().call_operator(op, args, kwargs, meta)
            return None

    class OtherSet(ExportPass):
        """Guarded by a set of its own (as DecomposeDynamicFullPass is): that set decides."""

        target_ops = ()
        others = (torch.ops.aten.relu.default,)

        def call_operator(self, op, args, kwargs, meta):
            if op not in self.others:
                return super().call_operator(op, args, kwargs, meta)
            return None

    class NotSelf(ExportPass):
        def call_operator(self, op, args, kwargs, meta):
            if op not in Guard.target_ops:
                return super().call_operator(op, args, kwargs, meta)
            return None

    class UpdatedToBase(ExportPass):
        """Forwards ``updated`` to a base call_operator that does not take it (stock raises)."""

        target_ops = ()

        def call_operator(self, op, args, kwargs, meta, updated=False):
            if op not in self.target_ops:
                return super().call_operator(op, args, kwargs, meta, updated)
            return None

    class Plain(ExportPass):
        pass

    class Borrowed(ExportPass):
        """Another class's guard: its ``super()`` would start after that class, not this one."""

        target_ops = ()
        call_operator = Guard.call_operator

    relu, exp = torch.ops.aten.relu.default, torch.ops.aten.exp.default
    (guard,) = fastcopy._chain(Guard, st)
    assert guard(Guard(), None, relu, {}) is relu  # not a target: handed on unchanged
    Guard.target_ops = (relu,)
    assert guard(Guard(), None, relu, {}) is None  # the set is read when the node is copied
    (other,) = fastcopy._chain(OtherSet, st)
    assert other(OtherSet(), None, relu, {}) is None and other(OtherSet(), None, exp, {}) is exp
    assert fastcopy._chain(Plain, st) == ()
    for cls in (SwappedArgs, LateGuard, NotSelf, UpdatedToBase, Borrowed):
        assert fastcopy._chain(cls, st) is None, cls.__name__


def test_guard_on_a_set_of_its_own_matches_node_by_node():
    """``if op not in self.<set>`` guards like ``target_ops``: all but that set's nodes are copied."""
    SumOverRows, *_ = _targeted_passes()

    class ExpToSigmoid(SumOverRows.__mro__[1]):
        target_ops = {torch.ops.aten.exp.default, torch.ops.aten.relu.default}  # relu: in target_ops, not rewritten
        rewritten = {torch.ops.aten.exp.default}

        def call_operator(self, op, args, kwargs, meta, updated=False):
            if op not in self.rewritten:
                return super().call_operator(op, args, kwargs, meta, updated)
            return super().call_operator(torch.ops.aten.sigmoid.default, args, kwargs, meta, True)

    stock = _run_chain([SumOverRows, ExpToSigmoid])
    copies: list = []
    fast = _run_chain([SumOverRows, ExpToSigmoid], copies=copies, reuse=True)
    assert fast == stock
    assert copies == [0, 11, 11], copies  # relu copied too: only the guard's own set is interpreted
    assert "aten.exp" not in stock[-1][2] and stock[-1][2].count("aten.sigmoid") == 2


class _Declared(torch.nn.Module):
    """Ops that the declared ExecuTorch passes rewrite (t, a mixed-dtype add, a view) among ones they leave."""

    def forward(self, x, i):
        a = torch.relu(x).t()
        b = a.permute(1, 0) + i
        c = torch.sigmoid(b) - x
        return torch.add(c.exp(), 2), torch.mean(c, dim=[0])


def _declared_passes():
    from executorch.exir.passes.legalize_portable_dim_order_pass import LegalizePortableDimOrderPass
    from executorch.exir.passes.memory_format_ops_pass import MemoryFormatOpsPass
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
    from executorch.exir.passes.replace_aten_with_edge_pass import OpReplacePass
    from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import (
        ReplaceBrokenOpsWithFunctionalOpsPass,
    )
    from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
    from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass

    return [
        NormalizeTransposePass,
        ScalarToTensorPass,
        RemoveMixedTypeOperators,
        ReplaceBrokenOpsWithFunctionalOpsPass,
        OpReplacePass,
        SymToTensorPass,
        MemoryFormatOpsPass,
        LegalizePortableDimOrderPass,
    ]


def _run_declared(**mechanism):
    from executorch.exir.pass_base import ExportPass

    gm = torch.export.export(_Declared(), (torch.randn(3, 4), torch.ones(3, 4, dtype=torch.int32)), strict=False)
    gm = gm.graph_module
    log, copies = [], []
    with _mechanism(**mechanism) if mechanism else contextlib.nullcontext():
        for p in [ExportPass, *_declared_passes()]:
            before = fastcopy.stats()["copied"]
            gm = p()(gm).graph_module
            log.append((p.__name__, describe(gm), gm.code))
            copies.append(fastcopy.stats()["copied"] - before)
    return log, copies


def test_declared_passes_match_node_by_node():
    """ExecuTorch passes gated by passregistry: copies happen, and every graph equals stock's."""
    stock, _ = _run_declared()
    fast, copies = _run_declared(reuse=True)
    for (name, s_desc, s_code), (_, f_desc, f_code) in zip(stock, fast):
        assert f_desc == s_desc, name
        assert f_code == s_code, name
    assert all(c > 0 for c in copies[1:]), copies
    ops = " ".join(row[2].split(">")[0] for row in fast[-1][1] if row[0] == "call_function")
    # the rewrites still ran: t -> t_copy, view -> copy, mixed dtypes -> a cast (as a dim-order copy), aten -> edge
    for op in ("aten.t_copy.default", "aten.permute_copy.default", "dim_order_ops._to_dim_order_copy.default"):
        assert f"<EdgeOpOverload: {op}" in ops, ops
    assert ops.count("_to_dim_order_copy") == 2, ops  # one for the int input, one for the scalar made a tensor


def test_declared_gates_apply_only_to_the_read_source(monkeypatch):
    from lowercache.speedups import passregistry

    st = fastcopy._setup()
    assert st is not None
    for cls in _declared_passes():
        assert passregistry.gate_for(cls) is not None, cls.__name__  # the pinned digests match the installed sources
    cls = _declared_passes()[0]
    key = (cls.__module__, cls.__qualname__)
    monkeypatch.setitem(passregistry.REGISTRY, key, ("0" * 64, passregistry.REGISTRY[key][1]))
    monkeypatch.setattr(fastcopy, "_chains", {})
    assert passregistry.gate_for(cls) is None
    assert fastcopy._chain(cls, st) is None


def test_audited_sources_digest():
    assert fastcopy.sources_digest() == fastcopy._AUDITED_DIGEST


def test_enable_disable_reference_counted_and_restores_originals():
    from executorch.exir.pass_base import ExportPass

    assert "run_node" not in ExportPass.ExportInterpreter.__dict__
    with fastcopy.fast_copy():
        with fastcopy.fast_copy():
            assert fastcopy.enabled()
        assert fastcopy.enabled()
    assert not fastcopy.enabled()
    assert "run_node" not in ExportPass.ExportInterpreter.__dict__

    churn_patch(fastcopy.enable, fastcopy.disable)
    assert not fastcopy.enabled()
    assert "run_node" not in ExportPass.ExportInterpreter.__dict__


class _GroupedConvs(torch.nn.Module):
    """A grouped conv (decomposed by DecomposeGroupedConvPass), a depthwise and a plain one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.grouped = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.plain = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.plain(torch.relu(self.depthwise(torch.relu(self.grouped(x))))).flatten(1)


def _pass_nodes(records: list, *names: str) -> dict[str, dict[str, int]]:
    """Node counts (retraced, copied, copied_fast) summed per pass over a lowering's records, for ``names``."""
    nodes: dict[str, dict[str, int]] = {}
    for record in records:
        if record["kind"] == "pass" and record["name"] in names:
            counts = nodes.setdefault(record["name"], {})
            for key, value in record.get("nodes", {}).items():
                counts[key] = counts.get(key, 0) + value
    return nodes


def test_declared_arm_gates_copy_and_keep_stock_bytes(tmp_path, monkeypatch):
    """SymbolicToTosaShapesPass and DecomposeGroupedConvPass: fast copies where their call_operator
    hands the node on, their own rewrite where it does not, and stock's bytes. (``retraceskip`` would skip the
    first's retrace whole, on this graph: off here.)"""
    import lowercache
    from executorch.backends.arm._passes.decompose_grouped_conv_pass import DecomposeGroupedConvPass
    from executorch.backends.arm._passes.symbolic_to_tosa_shape_pass import SymbolicToTosaShapesPass

    from lowercache.speedups import passregistry

    for cls in (SymbolicToTosaShapesPass, DecomposeGroupedConvPass):
        assert passregistry.gate_for(cls) is not None, cls.__name__  # pinned digests match the installed sources
    module, example = _GroupedConvs().eval(), (torch.randn(1, 8, 8, 8),)
    expected = stock_pte(module, example, "ethos-u55-128")
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "all,-retraceskip")
    artifacts = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path)
    assert artifacts.pte == expected
    nodes = _pass_nodes(artifacts.records, "SymbolicToTosaShapesPass", "DecomposeGroupedConvPass")
    assert nodes["SymbolicToTosaShapesPass"].get("copied_fast", 0) > 0, nodes
    grouped = nodes["DecomposeGroupedConvPass"]
    assert grouped.get("copied_fast", 0) > 0, nodes  # the plain conv and everything else
    assert grouped.get("retraced", 0) > 0, nodes  # the grouped conv went through the pass: slices, convs, cat


class _Scalars(torch.nn.Module):
    """Scalar arithmetic (replaced by tensors), a remainder (kept in the quantizer's pipeline) and a linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x) * 0.5 + 2.0
        return torch.relu(y - torch.remainder(x, 3.0)) / 4.0


@pytest.mark.parametrize("target", ["ethos-u55-128", "tosa-fp"])
def test_scalar_with_tensor_by_profile_gate_copies_and_keeps_stock_bytes(tmp_path, target):
    """ReplaceScalarWithTensorByProfilePass (in the quantizer's pipeline and the TOSA one):
    fast copies of the ops it hands on, its replacements still made, stock's bytes."""
    import lowercache
    from executorch.backends.arm._passes.replace_scalar_with_tensor_pass import ReplaceScalarWithTensorByProfilePass

    from lowercache.speedups import passregistry

    assert passregistry.gate_for(ReplaceScalarWithTensorByProfilePass) is not None  # pinned digests match
    module, example = _Scalars().eval(), (torch.randn(2, 8),)
    artifacts = lowercache.lower(module, example, target=target, cache_dir=tmp_path)
    assert artifacts.pte == stock_pte(module, example, target)
    nodes = _pass_nodes(artifacts.records, "ReplaceScalarWithTensorByProfilePass").get("ReplaceScalarWithTensorByProfilePass", {})
    assert nodes.get("copied_fast", 0) > 0, nodes
    assert nodes.get("retraced", 0) > 0, nodes  # the scalar ops went through the pass and were replaced


class _ClampsAndFull(torch.nn.Module):
    """relu6 (a clamp once converted) and a ``full``, among ops neither pass touches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.nn.functional.relu6(self.fc(x)) + torch.full((2, 8), 0.5)
        return torch.sigmoid(y) * 2.0


def test_clamp_and_dynamic_full_passes_copy_and_keep_stock_bytes(tmp_path):
    """DecomposeTOSAUnsupportedClampPass (declared gate) and DecomposeDynamicFullPass (a guard on a set
    of its own): fast copies of everything but their targets, stock's bytes."""
    import lowercache
    from executorch.backends.arm._passes.decompose_dynamic_full_pass import DecomposeDynamicFullPass
    from executorch.backends.arm._passes.decompose_tosa_unsupported_clamp_pass import DecomposeTOSAUnsupportedClampPass

    from lowercache.speedups import passregistry

    assert passregistry.gate_for(DecomposeTOSAUnsupportedClampPass) is not None  # pinned digest matches
    assert len(fastcopy._chain(DecomposeDynamicFullPass, fastcopy._setup())) == 1
    module, example = _ClampsAndFull().eval(), (torch.randn(2, 8),)
    artifacts = lowercache.lower(module, example, target="tosa-fp", cache_dir=tmp_path)
    assert artifacts.pte == stock_pte(module, example, "tosa-fp")
    names = ("DecomposeTOSAUnsupportedClampPass", "DecomposeDynamicFullPass")
    for record in artifacts.records:
        if record["kind"] == "pass" and record["name"] in names:
            assert record["outcome"] == "ran", record
    nodes = _pass_nodes(artifacts.records, *names)
    assert set(nodes) == {"DecomposeTOSAUnsupportedClampPass", "DecomposeDynamicFullPass"}, nodes
    for name, counts in nodes.items():
        assert counts.get("copied_fast", 0) > 0, (name, nodes)
        interpreted = counts.get("copied", 0) + counts.get("retraced", 0) - counts["copied_fast"]
        assert interpreted > 0, (name, nodes)  # their targets went through the pass


class _ArmSpecial(torch.nn.Module):
    def forward(self, x, y):
        return torch.nn.functional.leaky_relu(torch.bmm(x, y), 0.1) + 1


@pytest.mark.parametrize("quantized", [False, True])
def test_arm_special_ops_copied_unless_they_carry_input_qparams(quantized):
    """ArmPass.call_operator builds bmm and leaky_relu itself only when input qparams are set.

    Without them (float flows) the nodes are copied; with them they take the stock path,
    and the graphs match the stock retrace's either way.
    """
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir import EdgeCompileConfig, to_edge

    class Plain(ArmPass):
        _passes_required_after: set = set()

    def run(mechanism: bool):
        inputs = (torch.randn(2, 3, 4), torch.randn(2, 4, 5))
        ep = to_edge(torch.export.export(_ArmSpecial(), inputs), compile_config=EdgeCompileConfig(_check_ir_validity=False))
        gm = ep.exported_program().graph_module
        special = [n for n in gm.graph.nodes if "bmm" in str(n.target) or "leaky_relu" in str(n.target)]
        assert len(special) == 2
        if quantized:
            for node in special:
                node.meta["input_qparams"] = {0: "qparams"}
        log = []
        with _mechanism() if mechanism else contextlib.nullcontext():
            for _ in range(3):
                gm = Plain()(gm).graph_module
                log.append((describe(gm, False), gm.code))
        return log

    stock = run(False)
    fast = run(True)
    assert fast == stock
    ops = sum(1 for op, *_ in stock[-1][0] if op == "call_function")
    counts = fastcopy.stats()
    # three retraces, each copying every op but (with qparams) bmm and leaky_relu
    assert counts["copied"] == 3 * (ops - 2 if quantized else ops), (ops, counts)
    assert counts["fallback_pass"] == (3 * 2 if quantized else 0), counts


def test_graph_create_node_mirror_equals_torchs():
    """Same names, arguments, order, lookup table, length and create-node hooks as ``Graph.create_node``."""
    st = fastcopy._setup()
    assert st is not None

    def build(create):
        root = torch.nn.Module()
        gm = torch.fx.GraphModule(root, torch.fx.Graph())
        seen = []
        gm._register_create_node_hook(lambda n: seen.append(n.name))
        g = gm.graph
        x = g.placeholder("x")
        made = [x]
        for target, args, kwargs in (
            (torch.ops.aten.relu.default, (x,), {}),
            (torch.ops.aten.add.Tensor, (x, x), {"alpha": 2}),
            (torch.ops.aten.relu.default, (x,), {}),
            (torch.ops.aten.cat.default, ([x, x], 1), {}),
        ):
            made.append(create(g, target, tuple(a if a is not x else made[-1] for a in args), kwargs))
        g.output(made[-1])
        return g, seen

    def torchs(g, target, args, kwargs):
        return g.create_node("call_function", target, args, kwargs, None, None)

    def mirror(g, target, args, kwargs):
        return fastcopy._graph_create_node(g, target, args, kwargs, None, st)

    (a, seen_a), (b, seen_b) = build(torchs), build(mirror)
    assert seen_a == seen_b and len(seen_a) == 6
    assert len(a.nodes) == len(b.nodes) == a._len == b._len == 6
    assert [(n.op, n.name, n.target, str(n.args), str(n.kwargs), type(n.kwargs)) for n in a.nodes] == [
        (n.op, n.name, n.target, str(n.args), str(n.kwargs), type(n.kwargs)) for n in b.nodes
    ]
    relu = torch.ops.aten.relu.default
    assert [n.name for n in a.find_nodes(op="call_function", target=relu)] == [
        n.name for n in b.find_nodes(op="call_function", target=relu)
    ]
    a.lint()
    b.lint()


def _gate_cases():
    """(pass class, TOSA spec, op, argument values, kwargs, node meta) for each declared Arm gate: inputs the pass
    hands on, and inputs it rewrites. A tensor value becomes a placeholder; ``("shape", [..])`` a CONST_SHAPE node."""
    from executorch.backends.arm._passes.decompose_gelu_pass import DecomposeGeluPass
    from executorch.backends.arm._passes.decompose_permute_for_u55_pass import DecomposePermuteForU55Pass
    from executorch.backends.arm._passes.insert_data_layout_casts_pass import InsertDataLayoutCastsPass
    from executorch.backends.arm._passes.insert_dynamic_padding import InsertDynamicPaddingPass
    from executorch.backends.arm._passes.remove_noop_pass import RemoveNoopPass
    from executorch.backends.arm._passes.rewrite_high_rank_singleton_permute_pass import (
        RewriteHighRankSingletonPermutePass,
    )
    from executorch.exir.dialects._ops import ops as exir_ops

    edge, tosa = exir_ops.edge.aten, exir_ops.backend.tosa
    f32, i8, i32 = torch.float32, torch.int8, torch.int32
    qparams = {"input_qparams": {0: object()}, "output_qparams": {0: object()}}
    INT, FP, U55 = "TOSA-1.0+INT", "TOSA-1.0+FP", "TOSA-1.0+INT+u55"

    def t(*shape, dtype=f32):
        return ("tensor", shape, dtype)

    return [
        (DecomposeGeluPass, FP, edge.gelu.default, (t(1, 8),), {}, {}),
        (DecomposeGeluPass, INT, edge.gelu.default, (t(1, 8, dtype=i8),), {}, qparams),
        (DecomposeGeluPass, FP, edge.relu.default, (t(1, 8),), {}, {}),
        (RemoveNoopPass, FP, edge.cat.default, ([t(1, 8)],), {}, {}),
        (RemoveNoopPass, FP, edge.cat.default, ([t(1, 8), t(1, 8)],), {}, {}),
        (RemoveNoopPass, FP, exir_ops.edge.dim_order_ops._clone_dim_order.default, (t(1, 8),), {}, {}),
        (RemoveNoopPass, FP, exir_ops.edge.dim_order_ops._to_dim_order_copy.default, (t(1, 8),), {"dtype": i32}, {}),
        (RemoveNoopPass, FP, tosa.PAD.default, (t(1, 8), ("shape", [0, 0, 0, 0])), {}, {}),
        (RemoveNoopPass, FP, tosa.PAD.default, (t(1, 8), ("shape", [0, 1, 0, 0])), {}, {}),
        (RemoveNoopPass, FP, tosa.SLICE.default, (t(1, 8), ("shape", [0, 0]), ("shape", [1, 8])), {}, {}),
        (RemoveNoopPass, FP, tosa.SLICE.default, (t(1, 8), ("shape", [0, 2]), ("shape", [1, 4])), {}, {}),
        (RemoveNoopPass, FP, edge.upsample_nearest2d.vec, (t(1, 2, 4, 4), None, [1.0, 1.0]), {}, {}),
        (RemoveNoopPass, FP, edge.upsample_nearest2d.vec, (t(1, 2, 4, 4), None, [2.0, 2.0]), {}, {}),
        (RewriteHighRankSingletonPermutePass, FP, edge.permute_copy.default, (t(1, 8, 1, 4, 16), [0, 2, 1, 4, 3]), {},
         {"val": t(1, 1, 8, 16, 4)}),
        (RewriteHighRankSingletonPermutePass, FP, edge.permute_copy.default, (t(2, 8, 4, 16), [0, 2, 1, 3]), {},
         {"val": t(2, 4, 8, 16)}),
        (DecomposePermuteForU55Pass, U55, edge.permute_copy.default, (t(1, 8, 4, 16, dtype=i8), [0, 2, 1, 3]), {}, {}),
        (DecomposePermuteForU55Pass, INT, edge.permute_copy.default, (t(1, 300, 300, 4, dtype=i8), [0, 2, 1, 3]), {},
         {}),
        # Over the worst-case bound the pass asks Vela: the gate refuses without asking (conservative).
        (DecomposePermuteForU55Pass, U55, edge.permute_copy.default, (t(1, 300, 300, 4, dtype=i8), [0, 2, 1, 3]), {},
         {}),
        (InsertDataLayoutCastsPass, FP, edge.permute_copy.default, (t(1, 8, 4, 4), [0, 2, 1, 3]), {}, {}),
        (InsertDataLayoutCastsPass, FP, edge.permute_copy.default, (t(1, 8, 4, 4, dtype=i32), [0, 2, 1, 3]), {}, {}),
        (InsertDataLayoutCastsPass, INT, edge.cat.default, ([t(1, 8, dtype=i8), t(1, 8, dtype=i32)],), {}, {}),
        (InsertDynamicPaddingPass, INT, tosa.MAX_POOL2D.default, (t(1, 8, 8, 4, dtype=i8), [2, 2], [1, 1], [0, 0, 0, 0]),
         {}, {}),
        (InsertDynamicPaddingPass, INT, tosa.MAX_POOL2D.default,
         (t(1, 8, 8, 4, dtype=i8), [2, 2], [1, 1], [0, ("shape", [1]), 0, 0]), {}, {}),
    ]


_CONSERVATIVE = {17}  # cases where the gate may refuse a node the pass hands on


@pytest.mark.parametrize("case", range(23))
def test_declared_arm_gates_hand_on_only_what_the_pass_hands_on(case, monkeypatch):
    """Each new declared gate against its pass: where the gate says the node is handed on, the pass's own
    ``call_operator`` (its base call stubbed out) reaches ``ArmPass.call_operator`` once, with the same op and the
    very arguments it was given, and nowhere else (the cases give each gate inputs of both kinds)."""
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.backends.arm.tosa.specification import TosaLoweringContext, TosaSpecification
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import NodeMetadata, ProxyValue
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowercache.speedups import passregistry

    cases = _gate_cases()
    assert len(cases) == 23
    klass, spec, op, values, kwargs, meta = cases[case]
    gate = passregistry.gate_for(klass)
    assert gate is not None, klass.__name__  # the pinned digest matches the installed source
    graph, env = torch.fx.Graph(), {}
    with FakeTensorMode():
        def node(value):
            if isinstance(value, list):
                return [node(v) for v in value]
            if not isinstance(value, tuple):
                return value
            if value[0] == "shape":
                made = graph.call_function(exir_ops.backend.tosa.CONST_SHAPE.default, (value[1],))
                made.meta["val"] = list(value[1])
            else:
                made = graph.placeholder(f"x{len(env)}")
                made.meta["val"] = torch.empty(value[1], dtype=value[2])
            env[made] = ProxyValue(made.meta["val"], made)
            return made

        n = graph.call_function(op, tuple(node(v) for v in values), kwargs)
        n.meta.update({k: node(v) if k == "val" else v for k, v in meta.items()})
        n.meta.update({"val": n.meta["val"].meta["val"]} if "val" in meta else {})
    p = klass()
    calls = []

    def base(self, op_, args_, kwargs_, meta_, updated=False):
        calls.append((op_, args_, kwargs_))
        return "handed on"

    args, kw = torch.fx.node.map_arg(n.args, env.__getitem__), torch.fx.node.map_arg(n.kwargs, env.__getitem__)
    with TosaLoweringContext(TosaSpecification.create_from_string(spec)):
        said = gate(p, n, op, env)
        if case in _CONSERVATIVE:
            assert said is None
            return
        monkeypatch.setattr(ArmPass, "call_operator", base)
        try:
            result = klass.call_operator(p, op, args, kw, NodeMetadata(n.meta))
        except Exception:
            result = None
    handed_on = result == "handed on" and len(calls) == 1 and calls[0][0] is op and calls[0][1] is args
    assert said in (op, None)
    assert (said is op) == handed_on, (klass.__name__, said, calls)
