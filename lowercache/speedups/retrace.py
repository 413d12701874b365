"""Dirty-region retracing: an unchanged node reuses its recorded fake value, since a functional op on equal fake inputs gives equal fake outputs.

Why it is exact, and figures: docs/speedups.md#retrace-and-fastcopy.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable

from . import delegatecall, oppolicy
from .patching import Counters, Patch

_originals: dict[str, Any] = {}
# (input-graph node being interpreted, the pass interpreting it, candidates reused in this retrace)
_tls = threading.local()

_MISS = object()

# id(first output leaf) -> (weakref to it, record); entries die with the tensor.
_records: dict[int, tuple[Any, tuple]] = {}

_counts = Counters("reused", "redispatched", "redispatched_ineligible", "redispatched_no_record", "redispatched_changed",
                   "not_applicable")
_count = _counts.count


def stats() -> dict[str, int]:
    """Counters since the last :func:`reset_stats`.

    ``reused``: op dispatches served from the input node's ``val`` (nodes
    copied). ``redispatched``: op dispatches that ran through FakeTensor
    (nodes re-traced), split into ``redispatched_ineligible`` (op or arguments
    excluded), ``redispatched_no_record`` (no proof for the candidate, e.g.
    first retrace) and ``redispatched_changed`` (the call differs from the
    recorded one: the dirty region). ``not_applicable``: other ``_fx``
    calls (getitem, sym ops, delegates, higher-order ops).
    """
    return _counts.snapshot()


def reset_stats() -> None:
    _counts.reset()


def _is_op(target: Any) -> bool:
    import torch
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    return isinstance(target, (EdgeOpOverload, torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _context(mode: Any, tosa: bool) -> tuple | None:
    """Global state a fake kernel may read, or None when reuse is off the table.

    Objects are compared by identity: their ids are in the key, and the
    objects themselves ride along in the last slot (kept alive by the record,
    so an id cannot be recycled while a record mentions it; not compared).
    """
    import torch

    if mode is None:
        return None
    if torch._C._len_torch_dispatch_stack() != 1 or torch._C._get_dispatch_stack_at(0) is not mode:
        return None  # another mode (e.g. an outer tracer) would observe the dispatch
    if torch._C._len_torch_function_stack() != 0:
        return None
    ctx = (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher),
        # excluded autograd (a delegate's fake run excludes it) changes outputs' requires_grad
        torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU),
    )
    if tosa:
        # TOSA dialect fake kernels read the active TosaSpecification (and
        # ShapeEnv) from context variables: the very same objects are required.
        spec_module = sys.modules.get("executorch.backends.arm.tosa.specification")
        if spec_module is None:
            return None
        lowering = spec_module.TosaLoweringContext
        spec, env = lowering.tosa_spec_var.get(None), lowering.shape_env_var.get(None)
        return ctx + (id(spec), id(env)), (spec, env)
    return ctx, ()


_types: dict[str, Any] = {}


def _load_types() -> dict[str, Any]:
    if not _types:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, fake_tensor_tls
        from torch.fx.immutable_collections import immutable_dict, immutable_list

        _types["fake"] = FakeTensor
        _types["strided"] = torch.strided
        _types["size"] = torch.Size
        # After the C++ argument parser (every admitted target is an OpOverload),
        # an immutable_list is indistinguishable from a list.
        _types["lists"] = (list, immutable_list)
        _types["literals"] = frozenset(
            {int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size}
        )
        _types["dicts"] = (dict, immutable_dict)
        _types["real"] = (torch.Tensor, torch.nn.Parameter)
        _types["tls"] = fake_tensor_tls
    return _types


def _tensor_sig(x: Any, mode: Any) -> tuple | None:
    """Everything a fake kernel can see of a FakeTensor, or None when it is not static and plain."""
    if x.fake_mode is not mode or x.constant is not None or x.layout is not _types["strided"]:
        return None
    shape = tuple(x.shape)
    stride = x.stride()
    offset = x.storage_offset()
    if type(offset) is not int:
        return None
    for d in shape:
        if type(d) is not int:
            return None
    for d in stride:
        if type(d) is not int:
            return None
    return (x.dtype, x.device, shape, stride, offset, x.requires_grad, x.is_conj(), x.is_neg(), x._is_view())


def tensor_signature(x: Any) -> tuple | None:
    """What a fake kernel can see of ``x``: :func:`_tensor_sig` in its own fake mode; None unless a plain static FakeTensor."""
    types = _load_types()
    if type(x) is not types["fake"]:
        return None
    return _tensor_sig(x, x.fake_mode)


def _walk(x: Any, mode: Any, sig: list, tensors: list, types: dict) -> bool:
    tx = type(x)
    if tx is types["fake"]:
        tsig = _tensor_sig(x, mode)
        if tsig is None:
            return False
        sig.append(tsig)
        tensors.append(x)
        return True
    if tx is float:
        sig.append((float, x.hex()))  # exact: 0.0 and -0.0 stay apart
        return True
    if tx is tuple or tx in types["lists"]:
        sig.append(("(" if tx is tuple else "[", len(x)))
        for item in x:
            if not _walk(item, mode, sig, tensors, types):
                return False
        return True
    if tx in types["literals"]:
        if tx is types["size"]:
            for d in x:
                if type(d) is not int:
                    return False
        sig.append((tx, x))
        return True
    if tx in types["real"]:
        fake = _converted(x, mode)
        tsig = _tensor_sig(fake, mode) if fake is not None else None
        if tsig is None:
            return False
        sig.append(("real", tx, tsig))
        tensors.append(fake)
        return True
    return False  # SymInts, modules, arbitrary objects


def _converted(x: Any, mode: Any) -> Any:
    """The fake ``mode`` turns the real tensor ``x`` into when dispatching, if it already holds one."""
    if mode is None or not mode.allow_non_fake_inputs or _types["tls"].allow_non_fake_inputs_override is not None:
        return None
    return mode.fake_tensor_converter._get_memo(x)


def _signature(args: tuple, kwargs: dict, mode: Any) -> tuple[tuple, list] | None:
    """Signature of a dispatch's arguments and its tensor inputs; None when not reusable.

    The signature holds the argument structure (tuple vs list, lengths,
    keyword names) and one entry per leaf: exact type and value for literals,
    the full fake-tensor metadata for FakeTensors and, for a real tensor,
    of the fake the mode already holds for it (none held: ineligible).
    Anything else (SymInts, modules, other objects) makes the call ineligible.
    """
    types = _load_types()
    if type(args) is not tuple or not isinstance(kwargs, types["dicts"]):
        return None
    sig: list = []
    tensors: list = []
    for a in args:
        if not _walk(a, mode, sig, tensors, types):
            return None
    # keyword arguments are passed by name: order and container type do not reach the op
    names = tuple(sorted(kwargs)) if kwargs else ()
    sig.append(("kw", len(args), names))
    for name in names:
        if not _walk(kwargs[name], mode, sig, tensors, types):
            return None
    return tuple(sig), tensors


def _flatten_output(res: Any, mode: Any) -> tuple[list, Any, tuple] | None:
    """Leaves, structure and leaf signatures of a dispatch result; None unless all static FakeTensors."""
    fake_type = _load_types()["fake"]
    if type(res) is fake_type:
        leaves, spec = [res], None
    else:
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten(res)
        if not leaves:
            return None
    sigs = []
    for x in leaves:
        tsig = _tensor_sig(x, mode) if type(x) is fake_type else None
        if tsig is None:
            return None
        sigs.append(tsig)
    return leaves, spec, tuple(sigs)


def _forget(key: int, ref: Any) -> None:
    entry = _records.get(key)
    if entry is not None and entry[0] is ref:
        del _records[key]


def _record(kernel: Any, sig: tuple, tensors: list, ctx: tuple, keep: tuple, res: Any, mode: Any) -> None:
    out = _flatten_output(res, mode)
    if out is None:
        return
    leaves, out_spec, out_sigs = out
    in_ids = {id(x) for x in tensors}
    if any(id(x) in in_ids for x in leaves):
        return  # the op returned one of its inputs: leave such calls to the dispatcher
    first = leaves[0]
    key = id(first)
    ref = weakref.ref(first, lambda r, key=key: _forget(key, r))
    record = (
        kernel,
        sig,
        ctx,
        tuple(weakref.ref(x) for x in tensors),
        out_spec,
        tuple(weakref.ref(x) for x in leaves),
        out_sigs,
        keep,
        # a result that is a view although the schema does not say so (a
        # custom fake kernel returning ``x.view(...)``) is treated as aliasing
        any(out_sig[8] for out_sig in out_sigs),
    )
    _records[key] = (ref, record)


class _Shim:
    """Stands in for ``pass.interpreter`` during one ``_fx`` call."""

    __slots__ = ("_inner", "_pass")

    def __init__(self, inner: Any, pass_: Any):
        self._inner = inner
        self._pass = pass_

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        inner = self._inner
        rule = oppolicy.policy(target)
        if rule is None:
            if target is not None and target is delegatecall.operator_if_loaded():
                return self._call_delegate(target, args, kwargs)
            _count(*(("redispatched", "redispatched_ineligible") if _is_op(target) else ("not_applicable",)))
            return inner.call_function(target, args, kwargs)
        aliases, tosa, kernel = rule
        mode = getattr(self._pass, "fake_tensor_mode", None)
        context = _context(mode, tosa)
        found = _signature(args, kwargs, mode) if context is not None else None
        if found is None:
            _count("redispatched", "redispatched_ineligible")
            return inner.call_function(target, args, kwargs)
        sig, tensors = found
        ctx, keep = context
        return self._reuse_or_call(target, args, kwargs, kernel, sig, tensors, ctx, keep, aliases, mode)

    def _call_delegate(self, target: Any, args: Any, kwargs: Any) -> Any:
        """A delegate call: reusable like an op, with its program's description in the signature."""
        mode = getattr(self._pass, "fake_tensor_mode", None)
        program = delegatecall.signature(args[0]) if type(args) is tuple and args and not kwargs else None
        context = _context(mode, program[1]) if program is not None else None
        found = _signature(args[1:], kwargs, mode) if context is not None else None
        if found is None:
            _count("redispatched", "redispatched_ineligible")
            return self._inner.call_function(target, args, kwargs)
        sig = (("delegate", id(args[0]), program[0]),) + found[0]
        ctx, keep = context
        return self._reuse_or_call(target, args, kwargs, target, sig, found[1], ctx, keep + (args[0],), False, mode)

    def _reuse_or_call(
        self, target: Any, args: Any, kwargs: Any, kernel: Any, sig: tuple, tensors: list, ctx: tuple, keep: tuple, aliases: bool, mode: Any
    ) -> Any:
        """The node's recorded value when the proof holds, else the real call, recorded."""
        res = self._reuse(kernel, sig, tensors, ctx, aliases, mode)
        if res is not _MISS:
            return res
        res = self._inner.call_function(target, args, kwargs)
        _record(kernel, sig, tensors, ctx, keep, res, mode)
        return res

    def _reuse(self, kernel: Any, sig: tuple, tensors: list, ctx: tuple, aliases: bool, mode: Any) -> Any:
        frame = getattr(_tls, "frame", None)
        if frame is None or frame[1] is not self._pass:
            _count("redispatched", "redispatched_no_record")
            return _MISS
        node, _, used = frame
        candidate = node.meta.get("val") if node.op == "call_function" else None
        out = _flatten_output(candidate, mode) if candidate is not None else None
        entry = _records.get(id(out[0][0])) if out is not None else None
        if entry is None or entry[0]() is not out[0][0]:
            _count("redispatched", "redispatched_no_record")
            return _MISS
        leaves, out_spec, out_sigs = out
        r_target, r_sig, r_ctx, r_inputs, r_out_spec, r_out, r_out_sigs, _, r_view = entry[1]
        if (
            r_target is not kernel
            or r_ctx != ctx
            or r_sig != sig
            or r_out_spec != out_spec
            or len(r_out) != len(leaves)
            or any(ref() is not x for ref, x in zip(r_out, leaves))
            # the objects must not have been mutated in place since the dispatch
            or r_out_sigs != out_sigs
            # an aliasing result must share storage with the very same inputs
            or ((aliases or r_view) and any(ref() is not x for ref, x in zip(r_inputs, tensors)))
        ):
            _count("redispatched", "redispatched_changed")
            return _MISS
        key = id(leaves[0])
        if key in used:
            _count("redispatched", "redispatched_changed")
            return _MISS
        used.add(key)
        _count("reused")
        if out_spec is None:
            return leaves[0]
        from torch.utils import _pytree as pytree

        return pytree.tree_unflatten(list(leaves), out_spec)


