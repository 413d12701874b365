"""The stored form of a region's program halfway through the TOSA pipeline: no pickle, checked as it is rebuilt.

Region replay (``regionsplice.py``) serves an unchanged region's state at the
split, the first layout pass. By then the graph holds edge and TOSA-dialect
operators and the Arm metadata (``input_qparams``/``output_qparams``,
``tosa_special_dtype``, ``custom``), which torch's serializer cannot carry
(``programstore.py`` stores programs before the pipeline). This form is JSON
for the graph and raw bytes for the constants. Every value is tagged and
rebuilt from a closed list of kinds: operators are looked up by namespace and
name among ExecuTorch's edge and backend dialects or ``torch.ops``, never by
walking arbitrary attributes; a stored value of any other kind is refused
with ``FormatError`` and the region re-runs.

Metadata that never reaches the TOSA graph (provenance, descriptors of the
export's inputs, eager values) is left out; any other metadata this form
does not know keeps the region from being stored at all.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import math
import operator
import re
from typing import Any, NamedTuple

import torch

from ..stored.programstore import FormatError, tensor_from_record, tensor_record
from ...cache.hashing import dtype_name, tensor_bytes
from ...cache.store import Entry

FORMAT = "region-state:v1"

# Metadata left out: bookkeeping that no pass after the split and no TOSA byte reads.
DROPPED_META = frozenset({"from_node", "desc", "eager_input_vals", "source_fn_stack", "fwd_source_fn_stack"})

_NAME = re.compile(r"_?[A-Za-z][A-Za-z0-9_]*")  # an identifier; at most one leading underscore (`_clone_dim_order`), never a dunder
_PYTHON_TARGETS = {"getitem": operator.getitem}
_NO_DECOMP = "EDGE_DO_NOT_DECOMP::"  # to_edge's namespace for copies of the operators a partitioner keeps


def _checked(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FormatError(f"bad operator name {name!r}")
    return name


def encode_target(target: Any) -> list[str]:
    """An operator as ``[dialect, "namespace::name", overload]``; FormatError for anything else.

    to_edge's copy of an operator a partitioner keeps (``EDGE_DO_NOT_DECOMP::linear``, which metadata such as
    ``original_aten`` can name) is stored as ``["no_decomp", <the operator it copies>]``: a process that has not run
    to_edge yet has no such copy, and ``decode_target`` defines it as to_edge does.
    """
    from executorch.exir.dialects.backend._ops import BackendOpOverload
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    if isinstance(target, BackendOpOverload):
        return ["backend", target._op._schema.name, target._op._overloadname]
    if isinstance(target, EdgeOpOverload):
        return ["edge", target._op._schema.name, target._op._overloadname]
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.name.startswith(_NO_DECOMP):
            from executorch.exir.program import _program

            original = _program.transform_op_to_aten_op.get(str(target))
            if original is None:
                raise FormatError(f"{target} is not to_edge's copy of an operator")
            return ["no_decomp", original._schema.name, original._overloadname]
        return ["torch", target._schema.name, target._overloadname]
    for name, function in _PYTHON_TARGETS.items():
        if target is function:
            return ["python", name, ""]
    raise FormatError(f"unsupported operator {target!r}")


def decode_target(form: Any) -> Any:
    """The operator ``encode_target`` described, looked up in its dialect and checked to be that operator."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.dialects.backend._ops import BackendOpOverload
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    if not (isinstance(form, list) and len(form) == 3 and all(isinstance(x, str) for x in form)):
        raise FormatError("bad operator form")
    dialect, qualified, overload = form
    if dialect == "no_decomp":
        return _no_decomp_copy(decode_target(["torch", qualified, overload]), form)
    if dialect == "python":
        if qualified not in _PYTHON_TARGETS:
            raise FormatError(f"unknown Python operator {qualified!r}")
        return _PYTHON_TARGETS[qualified]
    namespace, _, name = qualified.partition("::")
    roots = {"edge": (exir_ops.edge, EdgeOpOverload), "backend": (exir_ops.backend, BackendOpOverload), "torch": (torch.ops, torch._ops.OpOverload)}
    if dialect not in roots:
        raise FormatError(f"unknown dialect {dialect!r}")
    root, kind = roots[dialect]
    try:
        op = getattr(getattr(getattr(root, _checked(namespace)), _checked(name)), _checked(overload))
    except (AttributeError, RuntimeError) as err:
        raise FormatError(f"unknown operator {qualified}.{overload}: {err}") from None
    if not isinstance(op, kind) or encode_target(op) != form:
        raise FormatError(f"{qualified}.{overload} is not a {dialect} operator")
    return op


