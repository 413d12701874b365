"""PropagateViewCopyPermute{Up,Down}: between its rounds of moves, the nodes a round changed get the values a
retrace would give them, in place, and the pass's last retrace runs as stock runs it.

Why it is exact, and figures: docs/speedups.md#propagate.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from . import oppolicy, retrace, retraceskip
from .patching import Counters, Patch
from .sourcepin import source_digest

# sha256 over the sources of _audited_sources() (executorch 1.5.1, torch 2.13.0).
_AUDITED_DIGEST = "2cec7915aa067f798b66af6461aff8ba5964e81557e24eed19852a703417bbfc"
_originals: dict[str, Any] = {}
_tls = threading.local()

_counts = Counters("real", "local", "final", "refused")
_count = _counts.count


def stats() -> dict[str, int]:
    """Retraces since :func:`reset_stats`: ``real`` (stock), ``local`` (made in place), ``final`` (the stock
    retrace that ends a call whose last retrace was local), ``refused`` (a local one refused, run stock)."""
    return _counts.snapshot()


def reset_stats() -> None:
    _counts.reset()


def _module() -> Any:
    from executorch.backends.transforms import propagate_view_copy_permute_pass

    return propagate_view_copy_permute_pass


def _audited_sources() -> list[Any]:
    """The functions whose behaviour a local round reproduces, or that decide when one may run."""
    import torch.fx
    import torch.fx.proxy
    import torch.fx.traceback
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir.pass_base import ExportPass, _ExportPassBase

    base = _module().PropagateViewCopyPermutePass
    return [
        base.call,
        base._retrace,
        retraceskip.original_call(),  # the retraceskip speed-up may have replaced it
        _ExportPassBase.inputs,
        _ExportPassBase.call_submodule,
        ExportPass.call_submodule,
        _ExportPassBase.placeholder,
        _ExportPassBase.output,
        _ExportPassBase.call_operator,
        retrace.original("_fx", _ExportPassBase._fx),  # the retrace speed-up may have replaced it
        _ExportPassBase.ExportTracer.set_metadata,
        _ExportPassBase.ExportInterpreter.call_function,
        ExportPass.ExportInterpreter.call_function,
        ArmPass.call_operator,
        ArmPass.call_submodule,
        torch.fx.Interpreter.call_function,
        torch.fx.proxy.TracerBase.create_node,  # the metadata a retrace copies, and in what key order
        torch.fx.traceback.set_current_meta,  # the provenance it records
    ]


def sources_digest() -> str | None:
    """Digest of the audited sources as installed."""
    return source_digest(*_audited_sources())


class _Call:
    """One ``call`` of the pass: the graph its last retrace left, and what each operator node held then."""

    __slots__ = ("pass_", "module", "graph", "snapshot", "pending")

    def __init__(self, pass_: Any) -> None:
        self.pass_ = pass_
        self.module: Any = None
        self.graph: Any = None
        self.snapshot: dict[Any, tuple] | None = None
        self.pending = False


def _loop_site(call: Any) -> int | None:
    """The line of ``call``'s retrace after a round of moves (the one inside ``while True``); None if not one such.

    The retraces before the loop and after it stay stock: the last one names every node from the graph alone.
    """
    import ast
    import inspect
    import textwrap

    lines, first = inspect.getsourcelines(call)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    sites = [
        node.lineno
        for loop in ast.walk(tree) if isinstance(loop, ast.While)
        for node in ast.walk(loop)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_retrace"
    ]
    return first + sites[0] - 1 if len(sites) == 1 else None


def _call(self: Any, graph_module: Any) -> Any:
    stack = _tls.__dict__.setdefault("stack", [])
    state = _Call(self)
    stack.append(state)
    try:
        result = _originals["call"](self, graph_module)
    finally:
        stack.pop()
    if state.pending and result.graph_module is state.module:
        # Never expected (the call's last retrace is stock's): the stock retrace, so that names come from it.
        _count("final")
        from torch.fx.passes.infra.pass_base import PassResult

        return PassResult(_originals["_retrace"](self, result.graph_module), result.modified)
    return result


def _retrace(self: Any, graph_module: Any) -> Any:
    stack = getattr(_tls, "stack", None)
    state = stack[-1] if stack and stack[-1].pass_ is self else None
    caller = sys._getframe(1)
    at_loop = caller.f_code is _originals["call"].__code__ and caller.f_lineno == _originals["loop_site"]
    if state is not None and at_loop and state.snapshot is not None and state.graph is graph_module.graph:
        if _update(self, graph_module, state):
            _count("local")
            state.pending = True
            return graph_module
        _count("refused")
    result = _originals["_retrace"](self, graph_module)
    _count("real")
    if state is not None:
        state.module, state.graph, state.pending = result, result.graph, False
        state.snapshot = _snapshot(result.graph)
    return result


def _snapshot(graph: Any) -> dict[Any, tuple]:
    """Each operator node's argument objects (immutable: a change replaces them), target, value and its metadata."""
    return {n: (n.args, n.kwargs, n.target, n.meta.get("val"), retrace.tensor_signature(n.meta.get("val")))
            for n in graph.nodes if n.op == "call_function"}