def _shimmed(original: Any, self: Any, kind: str, target: Any, args: Any, kwargs: Any, meta: Any) -> Any:
    if kind != "call_function":
        return original(self, kind, target, args, kwargs, meta)
    inner = self.interpreter
    self.interpreter = _Shim(inner, self)
    try:
        return original(self, kind, target, args, kwargs, meta)
    finally:
        self.interpreter = inner


def _fx(self: Any, kind: str, target: Any, args: Any, kwargs: Any, meta: Any) -> Any:
    return _shimmed(_originals["_fx"], self, kind, target, args, kwargs, meta)


def _torch_fx(self: Any, kind: str, target: Any, args: Any, kwargs: Any, meta: Any) -> Any:
    return _shimmed(_originals["torch_fx"], self, kind, target, args, kwargs, meta)


def _frame(interpreter: Any, n: Any) -> tuple:
    used = interpreter.__dict__.get("_lowercache_retrace_used")
    if used is None:
        used = interpreter._lowercache_retrace_used = set()  # per interpreter, i.e. per (sub)graph retrace
    return (n, interpreter.callback, used)


def _framed(original: Any, self: Any, n: Any) -> Any:
    previous = getattr(_tls, "frame", None)
    _tls.frame = _frame(self, n)
    try:
        return original(self, n)
    finally:
        _tls.frame = previous