def _no_decomp_copy(original: Any, form: list[str]) -> Any:
    """to_edge's copy of ``original``, defined by to_edge's own ``_register_no_decomp_op`` if this process has not yet."""
    from executorch.exir.program import _program

    _program._register_no_decomp_op(original)
    copy = _program.aten_op_to_transform_op.get(original)
    if not isinstance(copy, torch._ops.OpOverload) or encode_target(copy) != form:
        raise FormatError(f"to_edge's copy of {form[1]}.{form[2]} is not the stored one")
    return copy


class _Kinds(NamedTuple):
    QuantArgs: type
    ArmAnnotationInfo: type
    TosaSpecialDtype: type
    FakeTensor: type
    TensorMetadata: type
    immutable_dict: type
    immutable_list: type


@functools.lru_cache(maxsize=1)
def _kinds() -> _Kinds:
    """The classes a stored value may be, imported once (the encoder sees thousands of values)."""
    from executorch.backends.arm._passes.quant_args import QuantArgs
    from executorch.backends.arm.common.annotation_meta import ArmAnnotationInfo
    from executorch.backends.arm.tosa.mapping import TosaSpecialDtype
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.immutable_collections import immutable_dict, immutable_list
    from torch.fx.passes.shape_prop import TensorMetadata

    return _Kinds(QuantArgs, ArmAnnotationInfo, TosaSpecialDtype, FakeTensor, TensorMetadata, immutable_dict, immutable_list)


class _Encoder:
    """Values to tagged JSON; node references as indices into the graph's node list."""

    def __init__(self, nodes: dict[torch.fx.Node, int] | None = None, dropped: frozenset[str] = DROPPED_META) -> None:
        self.nodes = nodes or {}
        self.dropped = dropped

    def value(self, v: Any) -> Any:
        QuantArgs, ArmAnnotationInfo, TosaSpecialDtype, FakeTensor, TensorMetadata, immutable_dict, immutable_list = _kinds()
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) in (int, bool):
            return v
        if type(v) is float:
            return v if math.isfinite(v) else {"float": repr(v)}
        if isinstance(v, torch.fx.Node):
            if v not in self.nodes:
                raise FormatError(f"reference to a node outside the graph: {v.name}")
            return {"node": self.nodes[v]}
        if isinstance(v, torch.dtype):
            return {"dtype": dtype_name(v)}
        if isinstance(v, torch.memory_format):
            return {"memory_format": str(v).removeprefix("torch.")}
        if isinstance(v, torch.layout):
            return {"layout": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, FakeTensor):
            if v.device.type != "cpu":
                raise FormatError("a fake value off the CPU")
            return {"fake": [dtype_name(v.dtype), list(v.shape), list(v.stride()), v.storage_offset(), bool(v.requires_grad)]}
        if isinstance(v, torch.Tensor):
            raise FormatError("a real tensor in the graph's metadata")
        if isinstance(v, QuantArgs):
            return {"qargs": [self.value(x) for x in v]}
        if isinstance(v, TensorMetadata):
            return {"tensor_meta": [self.value(x) for x in v]}
        if isinstance(v, ArmAnnotationInfo):
            return {"arm_annotation": bool(v.quantized)}
        if isinstance(v, TosaSpecialDtype):
            return {"tosa_special_dtype": v.name}
        if isinstance(v, torch.Size):
            return {"size": [self.value(x) for x in v]}
        if isinstance(v, torch._ops.OpOverload) or any(v is f for f in _PYTHON_TARGETS.values()):
            return {"op": encode_target(v)}
        if type(v) in (list, immutable_list):
            return [self.value(x) for x in v]
        if type(v) is tuple:
            return {"tuple": [self.value(x) for x in v]}
        if type(v) in (dict, immutable_dict) and all(isinstance(k, (str, int)) and type(k) in (str, int) for k in v):
            return {"dict": [[k, self.value(x)] for k, x in v.items()]}
        if isinstance(v, enum.Enum):
            raise FormatError(f"unsupported enum {type(v).__qualname__}")
        raise FormatError(f"unsupported value {type(v).__qualname__}")

    def meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        return {k: self.value(v) for k, v in meta.items() if k not in self.dropped}


