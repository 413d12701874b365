"""A TOSA flatbuffer's canonical form: two graphs that differ only in tensor names and tensor-list order have one.

For an Ethos-U target the ``.pte`` holds Vela's stream, and Vela reads the
operators in order, their attributes, the constant bytes and the tensors'
shapes and types, never a tensor's name nor its place in the block's list
(``tests/flow/test_vela_names.py``). Region replay (issue 42) may therefore
produce a ``partition_N.tosa`` whose names and constant order differ from
stock's; this form tells "equal up to names" from "different". Names are
replaced by graph position: the block's inputs first, then each operator's
inputs and outputs in operator order, then the block's outputs. Tensors and
shapes no operator or block boundary names are left out, as Vela drops them.

Constants come as ``CONST`` operators, and their order is not the graph's
either: region replay splices regions whose constants stock lists in
another order. So the ``CONST`` operators are a multiset (sorted by what
they hold), and an operator's reference to a constant is the constant's
content (shape, type, bytes), not a position; the multiset is the block's
last entry. Two equal constants where
stock has one are still a difference (the multiset counts them).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from ...cache.digests import digest

_CONST = 67  # tosa.Op.CONST (checked against the installed tosa-tools in canonical())

# Accessors of a generated flatbuffers table that are not its fields.
_NOT_FIELDS = ("Init", "GetRootAs")


def canonical(tosa: bytes) -> list[Any]:
    """The graph's version and, per region and block, its operators and tensors with names replaced by position."""
    from tosa.Op import Op
    from tosa.TosaGraph import TosaGraph

    if Op.CONST != _CONST:
        raise RuntimeError(f"tosa-tools numbers CONST {Op.CONST}, not {_CONST}")
    graph = TosaGraph.GetRootAs(tosa, 0)
    version = graph.Version()
    form: list[Any] = [[version._Major(), version._Minor(), version._Patch(), version._Draft()] if version is not None else None]
    for r in range(graph.RegionsLength()):
        region = graph.Regions(r)
        form.append([_text(region.Name()), [_block(region.Blocks(b)) for b in range(region.BlocksLength())]])
    return form


def equal_up_to_names(a: bytes, b: bytes) -> bool:
    """Whether two TOSA flatbuffers are one graph but for tensor names and the order of their tensor lists."""
    return a == b or canonical(a) == canonical(b)


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _block(block: Any) -> list[Any]:
    tensors = {_text(t.Name()): t for t in (block.Tensors(i) for i in range(block.TensorsLength()))}
    shapes = {_text(s.Name()): s for s in (block.Shapes(i) for i in range(block.ShapesLength()))}
    position: dict[str, int] = {}

    def ref(name: Any) -> int:
        return position.setdefault(_text(name), len(position))

    ops = [block.Operators(i) for i in range(block.OperatorsLength())]
    constants: dict[str, Any] = {}  # the name of a CONST operator's output -> what it holds
    const_ops = []
    for op in ops:
        if op.Op() == _CONST and op.InputsLength() == 0 and op.OutputsLength() == 1:
            name = _text(op.Outputs(0))
            held = _tensor(tensors[name]) if name in tensors else ["undeclared"]
            constants[name] = held
            const_ops.append([op.AttributeType(), _attribute(op), held])

    def arg(name: Any) -> Any:
        held = constants.get(_text(name))
        return ["const", held] if held is not None else ref(name)

    inputs = [ref(block.Inputs(i)) for i in range(block.InputsLength())]
    operators: list[Any] = []
    for op in ops:
        if op.Op() == _CONST and op.InputsLength() == 0 and op.OutputsLength() == 1:
            continue
        operators.append([op.Op(), op.AttributeType(), _attribute(op),
                          [arg(op.Inputs(j)) for j in range(op.InputsLength())],
                          [ref(op.Outputs(j)) for j in range(op.OutputsLength())]])
    outputs = [arg(block.Outputs(i)) for i in range(block.OutputsLength())]
    described = []
    for name in position:  # in order of position
        if name in tensors:
            described.append(_tensor(tensors[name]))
        elif name in shapes:
            shape = shapes[name]
            described.append(["shape", shape.Rank(), digest(shape.DataAsNumpy().tobytes()) if shape.DataLength() else None])
        else:
            described.append(["undeclared"])
    return [_text(block.Name()), inputs, outputs, operators, described, sorted(const_ops, key=repr)]


def _tensor(tensor: Any) -> list[Any]:
    data = tensor.DataAsNumpy().tobytes() if tensor.DataLength() else b""
    return ["tensor", tensor.ShapeAsNumpy().tolist() if tensor.ShapeLength() else [], tensor.Type(), digest(data) if data else None,
            tensor.Variable(), tensor.IsUnranked(), _text(tensor.VariableName())]


def _attribute(op: Any) -> Any:
    """The operator's attribute table as plain values: each field by its accessor (vectors whole)."""
    from tosa.Attribute import Attribute

    kind = op.AttributeType()
    if kind == 0:
        return None
    name = next(n for n, v in vars(Attribute).items() if v == kind and not n.startswith("_"))
    cls = getattr(importlib.import_module(f"tosa.{name}"), name)
    table = op.Attribute()
    attribute = cls()
    attribute.Init(table.Bytes, table.Pos)
    values = {}
    for field, accessor in sorted(vars(cls).items()):
        if (not callable(accessor) or field.startswith(("_", *_NOT_FIELDS))
                or field.endswith(("Length", "IsNone", "AsNumpy", "BufferHasIdentifier"))):
            continue
        parameters = list(inspect.signature(accessor).parameters)
        if parameters == ["self"]:
            values[field] = _text(getattr(attribute, field)())
        elif parameters == ["self", "j"]:
            count = getattr(attribute, field + "Length")()
            values[field] = [_text(getattr(attribute, field)(j)) for j in range(count)]
    return [name, values]