def _run_node(self: Any, n: Any) -> Any:
    return _framed(_originals["run_node"], self, n)


def _torch_run_node(self: Any, n: Any) -> Any:
    return _framed(_originals["torch_run_node"], self, n)


def fake_value(interpreter: Any, n: Any, target: Any, args: tuple, kwargs: dict) -> Any:
    """The value ``_fx`` computes when ``interpreter`` retraces ``n`` (``args_data`` given).

    For callers that build the new node themselves (``fastcopy``): the very
    call ``_fx`` makes, through the reuse shim while enabled (same checks,
    records and counters), else straight to the pass's interpreter.
    """
    pass_ = interpreter.callback
    if not enabled():
        return pass_.interpreter.call_function(target, args, kwargs)
    previous = getattr(_tls, "frame", None)
    _tls.frame = _frame(interpreter, n)
    try:
        return _Shim(pass_.interpreter, pass_).call_function(target, args, kwargs)
    finally:
        _tls.frame = previous


def reuse_or_dispatch(owner: Any, node: Any, target: Any, args: tuple, kwargs: dict, dispatch: Callable[..., Any]) -> Any:
    """What ``dispatch(target, args, kwargs)`` computes for ``node``, for interpreters that are not retraces.

    The edge dtype check (``dtypecheck``) runs every op of a graph on fake
    tensors under ``owner.fake_tensor_mode``; ``owner`` is that interpreter
    (one run of one graph). ``node``'s own value is returned when the proof
    above holds for this call, else the dispatch runs (and is recorded).
    """
    if not enabled():
        return dispatch(target, args, kwargs)
    previous = getattr(_tls, "frame", None)
    used = owner.__dict__.setdefault("_lowercache_retrace_used", set())
    _tls.frame = (node, owner, used)
    try:
        return _Shim(_Dispatch(dispatch), owner).call_function(target, args, kwargs)
    finally:
        _tls.frame = previous


