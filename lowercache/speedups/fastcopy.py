"""Fast node copy: a node a pass provably hands to the base ``call_operator`` is built with the same torch calls, without the interpretation around them.

Why it is exact, and figures: docs/speedups.md#retrace-and-fastcopy.
"""

from __future__ import annotations

import ast
import copy
import inspect
import operator
import textwrap
import threading
from typing import Any

from .patching import Counters, Patch

_tls = threading.local()
_state: dict[str, Any] = {}
_chains: dict[type, str | None] = {}

_counts = Counters("copied", "copied_attrs", "fallback_pass", "fallback_node", "fallback_nested", "fallback_unaudited")
_count = _counts.count

# sha256 over the sources of the functions listed in _audited_sources (torch 2.13.0, executorch 1.5.1).
_AUDITED_DIGEST = "204133b5cf5ee4317001f4f96542011cefaa3087bf7ceaf128a18eded66b53f0"


def stats() -> dict[str, int]:
    """Counters since the last :func:`reset_stats`.

    ``copied``: nodes built by the fast copy (their fake values are counted by
    ``retrace.stats()`` as reused or redispatched, like any other node), of
    which ``copied_attrs`` had get_attr tensor arguments.
    ``fallback_*``: nodes interpreted the stock way because the pass may
    handle the op (``pass``), the node's arguments or meta are not plain
    (``node``), the node sits in a nested interpretation (``nested``), or the
    installed torch / ExecuTorch sources are not the audited ones
    (``unaudited``).
    """
    return _counts.snapshot()


def reset_stats() -> None:
    _counts.reset()


def _audited_sources() -> list[Any]:
    """The functions whose behaviour a fast copy reproduces."""
    import torch.fx
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir.pass_base import ExportPass, NodeMetadata, ProxyValue, _ExportPassBase
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer
    from torch.fx.proxy import TracerBase

    from . import retrace

    return [
        retrace.original("_fx", _ExportPassBase._fx),
        retrace.original("run_node", _ExportPassBase.ExportInterpreter.run_node),
        _ExportPassBase.call_operator,
        _ExportPassBase.ExportInterpreter.call_function,
        ExportPass.ExportInterpreter.call_function,
        _ExportPassBase.ExportTracer.create_arg,
        ExportPass.ExportTracer.create_arg,
        _ExportPassBase.ExportTracer.set_metadata,
        NodeMetadata.__init__,
        ProxyValue.__init__,
        ArmPass.call_operator,
        torch.fx.Interpreter.run_node,
        torch.fx.Interpreter.fetch_args_kwargs_from_env,
        torch.fx.Interpreter._set_current_node,
        fx_traceback.set_current_meta,
        TracerBase.create_proxy,
        TracerBase.create_arg,
        torch.fx.Tracer.create_arg,
        PythonKeyTracer.create_arg,
        PythonKeyTracer.create_node,
        TracerBase.create_node,
        torch.fx.Graph._target_to_str,
        torch.fx.Graph.create_node,
        torch.fx.Node.stack_trace.fset,
        torch.fx.Node.__setattr__,
        proxy_tensor._should_save_eager_input_vals,
    ]


def sources_digest() -> str | None:
    """Digest of the audited sources as installed (None when one has no source)."""
    from .sourcepin import source_digest

    return source_digest(*_audited_sources())