class _Decoder:
    """Tagged JSON back to values; fake values in ``fake_mode``."""

    def __init__(self, fake_mode: Any, nodes: list[torch.fx.Node] | None = None) -> None:
        self.fake_mode = fake_mode
        self.nodes = nodes if nodes is not None else []

    def value(self, v: Any) -> Any:  # noqa: C901 - one branch per stored kind
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if not isinstance(v, dict) or len(v) != 1:
            raise FormatError("bad stored value")
        ((tag, body),) = v.items()
        if tag == "tuple":
            return tuple(self.value(x) for x in self._list(body))
        if tag == "dict":
            out = {}
            for item in self._list(body):
                if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
                    raise FormatError("bad stored dict")
                out[item[0]] = self.value(item[1])
            return out
        if tag == "node":
            if type(body) is not int or not 0 <= body < len(self.nodes):
                raise FormatError("reference to a node not yet defined")
            return self.nodes[body]
        if tag == "float":
            if body not in ("inf", "-inf", "nan"):
                raise FormatError("bad stored float")
            return float(body)
        if tag == "dtype":
            return _dtype(body)
        if tag in ("memory_format", "layout"):
            found = getattr(torch, _checked(body), None)
            if not isinstance(found, getattr(torch, tag)):
                raise FormatError(f"bad {tag}")
            return found
        if tag == "device":
            if body not in ("cpu", "meta"):
                raise FormatError("bad device")
            return torch.device(body)
        if tag == "fake":
            return self._fake(body)
        kinds = _kinds()
        if tag == "qargs":
            return kinds.QuantArgs(*[self.value(x) for x in self._list(body)])
        if tag == "tensor_meta":
            return kinds.TensorMetadata(*[self.value(x) for x in self._list(body)])
        if tag == "arm_annotation":
            return kinds.ArmAnnotationInfo(quantized=bool(body))
        if tag == "tosa_special_dtype":
            if body not in kinds.TosaSpecialDtype.__members__:
                raise FormatError("bad TOSA special dtype")
            return kinds.TosaSpecialDtype[body]
        if tag == "size":
            return torch.Size(self.value(x) for x in self._list(body))
        if tag == "op":
            return decode_target(body)
        raise FormatError(f"unknown stored kind {tag!r}")

    @staticmethod
    def _list(body: Any) -> list[Any]:
        if not isinstance(body, list):
            raise FormatError("bad stored list")
        return body

    def _fake(self, body: Any) -> Any:
        if not (isinstance(body, list) and len(body) == 5):
            raise FormatError("bad stored fake value")
        dtype, shape, stride, offset, grad = body
        if not all(isinstance(x, list) and all(type(i) is int and i >= 0 for i in x) for x in (shape, stride)) or type(offset) is not int:
            raise FormatError("bad stored fake value")
        meta = torch.empty_strided(shape, stride, dtype=_dtype(dtype), device="meta")
        if offset:
            meta = meta.as_strided(shape, stride, offset)
        fake = _kinds().FakeTensor(self.fake_mode, meta, torch.device("cpu"))
        return fake.requires_grad_(True) if grad is True else fake

    def meta(self, meta: Any) -> dict[str, Any]:
        if not isinstance(meta, dict):
            raise FormatError("bad stored metadata")
        return {_meta_key(k): self.value(v) for k, v in meta.items()}