class _Dispatch:
    """The real dispatch behind a :class:`_Shim` outside retraces."""

    __slots__ = ("call_function",)

    def __init__(self, dispatch: Callable[..., Any]):
        self.call_function = dispatch


def _bases() -> list[tuple[Any, str, Any, str, Any]]:
    """Each ExportPass base: ``(class, _fx key, _fx wrapper, run_node key, run_node wrapper)``.

    torch's own deprecated base (``torch._export.pass_base``, under
    ``ReplaceViewOpsWithViewCopyOpsPass`` in ``to_edge``) has the same ``_fx``
    and interpreter structure as ExecuTorch's.
    """
    from executorch.exir.pass_base import _ExportPassBase
    from torch._export.pass_base import _ExportPassBaseDeprecatedDoNotUse

    return [
        (_ExportPassBase, "_fx", _fx, "run_node", _run_node),
        (_ExportPassBaseDeprecatedDoNotUse, "torch_fx", _torch_fx, "torch_run_node", _torch_run_node),
    ]


def _apply() -> None:
    for base, fx_key, fx, run_key, run_node in _bases():
        _originals.setdefault(fx_key, base._fx)
        _originals.setdefault(run_key, base.ExportInterpreter.run_node)
        base._fx = fx
        base.ExportInterpreter.run_node = run_node


def _undo() -> None:
    # The originals stay in ``_originals``: a retrace still running in another
    # thread keeps calling through them.
    for base, fx_key, _, run_key, _ in _bases():
        base._fx = _originals[fx_key]
        base.ExportInterpreter.run_node = _originals[run_key]


_patch = Patch(_apply, _undo)
enable = _patch.enable
"""Reuse fake propagation for unchanged nodes in every ExportPass (reference counted, thread-safe)."""
disable = _patch.disable
reuse_fake_propagation = _patch.active
"""Context manager form of :func:`enable` / :func:`disable`."""


def original(name: str, default: Any) -> Any:
    """The stock function the shim replaced under ``name`` (``_fx``, ``run_node``), or ``default`` before any patch."""
    return _originals.get(name, default)


def enabled() -> bool:
    """Whether the hooks are installed right now."""
    pass_base = sys.modules.get("executorch.exir.pass_base")
    return pass_base is not None and pass_base._ExportPassBase._fx is _fx