def _eligible(self: Any, graph_module: Any, mode: Any) -> bool:
    """Whether every node is of the kinds a local round reproduces, as the stock retrace would treat it."""
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir.pass_base import _ExportPassBase

    call_operator = type(self).call_operator
    if call_operator not in (ArmPass.call_operator, _ExportPassBase.call_operator) or "args" in graph_module.meta:
        return False
    if "call_operator" in self.__dict__ or "_fx" in self.__dict__:
        return False
    special = _arm_special() if call_operator is ArmPass.call_operator else frozenset()
    for n in graph_module.graph.nodes:
        if n.op == "placeholder":
            value = n.meta.get("val")
            if n.name != n.target or retrace.tensor_signature(value) is None or value.fake_mode is not mode:
                return False
        elif n.op == "call_function":
            if "from_node" not in n.meta:
                return False  # a retrace would record this node itself as the source, under its retrace-time name
            if oppolicy.policy(n.target) is None or type(n.target).__name__ not in ("EdgeOpOverload", "BackendOpOverload"):
                return False
            if n.target in special and n.meta.get("input_qparams"):
                return False  # ArmPass.call_operator makes their value from the old one
        elif n.op != "output":
            return False
    return True


def _arm_special() -> frozenset:
    from executorch.exir.dialects._ops import ops as exir_ops

    return frozenset({exir_ops.edge.aten.bmm.default, exir_ops.edge.aten.leaky_relu.default})


def _update(self: Any, graph_module: Any, state: _Call) -> bool:
    """The retrace's effect on the graph, made in place; False when refused (the stock retrace then runs).

    Stock removes dead code, lints, then retraces. A retrace gives every
    operator node the value its operator computes from its inputs' values. A
    node that holds the same operator, argument objects and value (with the
    same metadata) as after the last retrace, and none of whose inputs
    changed value, would get a value with the metadata it holds: it keeps it.
    The others are dispatched as the retrace dispatches them, in graph order.
    Users are put in graph order, as a retrace creates them. Nothing is
    changed but dead code before every node is known to be of a kind this
    reproduces. When a dispatch raises or returns what this does not
    reproduce, the stock retrace runs on the graph as it is: it reads no
    operator node's value (the two operators of ``ArmPass`` that do are not
    admitted), so the values set so far change nothing in its result.
    """
    import torch
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.immutable_collections import immutable_list

    graph = graph_module.graph
    graph.eliminate_dead_code()
    graph.lint()
    mode = self.fake_tensor_mode
    if mode is None or not _eligible(self, graph_module, mode):
        return False
    nodes = list(graph.nodes)
    output = nodes[-1]
    outputs = output.args[0] if output.op == "output" and len(output.args) == 1 else None
    if type(outputs) not in (tuple, list, immutable_list) or not all(isinstance(a, torch.fx.Node) for a in outputs):
        return False
    snapshot = state.snapshot
    changed: set = set()
    owner = types.SimpleNamespace(fake_tensor_mode=mode)
    with mode, enable_python_dispatcher():
        for n in nodes:
            if n.op != "call_function":
                continue
            before = snapshot.get(n)
            value = n.meta.get("val")
            if (
                before is not None
                and before[0] is n.args
                and before[1] is n.kwargs
                and before[2] is n.target
                and before[3] is value
                and before[4] is not None
                and retrace.tensor_signature(value) == before[4]
                and not any(a in changed for a in n.all_input_nodes)
            ):
                continue
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            try:
                new = retrace.reuse_or_dispatch(owner, n, n.target, args, kwargs, lambda t, a, k: t(*a, **k))
            except Exception:
                return False  # the stock retrace dispatches it again, and raises as stock raises
            signature = retrace.tensor_signature(new)
            if signature is None:
                return False  # not a value this reproduces: the stock retrace decides
            if before is None or before[4] != signature:
                changed.add(n)
            n.meta["val"] = new
            n.meta["tensor_meta"] = None
    output.meta["val"] = type(outputs)(a.meta["val"] for a in outputs)
    output.meta["tensor_meta"] = type(outputs)(None for _ in outputs)
    position = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if len(n.users) > 1:
            order = sorted(n.users, key=position.__getitem__)
            if list(n.users) != order:
                n.users = dict.fromkeys(order)
    state.snapshot = _snapshot(graph)
    return True


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    base = _module().PropagateViewCopyPermutePass
    site = _loop_site(base.call)
    if site is None:
        return
    _originals["loop_site"] = site
    _originals["call"] = base.call
    _originals["_retrace"] = base._retrace
    base.call = _call
    base._retrace = _retrace


def _undo() -> None:
    if "call" not in _originals:
        return
    base = _module().PropagateViewCopyPermutePass
    base.call = _originals.pop("call")
    base._retrace = _originals.pop("_retrace")
    _originals.pop("loop_site")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


def enabled() -> bool:
    """Whether the patch is installed right now."""
    import sys

    module = sys.modules.get("executorch.backends.transforms.propagate_view_copy_permute_pass")
    return module is not None and module.PropagateViewCopyPermutePass._retrace is _retrace
