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
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from ..cache.digests import digest

# Accessors of a generated flatbuffers table that are not its fields.
_NOT_FIELDS = ("Init", "GetRootAs")


def canonical(tosa: bytes) -> list[Any]:
    """The graph's version and, per region and block, its operators and tensors with names replaced by position."""
    from tosa.TosaGraph import TosaGraph

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

    inputs = [ref(block.Inputs(i)) for i in range(block.InputsLength())]
    operators = []
    for i in range(block.OperatorsLength()):
        op = block.Operators(i)
        operators.append([op.Op(), op.AttributeType(), _attribute(op),
                          [ref(op.Inputs(j)) for j in range(op.InputsLength())],
                          [ref(op.Outputs(j)) for j in range(op.OutputsLength())]])
    outputs = [ref(block.Outputs(i)) for i in range(block.OutputsLength())]
    described = []
    for name in position:  # in order of position
        if name in tensors:
            described.append(_tensor(tensors[name]))
        elif name in shapes:
            shape = shapes[name]
            described.append(["shape", shape.Rank(), digest(shape.DataAsNumpy().tobytes()) if shape.DataLength() else None])
        else:
            described.append(["undeclared"])
    return [_text(block.Name()), inputs, outputs, operators, described]


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
