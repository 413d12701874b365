"""Content hashing: turn tensors, graphs and programs into stable digests.

Every cache key is built from digests made here. A digest must change whenever
something that can change an output byte changes, and must not change for
anything else (object ids, Python hash seeds, provenance, stack traces). The
canonical form is plain JSON built from a whitelist of types; anything else
raises :class:`Unhashable`, so a step that cannot be keyed safely runs
uncached instead of risking a wrong hit.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
from typing import Any, Iterable, Mapping

import torch
import xxhash

from .digests import canonical_json, digest, digest_json

# Node metadata that never reaches an output byte (see the anatomy notes).
# Everything else in ``node.meta`` is part of the key.
IGNORED_META = frozenset(
    {
        "stack_trace",
        "from_node",
        "seq_nr",
        "torch_fn",
        "nn_module_stack",
        "source_fn_stack",
        "original_aten",
        "fwd_nn_module_stack",
        "fwd_source_fn_stack",
        "autograd_backward_hook",
        "partitioner_tag",
    }
)


class Unhashable(TypeError):
    """A value has no canonical form; the step that needs it runs uncached."""


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a dense tensor, independent of its strides."""
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    t = t.contiguous().cpu()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as stored beside tensor bytes (``float32``), resolved back by :func:`tensor_from_bytes`."""
    return str(dtype).removeprefix("torch.")


def tensor_from_bytes(data: bytes, dtype: str, shape: Iterable[int]) -> torch.Tensor:
    """The inverse of :func:`tensor_bytes`: a new contiguous tensor owning a copy of ``data``.

    The dtype is looked up by name among torch's dtypes, nothing else:
    stored bytes never choose what gets constructed.
    """
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    flat = torch.frombuffer(bytearray(data), dtype=resolved) if data else torch.empty(0, dtype=resolved)
    return flat.reshape(list(shape))


def tensor_digest(t: torch.Tensor) -> str:
    """Digest of a real tensor's dtype, shape and contents."""
    h = xxhash.xxh3_128()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.is_quantized:
        h.update(canonical_json(_qparams_of(t)).encode())
    h.update(tensor_bytes(t))
    return h.hexdigest()


def _qparams_of(t: torch.Tensor) -> list:
    if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return ["per_tensor", float(t.q_scale()), int(t.q_zero_point())]
    return [
        "per_channel",
        tensor_digest(t.q_per_channel_scales()),
        tensor_digest(t.q_per_channel_zero_points()),
        int(t.q_per_channel_axis()),
    ]


def inputs_digest(inputs: Iterable[Any]) -> str:
    """Digest of a sequence of input tuples (tensors and Python literals)."""
    return digest_json([canon(x, real_tensors=True) for x in inputs])


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _tensor_meta(t: torch.Tensor) -> list:
    """Shape, dtype, stride and device of a tensor; symbolic sizes as strings."""
    return [
        "tensor",
        str(t.dtype),
        [str(s) for s in t.shape],
        [str(s) for s in t.stride()],
        str(t.device.type),
        bool(t.requires_grad),
    ]