def _meta_key(key: Any) -> str:
    if not isinstance(key, str) or not _NAME.fullmatch(key):
        raise FormatError("bad metadata key")
    return key


def _dtype(name: Any) -> torch.dtype:
    found = getattr(torch, _checked(name), None)
    if not isinstance(found, torch.dtype):
        raise FormatError(f"unknown dtype {name!r}")
    return found


def encode(program: Any, extra: dict[str, Any] | None = None) -> Entry:
    """The stored form of a region's program (graph, signature, constants); ``extra``: JSON the caller keeps with it.

    FormatError when the program holds anything this form does not carry.
    """
    nodes = encode_nodes(program.graph_module.graph)
    inputs = encode_signature(program.graph_signature)
    tensors: dict[str, dict[str, Any]] = {}
    chunks: list[bytes] = []
    offset = 0
    for group, items in (("state_dict", program.state_dict), ("constants", program.constants)):
        for name, t in items.items():
            data = tensor_bytes(t)
            tensors[f"{group}/{name}"] = {**tensor_record(t), "offset": offset, "size": len(data)}
            chunks.append(data)
            offset += len(data)
    doc = {"nodes": nodes, "inputs": inputs, "extra": extra or {}}
    graph = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return Entry(meta={"format": FORMAT, "tensors": tensors}, blobs={"program.json": graph, "tensors": b"".join(chunks)})


def encode_nodes(graph: torch.fx.Graph, dropped: frozenset[str] = DROPPED_META) -> list[dict[str, Any]]:
    """A graph's nodes in this form (metadata keys in ``dropped`` left out); FormatError for what it does not carry."""
    encoder = _Encoder({n: i for i, n in enumerate(graph.nodes)}, dropped)
    nodes = []
    for n in graph.nodes:
        if n.op not in ("placeholder", "call_function", "output"):
            raise FormatError(f"unsupported node kind {n.op}")
        target = n.target if n.op == "placeholder" else (encode_target(n.target) if n.op == "call_function" else "output")
        nodes.append({"op": n.op, "name": n.name, "target": target, "args": encoder.value(n.args),
                      "kwargs": encoder.value(dict(n.kwargs)), "meta": encoder.meta(n.meta)})
    return nodes


def encode_signature(signature: Any) -> list[list[Any]]:
    """A graph signature's input specs as stored (outputs are the output node's); FormatError for a non-tensor input
    or an output other than a user tensor."""
    from torch.export.graph_signature import OutputKind, TensorArgument

    inputs = []
    for spec in signature.input_specs:
        if not isinstance(spec.arg, TensorArgument):
            raise FormatError("a non-tensor input")
        inputs.append([spec.kind.name, spec.arg.name, spec.target, spec.persistent])
    if any(s.kind != OutputKind.USER_OUTPUT or not isinstance(s.arg, TensorArgument) for s in signature.output_specs):
        raise FormatError("an output other than a user tensor")
    return inputs