def _setup() -> dict[str, Any] | None:
    """Types and objects the fast path compares against; None when the sources are not the audited ones."""
    if "ok" in _state:
        return _state if _state["ok"] else None
    import torch
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.dialects.backend._ops import BackendOpOverload
    from executorch.exir.dialects.edge._ops import EdgeOpOverload
    from executorch.exir.pass_base import ExportPass, ProxyValue, _ExportPassBase
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental import proxy_tensor
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    from . import retrace

    try:
        ok = sources_digest() == _AUDITED_DIGEST
    except (OSError, TypeError):
        ok = False
    _state.update(
        ok=ok,
        edge=(EdgeOpOverload, BackendOpOverload),
        overload=torch._ops.OpOverload,
        base=_ExportPassBase,
        arm=ArmPass,
        interpreter=ExportPass.ExportInterpreter,
        tracer=ExportPass.ExportTracer,
        proxy=torch.fx.Proxy,
        proxy_value=ProxyValue,
        fake=FakeTensor,
        node=torch.fx.Node,
        traceback=fx_traceback,
        lists=(list, immutable_list),
        dicts=(dict, immutable_dict),
        tensors=(torch.Tensor, torch.nn.Parameter),
        literals=frozenset(
            {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
        ),
        arm_special=frozenset({exir_ops.edge.aten.bmm.default, exir_ops.edge.aten.leaky_relu.default}),
        graph=torch.fx.Graph,
        names={},
        proxy_module=torch.fx.proxy,
        proxy_tensor=proxy_tensor,
        # copy.copy of these makes a new object and nothing else (the merge then puts the original back)
        plain_copy=frozenset({dict, list, tuple, str, int, float, bool, type(None)} | _plain_objects()),
        copy=copy.copy,
        fake_value=retrace.fake_value,
    )
    return _state if ok else None


def _plain_objects() -> set[type]:
    """``OpOverload`` (``original_aten``) when ``copy.copy`` of it is the default object copy.

    With no copy or pickling hook on the class, ``copy.copy`` makes a bare
    instance with ``object.__new__`` and fills its ``__dict__``: nothing of the class runs.
    """
    import torch

    hooks = ("__copy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__new__")
    klass = torch._ops.OpOverload
    if any(hook in base.__dict__ for base in klass.__mro__[:-1] for hook in hooks):
        return set()
    return {klass}


def _target_guard_params(fn: Any) -> tuple[int, str] | None:
    """Parameter count (5, or 6 with ``updated``) and the attribute named, when ``fn`` starts with
    ``if op not in self.<attribute>[ or ...]: return super().call_operator(...)``.

    The attribute is usually ``target_ops`` (DecomposeDynamicFullPass names
    its own set). The returned call must pass the parameters through
    unchanged; ``updated`` (if present) must default to False or None, which
    is what the interpreter's call leaves it at. A guard that forwards
    ``updated`` returns 6.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    if "super" in getattr(fn, "__globals__", {}):
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef) or func.decorator_list:
        return None
    a = func.args
    names = [p.arg for p in a.args]
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or len(names) not in (5, 6):
        return None
    if names[1:5] != ["op", "args", "kwargs", "meta"]:
        return None
    if len(names) == 6:
        if names[5] != "updated" or len(a.defaults) != 1:
            return None
        default = a.defaults[0]
        if not (isinstance(default, ast.Constant) and (default.value is False or default.value is None)):
            return None
    elif a.defaults:
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    if not body or not isinstance(body[0], ast.If) or body[0].orelse:
        return None
    guard = body[0]
    test = guard.test
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        test = test.values[0]  # `A or B`: when A holds, B is never evaluated
    self_name = names[0]
    if not (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "op"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.NotIn)
        and isinstance(test.comparators[0], ast.Attribute)
        and isinstance(test.comparators[0].value, ast.Name)
        and test.comparators[0].value.id == self_name
    ):
        return None
    if len(guard.body) != 1 or not isinstance(guard.body[0], ast.Return):
        return None
    call = guard.body[0].value
    if not (
        isinstance(call, ast.Call)
        and not call.keywords
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "call_operator"
        and isinstance(call.func.value, ast.Call)
        and isinstance(call.func.value.func, ast.Name)
        and call.func.value.func.id == "super"
        and not call.func.value.args
        and not call.func.value.keywords
    ):
        return None
    passed = [x.id if isinstance(x, ast.Name) else None for x in call.args]
    attribute = test.comparators[0].attr
    if passed == names[1:5]:
        return 5, attribute
    return (6, attribute) if len(names) == 6 and passed == names[1:] else None


def _defined_in(fn: Any, klass: type) -> bool:
    """Whether ``fn``'s zero-argument ``super()`` starts after ``klass`` (its ``__class__`` cell is ``klass``)."""
    code = getattr(fn, "__code__", None)
    if code is None or "__class__" not in code.co_freevars or not fn.__closure__:
        return False
    return fn.__closure__[code.co_freevars.index("__class__")].cell_contents is klass


def _chain(cls: type, st: dict[str, Any]) -> tuple[Any, ...] | None:
    """The gates between ``cls`` and the base ``call_operator`` (cached per class).

    A gate is ``gate(pass, node, op, env)``: the op that override hands to the
    next ``call_operator`` with the arguments unchanged, or None. An override is gated
    by its ``target_ops`` guard (read from the syntax tree) or by a condition
    declared in ``passregistry``; () means no override before ``ArmPass`` /
    the ExportPass base (and none after ArmPass that no gate covers); None
    means some override is neither (never trusted).
    A guard that passes ``updated`` on must reach a ``call_operator`` that takes it.
    """
    try:
        return _chains[cls]
    except KeyError:
        pass
    from . import passregistry

    gates: list[Any] = []
    covered: set[tuple[str, str]] = set()
    result: tuple[Any, ...] | None = None
    passes_updated = False
    base, arm = st["base"], st["arm"]
    for klass in cls.__mro__:
        if "_fx" in klass.__dict__ and klass is not base:
            break
        if klass is arm or klass is base:
            if not (klass is base and passes_updated) and (klass is base or _plain_after_arm(cls, st, covered)):
                result = tuple(gates)
            break
        fn = klass.__dict__.get("call_operator")
        if fn is None:
            continue
        # A declared condition, where there is one, reads further than the guard that begins the override.
        declared = passregistry.gate_for(klass) if _defined_in(fn, klass) else None
        guard = _target_guard_params(fn) if declared is None and _defined_in(fn, klass) else None
        if declared is not None and not passes_updated:
            gates.append(declared)
            covered |= passregistry.covered_by(klass)
            continue
        if guard is None or (passes_updated and guard[0] < 6):
            break
        passes_updated = guard[0] == 6
        gates.append(_not_in(guard[1]))
    _chains[cls] = result
    return result


def _plain_after_arm(cls: type, st: dict[str, Any], covered: set[tuple[str, str]]) -> bool:
    """Whether ``ArmPass.call_operator``'s ``super()`` reaches the base with no override on the way.

    In a diamond hierarchy a class can sit between ArmPass and the base in
    the MRO; its ``call_operator`` runs for every node. Only one a declared
    gate of an earlier class pins (``passregistry.covered_by``) is allowed.
    """
    mro = cls.__mro__
    after = mro[mro.index(st["arm"]) + 1 :]
    for klass in after:
        if klass is st["base"]:
            return True
        if "_fx" in klass.__dict__:
            return False
        if "call_operator" in klass.__dict__ and (klass.__module__, klass.__qualname__) not in covered:
            return False
    return True


def _not_in(attribute: str) -> Any:
    """The gate of a guard ``if op not in self.<attribute>``: evaluated as the guard is, once per node."""

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        return None if op in getattr(p, attribute) else op

    return gate


def _handed_on(p: Any, n: Any, target: Any, chain: tuple, env: dict, st: dict[str, Any]) -> Any:
    """The op ``p``'s ``call_operator`` hands ``n`` on to ExportPass's with, through ``chain``'s gates, or None when
    some override may do anything else (or ``ArmPass.call_operator`` builds the node itself: bmm and leaky_relu with
    input qparams)."""
    for gate in chain:
        target = gate(p, n, target, env)
        if target is None:
            return None
    tt = type(target)
    if tt not in st["edge"] and tt is not st["overload"]:
        return None
    if target in st["arm_special"]:
        qparams = n.meta.get("input_qparams", {})
        if type(qparams) is not dict or qparams:
            return None
    return target


def hands_every_node_on(pass_: Any, graph_module: Any) -> bool:
    """Whether ``pass_``'s ``call_operator`` hands every operator node of ``graph_module`` on to ExportPass's own as
    it is, by the gates the fast copy reads (:func:`_handed_on`): ``retraceskip`` asks it of a graph a retrace made,
    whose values and metadata are those the retrace would give each node's copy, so a gate reads here what it reads
    in the retrace (an argument's value and node metadata through the environment's ProxyValues)."""
    st = _setup()
    if st is None or "call_operator" in vars(pass_) or "_fx" in vars(pass_):
        return False
    chain = _chain(type(pass_), st)
    if chain is None:
        return False
    edge, overload, getitem, value = st["edge"], st["overload"], operator.getitem, st["proxy_value"]
    nodes = graph_module.graph.nodes
    env = {m: value(m.meta.get("val"), m) for m in nodes} if chain else {}
    for n in nodes:
        if n.op != "call_function" or n.target is getitem:
            continue
        target = n.target
        if type(target) not in edge and type(target) is not overload:
            return False
        if _handed_on(pass_, n, target, chain, env, st) is not target:
            return False
    return True


class _Fallback(Exception):
    pass


class _Attr:
    """A get_attr tensor argument, whose node the tracer's ``create_arg`` makes."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def _map_args(a: Any, env: dict, st: dict[str, Any], attrs: list) -> tuple[Any, Any]:
    """(argument for ``create_node``, argument for the fake call) of one old argument.

    A get_attr tensor becomes an :class:`_Attr` (also appended to ``attrs``)
    for :func:`_create_attrs` to replace once the value is computed, as stock
    dispatches before it traces.
    """
    t = type(a)
    if t is st["node"]:
        v = env.get(a)
        tv = type(v)
        if tv is st["proxy_value"] and type(v.proxy_or_node) is st["proxy"]:
            return v.proxy_or_node.node, v.data
        if tv in st["tensors"] and a.op == "get_attr":
            attr = _Attr(v)
            attrs.append(attr)
            return attr, v
        raise _Fallback
    if t in st["literals"]:
        return a, a
    if t is tuple or t in st["lists"]:
        new, data = [], []
        node_type, proxy_value, proxy, literals = st["node"], st["proxy_value"], st["proxy"], st["literals"]
        for x in a:
            tx = type(x)
            if tx is node_type:  # the common case, inline: a Proxy's node and its value
                v = env.get(x)
                if type(v) is proxy_value and type(v.proxy_or_node) is proxy:
                    new.append(v.proxy_or_node.node)
                    data.append(v.data)
                    continue
            elif tx in literals:
                new.append(x)
                data.append(x)
                continue
            x_new, x_data = _map_args(x, env, st, attrs)
            new.append(x_new)
            data.append(x_data)
        if t is tuple:
            return tuple(new), tuple(data)
        return new, st["lists"][1](data)
    raise _Fallback


def _create_attrs(a: Any, tracer: Any) -> Any:
    """``a`` with each :class:`_Attr` replaced by the node ``tracer.create_arg`` makes, in ``create_arg``'s order."""
    t = type(a)
    if t is _Attr:
        return tracer.create_arg(a.tensor)
    if t is tuple:
        return tuple(_create_attrs(x, tracer) for x in a)
    if t is list:
        return [_create_attrs(x, tracer) for x in a]
    if t is dict:
        return {k: _create_attrs(v, tracer) for k, v in a.items()}
    return a


def _copy(interp: Any, n: Any, st: dict[str, Any]) -> Any:
    """The ProxyValue the stock ``run_node`` would return for ``n``, or None to fall back."""
    target = n.target
    tt = type(target)
    if tt not in st["edge"] and tt is not st["overload"]:
        _count("fallback_node")
        return None
    p = interp.callback
    chain = _chain(type(p), st)
    if chain is None or "call_operator" in p.__dict__ or "_fx" in p.__dict__:
        _count("fallback_pass")
        return None
    env = interp.env
    target = _handed_on(p, n, target, chain, env, st)
    if target is None:
        _count("fallback_pass")
        return None
    tt = type(target)
    tracer = p.tracer
    fx_traceback = st["traceback"]
    meta = n.meta
    if (
        type(tracer) is not st["tracer"]
        or tracer.check_mutable_operations
        or tracer.record_stack_traces
        or not meta
        or "from_node" not in meta
        or not fx_traceback.has_preserved_node_meta()
        or fx_traceback.get_current_replay_node() is not None
        or type(n.kwargs) not in st["dicts"]
    ):
        _count("fallback_node")
        return None
    attrs: list[_Attr] = []
    try:
        new_args, data_args = _map_args(n.args, env, st, attrs)
        new_kwargs, data_kwargs = {}, {}
        for key, value in n.kwargs.items():
            if type(key) is not str:
                raise _Fallback
            new_kwargs[key], data_kwargs[key] = _map_args(value, env, st, attrs)
    except _Fallback:
        _count("fallback_node")
        return None

    interp.node = n
    res_data = st["fake_value"](interp, n, target, data_args, data_kwargs)
    name = _op_name(tracer.graph, target, st) if tt is st["overload"] else None
    if attrs:
        # The get_attr nodes keep the meta stock gives them, ``from_node`` included.
        with fx_traceback.set_current_meta(n, f"Interpreter_{type(interp).__name__}"):
            new_args = _create_attrs(new_args, tracer)
            new_kwargs = _create_attrs(new_kwargs, tracer)
            node = tracer.create_node("call_function", target, new_args, new_kwargs, name, None)
    else:
        saved = fx_traceback.current_meta
        fx_traceback.current_meta = current = dict(meta)
        try:
            node = _create_node(tracer, target, new_args, new_kwargs, name, current, st)
        finally:
            fx_traceback.current_meta = saved
    proxy = tracer.proxy(node)
    node.meta.update(meta)
    if type(res_data) is st["fake"]:
        # What ``set_metadata``'s two ``tree_map`` calls give for one FakeTensor (a
        # pytree leaf): the value itself, and no separate tensor metadata.
        node.meta["val"] = res_data
        node.meta["tensor_meta"] = None
    else:
        tracer.set_metadata(node, res_data)
    _count("copied")
    if attrs:
        _count("copied_attrs")
    return st["proxy_value"](res_data, proxy)


def _op_name(graph: Any, target: Any, st: dict[str, Any]) -> str:
    """``graph._target_to_str(target.overloadpacket.__name__)``, the name ``_fx`` passes, once per op.

    For a plain ``torch.fx.Graph`` it is a function of the string alone (snake case).
    """
    if type(graph) is not st["graph"]:
        return graph._target_to_str(target.overloadpacket.__name__)
    names = st["names"]
    name = names.get(target)
    if name is None:
        name = names[target] = graph._target_to_str(target.overloadpacket.__name__)
    return name


def _create_node(tracer: Any, target: Any, args: Any, kwargs: Any, name: Any, current: dict, st: dict) -> Any:
    """What ``tracer.create_node("call_function", ...)`` does under the conditions ``_copy`` checked.

    ``PythonKeyTracer.create_node`` and ``TracerBase.create_node`` in order,
    minus the branches those conditions rule out (mutable-operation checks,
    recorded stack traces, replay nodes, placeholder / output / get_attr
    kinds). ``current`` is the current meta, a copy of the old node's meta
    that the caller merges into the node right after, so a field whose
    ``copy.copy`` runs no code of its own (builtin containers and scalars,
    ``OpOverload`` per :func:`_plain_objects`) is set to the value the merge
    leaves there instead of copied: same keys, same order.
    A target whose input values ``PythonKeyTracer`` would save takes the full call.
    """
    # An edge op is neither a higher-order operator nor an OpOverload: never saved.
    if type(target) not in st["edge"] and st["proxy_tensor"]._should_save_eager_input_vals(target, (args, kwargs)):
        return tracer.create_node("call_function", target, args, kwargs, name, None)
    proxy = st["proxy_module"]
    graph = tracer.graph
    if type(graph) is st["graph"] and type(args) is tuple and type(kwargs) is dict:
        node = _graph_create_node(graph, target, args, kwargs, name, st)
    else:
        node = graph.create_node("call_function", target, args, kwargs, name, None)
    tracer.node_name_to_scope[node.name] = (tracer.scope.module_path, tracer.scope.module_type)
    meta = node.meta
    stack_trace = current.get("stack_trace")
    if stack_trace:
        # ``node.stack_trace = ...``: the setter stores it in meta; Node.__setattr__ would
        # move the node to the end of its lookup bucket, where it already is
        meta["stack_trace"] = stack_trace
        if st["traceback"].GRADIENT_ACC_SPECIAL_STACK in stack_trace:
            meta["is_gradient_acc"] = True
            meta["autograd_backward"] = True
    plain = st["plain_copy"]
    for field in proxy._COPY_META_FIELDS:
        if field in current:
            value = current[field]
            meta[field] = value if type(value) in plain else st["copy"](value)
    seq_nr = proxy._get_seq_nr(node.name)
    if seq_nr is not None:
        meta["seq_nr"] = seq_nr
    if current.get("autograd_backward", False):
        meta["autograd_backward"] = True
    return node


def _graph_create_node(graph: Any, target: Any, args: tuple, kwargs: dict, name: Any, st: dict) -> Any:
    """``torch.fx.Graph.create_node("call_function", ...)`` without its walk for raw symbolic values.

    The walk only warns, and cannot find one here: :func:`_map_args` admits
    nodes, the plain literals (no ``SymInt``/``SymFloat``/``SymBool``) and
    tuples and lists of them. Every other step is torch's, in its order.
    """
    if not args:
        args = ()
    if not kwargs:
        kwargs = st["dicts"][1]()  # immutable_dict, as torch's create_node makes
    candidate = name if name is not None else graph._target_to_str(target)
    name = graph._graph_namespace.create_name(candidate, None)
    n = st["node"](graph, name, "call_function", target, args, kwargs, None)
    owner = graph.owning_module
    if owner is not None and getattr(owner, "_create_node_hooks", None) is not None:
        for f in owner._create_node_hooks:
            f(n)
    graph._graph_namespace.associate_name_with_obj(name, n)
    graph._insert(n)
    graph._find_nodes_lookup_table.insert(n)
    graph._len += 1
    return n


def _run_node(self: Any, n: Any) -> Any:
    depth = getattr(_tls, "depth", 0)
    if n.op == "call_function":
        st = _setup()
        if st is None:
            _count("fallback_unaudited")
        elif depth:
            _count("fallback_nested")
        elif type(self) is st["interpreter"]:
            res = _copy(self, n, st)
            if res is not None:
                return res
        else:
            _count("fallback_node")
    _tls.depth = depth + 1
    try:
        return _state["base"].ExportInterpreter.run_node(self, n)
    finally:
        _tls.depth = depth


def _apply() -> None:
    from executorch.exir.pass_base import ExportPass, _ExportPassBase

    _state.setdefault("base", _ExportPassBase)
    if "run_node" in ExportPass.ExportInterpreter.__dict__:
        raise RuntimeError("ExportPass.ExportInterpreter.run_node is already patched")
    ExportPass.ExportInterpreter.run_node = _run_node


def _undo() -> None:
    from executorch.exir.pass_base import ExportPass

    del ExportPass.ExportInterpreter.run_node


_patch = Patch(_apply, _undo)
enable = _patch.enable
"""Fast-copy unchanged nodes in every ExportPass retrace (reference counted, thread-safe)."""
disable = _patch.disable
fast_copy = _patch.active
"""Context manager form of :func:`enable` / :func:`disable`."""


def enabled() -> bool:
    """Whether the hook is installed right now."""
    import sys

    pass_base = sys.modules.get("executorch.exir.pass_base")
    return pass_base is not None and pass_base.ExportPass.ExportInterpreter.__dict__.get("run_node") is _run_node