def canon(value: Any, *, real_tensors: bool = False, _depth: int = 0) -> Any:
    """Canonical JSON-able form of a graph argument or metadata value.

    Real tensors are represented by their contents' digest when
    ``real_tensors`` is true, else by their metadata only (as for fake
    tensors in ``node.meta['val']``). Raises :class:`Unhashable` for values of
    unknown type.
    """
    if _depth > 50:
        raise Unhashable("value nested too deeply to hash")
    rec = functools.partial(canon, real_tensors=real_tensors, _depth=_depth + 1)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else ["bigint", str(value)]
    if isinstance(value, float):
        return ["float", repr(value)] if not math.isfinite(value) else ["float", value.hex()]
    if isinstance(value, torch.fx.Node):
        return ["node", value.name]
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["sym", str(value)]
    if isinstance(value, torch.Tensor):
        if real_tensors and not _is_fake(value):
            return ["tensor_data", tensor_digest(value)]
        return _tensor_meta(value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.qscheme)):
        return ["torch", str(value)]
    if isinstance(value, torch.Size):
        return ["size", [rec(v) for v in value]]
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ["op", op_name(value)]
    if isinstance(value, torch._ops.HigherOrderOperator):
        return ["hop", value.name()]
    if isinstance(value, enum.Enum):
        return ["enum", _qualname(type(value)), rec(value.value)]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", digest(bytes(value))]
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return ["callable", _qualname(value)]
    if isinstance(value, functools.partial):
        return ["partial", rec(value.func), rec(value.args), rec(value.keywords)]
    if isinstance(value, torch.fx.GraphModule):
        return ["graph", graph_digest(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return ["namedtuple", _qualname(type(value)), {f: rec(getattr(value, f)) for f in value._fields}]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [rec(v) for v in value]]
    if isinstance(value, Mapping):
        items = sorted((canonical_json(rec(k)), rec(v)) for k, v in value.items())
        return ["dict", items]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted(canonical_json(rec(v)) for v in value)]
    if dataclasses.is_dataclass(value):
        fields = {f.name: rec(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return ["dataclass", _qualname(type(value)), fields]
    if hasattr(value, "__dict__") and type(value).__module__.split(".")[0] in _TRUSTED_MODULES:
        return ["object", _qualname(type(value)), rec(vars(value))]
    raise Unhashable(f"cannot hash a value of type {_qualname(type(value))}")


# Objects from these packages are plain data holders whose __dict__ is their
# state (quantization specs, TOSA specs, observer configs).
_TRUSTED_MODULES = frozenset({"executorch", "torch", "torchao", "tosa_serializer", "lowercache"})


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def op_name(target: Any) -> str:
    """Qualified name of a call target: namespace, op and overload."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"packet:{target._qualified_op_name}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop:{target.name()}"
    if isinstance(target, str):
        return target
    name = getattr(target, "_schema", None)
    if name is not None:
        return f"schema:{name}"
    return _qualname(target)


def without_process_marks(custom: Any) -> Any:
    """``custom`` metadata without the marks torch's dynamo-disable wrapper leaves.

    Measured: the first quantized export in a process carries
    ``_torchdynamo_disable*`` entries on some decomposed nodes that later
    ones do not; they record the process's history, not the model, and no
    Arm pass or serializer reads them (it reads named keys only). Keyed, they
    made a server's children and a fresh process miss each other's steps.
    """
    if not isinstance(custom, dict):
        return custom
    return {k: v for k, v in custom.items() if not str(k).startswith("_torchdynamo_disable")}


def node_form(node: torch.fx.Node, ignored: frozenset[str] = IGNORED_META) -> list:
    """The canonical form of one node: identity, arguments and the metadata that matters."""
    meta = {k: canon(without_process_marks(v) if k == "custom" else v) for k, v in node.meta.items() if k not in ignored}
    return [
        node.op,
        node.name,
        op_name(node.target),
        canon(node.args),
        canon(node.kwargs),
        meta,
    ]


def graph_digest(gm: torch.fx.GraphModule, ignored: frozenset[str] = IGNORED_META) -> str:
    """Digest of a graph's nodes in order, including nested graph modules."""
    h = xxhash.xxh3_128()
    for node in gm.graph.nodes:
        h.update(canonical_json(node_form(node, ignored)).encode())
        h.update(b"\n")
        if node.op == "get_attr":
            attr = getattr(gm, str(node.target), None)
            if isinstance(attr, torch.fx.GraphModule):
                h.update(graph_digest(attr, ignored).encode())
            elif isinstance(attr, torch.Tensor):
                h.update(tensor_digest(attr).encode())
    return h.hexdigest()


def constants_digest(named: Mapping[str, Any]) -> str:
    """Digest of named constants (state_dict, lifted constants): names and bytes."""
    h = xxhash.xxh3_128()
    for name in sorted(named):
        value = named[name]
        h.update(name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            h.update(tensor_digest(value).encode())
        else:
            h.update(canonical_json(canon(value, real_tensors=True)).encode())
        h.update(b"\n")
    return h.hexdigest()


def signature_digest(sig: Any) -> str:
    """Digest of an ExportedProgram's graph signature: input/output kinds and names."""
    form = {
        "inputs": [
            [spec.kind.name, _arg_name(spec.arg), spec.target, getattr(spec, "persistent", None)]
            for spec in sig.input_specs
        ],
        "outputs": [[spec.kind.name, _arg_name(spec.arg), spec.target] for spec in sig.output_specs],
    }
    return digest_json(form)


def _arg_name(arg: Any) -> Any:
    name = getattr(arg, "name", None)
    if name is not None:
        return [type(arg).__name__, name]
    return [type(arg).__name__, canon(getattr(arg, "value", None))]


def program_parts(ep: torch.export.ExportedProgram, ignored: frozenset[str] = IGNORED_META) -> dict[str, str]:
    """Named digests of an ExportedProgram: graph (without the node metadata ``ignored``), signature, constants, ranges."""
    constants: dict[str, Any] = dict(ep.state_dict)
    constants.update({f"constant:{k}": v for k, v in ep.constants.items()})
    return {
        "graph": graph_digest(ep.graph_module, ignored),
        "signature": signature_digest(ep.graph_signature),
        "constants": constants_digest(constants),
        "ranges": digest_json(sorted(f"{k}:{v}" for k, v in ep.range_constraints.items())),
        "call_spec": digest_json([str(ep.call_spec.in_spec), str(ep.call_spec.out_spec)]),
    }