def decode_signature(stored: Any, graph: torch.fx.Graph) -> Any:
    """The signature ``encode_signature`` stored for ``graph``: its inputs as stored, its outputs the output node's."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

    if not isinstance(stored, list):
        raise FormatError("bad input specs")
    input_specs = []
    for item in stored:
        if not (isinstance(item, list) and len(item) == 4 and item[0] in InputKind.__members__ and isinstance(item[1], str)):
            raise FormatError("bad input spec")
        kind, name, target, persistent = item
        if target is not None and not isinstance(target, str) or persistent not in (None, True, False):
            raise FormatError("bad input spec")
        input_specs.append(InputSpec(kind=InputKind[kind], arg=TensorArgument(name=name), target=target, persistent=persistent))
    built = list(graph.nodes)
    if [s.arg.name for s in input_specs] != [n.name for n in built if n.op == "placeholder"]:
        raise FormatError("input specs do not match the placeholders")
    outputs = built[-1].args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    if not all(isinstance(o, torch.fx.Node) for o in outputs):
        raise FormatError("an output that is not a node")
    return ExportGraphSignature(
        input_specs=input_specs,
        output_specs=[OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=o.name), target=None) for o in outputs],
    )


def decode_nodes(stored: Any, fake_mode: Any) -> torch.fx.Graph:
    """The graph ``encode_nodes`` stored, fake values made in ``fake_mode``; FormatError for anything it did not write."""
    if not isinstance(stored, list):
        raise FormatError("bad stored nodes")
    graph = torch.fx.Graph()
    built: list[torch.fx.Node] = []
    decoder = _Decoder(fake_mode, built)
    for node in stored:
        built.append(_node(graph, decoder, node))
    if not built or built[-1].op != "output":
        raise FormatError("a stored graph without an output")
    return graph


def decode(entry: Entry, like: Any) -> tuple[Any, dict[str, Any]]:
    """The program ``encode`` stored and its ``extra``, built as a copy of ``like`` (its fake mode, its module's
    attributes) with the stored graph; FormatError for anything this format did not write."""
    from torch.export.graph_signature import InputKind

    if not isinstance(entry.meta, dict) or entry.meta.get("format") != FORMAT or not isinstance(entry.meta.get("tensors"), dict):
        raise FormatError("not a stored region state")
    try:
        doc = json.loads(entry.blobs["program.json"])
    except (KeyError, ValueError) as err:
        raise FormatError(f"region state JSON: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not isinstance(doc.get("inputs"), list):
        raise FormatError("bad region state")
    groups: dict[str, dict[str, torch.Tensor]] = {"state_dict": {}, "constants": {}}
    packed = entry.blobs.get("tensors", b"")
    for name, record in entry.meta["tensors"].items():
        group, _, key = name.partition("/")
        if group not in groups or not isinstance(record, dict):
            raise FormatError("bad stored tensor")
        try:
            groups[group][key] = tensor_from_record(record, packed)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise FormatError(f"bad stored tensor {name}: {err}") from None
    graph = decode_nodes(doc["nodes"], fake_mode(like))
    signature = decode_signature(doc["inputs"], graph)
    for s in signature.input_specs:
        if s.kind != InputKind.USER_INPUT and s.target not in groups["state_dict"] and s.target not in groups["constants"]:
            raise FormatError(f"constant {s.target} is not stored")
    program = copy.copy(like)
    program._graph_module = torch.fx.GraphModule(torch.nn.Module(), graph)
    program._graph_signature = signature
    program._state_dict = groups["state_dict"]
    program._constants = groups["constants"]
    extra = doc.get("extra")
    return program, extra if isinstance(extra, dict) else {}


def _node(graph: torch.fx.Graph, decoder: _Decoder, stored: Any) -> torch.fx.Node:
    if not isinstance(stored, dict) or not isinstance(stored.get("name"), str) or not _NAME.fullmatch(stored["name"]):
        raise FormatError("bad stored node")
    op = stored.get("op")
    args = decoder.value(stored.get("args"))
    kwargs = decoder.value(stored.get("kwargs"))
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise FormatError("bad stored arguments")
    if op == "placeholder":
        node = graph.placeholder(stored["name"])
    elif op == "call_function":
        node = graph.create_node("call_function", decode_target(stored.get("target")), args, kwargs, name=stored["name"])
    elif op == "output":
        node = graph.output(args[0] if args else None)
    else:
        raise FormatError(f"unsupported node kind {op!r}")
    if op != "output" and node.name != stored["name"]:
        raise FormatError(f"node name {stored['name']} is taken twice")
    node.meta = decoder.meta(stored.get("meta"))
    return node


def fake_mode(program: Any) -> Any:
    """The fake mode of ``program``'s values (new values are made in it)."""
    for n in program.graph_module.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, _kinds().FakeTensor):
            return val.fake_mode
    raise FormatError("the program has no fake values")


def encode_meta(meta: dict[str, Any]) -> Any:
    """A node's metadata as stored (no node references allowed)."""
    return _Encoder().meta(meta)


def decode_meta(form: Any, mode: Any) -> dict[str, Any]:
    """Metadata ``encode_meta`` stored, fake values in ``mode``."""
    return _Decoder(mode).meta(form)
