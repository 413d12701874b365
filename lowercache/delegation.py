"""What runs outside the delegate, and which of the user's modules each operator came from (imports no torch).

A lowering's ``delegation`` section (``manifest.json``, ``lower``'s table
line, ``--json``) is made once, when the flow runs: the edge program's
nodes outside every delegate, by operator, with the module path
``nn_module_stack`` gives each (``features.3``), and the ``.pte``'s own
operator table. It is stored with the flow entry, so a hit (direct mode
too) shows it without a graph. Each partition's TOSA tensor names map to
module paths the same way, which turns Vela's per-layer labels
(``tosa_rescale_default_1``) into the user's (``features.3.conv``).
Reading a graph here never changes it: reporting cannot change a byte.
"""

from __future__ import annotations

import operator
import struct
from typing import Any, Optional

TOP_LEVEL = "(top level)"  # the module path of nodes in the model's own forward
# Conversions the quantized flow leaves around every delegate: counted, not listed as fallbacks.
_CONVERSIONS = ("quantized_decomposed.quantize_per_tensor", "quantized_decomposed.dequantize_per_tensor",
                "quantized_decomposed.quantize_per_channel", "quantized_decomposed.dequantize_per_channel")
MAX_MODULES = 3


def module_path(node: Any) -> Optional[str]:
    """The innermost module of the user's that made ``node`` (``features.3.conv``), ``TOP_LEVEL``, or None when unknown."""
    stack = node.meta.get("nn_module_stack") if hasattr(node, "meta") else None
    if not stack:
        return None
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, (tuple, list)) and path else path
    return path if isinstance(path, str) and path else TOP_LEVEL


def _where(node: Any) -> Optional[str]:
    """:func:`module_path` as the delegation line says it: a child of a Sequential model, whose path is a bare index
    (``1``), is named by its class and index (``LayerNorm model[1]``)."""
    path = module_path(node)
    if path is None or not path.isdigit():
        return path
    entry = list(node.meta["nn_module_stack"].values())[-1]
    kind = entry[1] if isinstance(entry, (tuple, list)) and len(entry) > 1 else None
    name = getattr(kind, "__name__", None) or str(kind or "").strip("<>'").removeprefix("class '").rpartition(".")[2]
    return f"{name} model[{path}]" if name else f"model[{path}]"


def _op_name(target: Any) -> str:
    """``aten.sort.default`` for an edge or aten operator; the name of anything else."""
    inner = getattr(target, "_op", target)  # an EdgeOpOverload wraps the aten OpOverload
    return str(inner) if hasattr(inner, "_schema") else getattr(target, "__name__", str(target))


def summarize(graph_module: Any) -> dict[str, Any]:
    """A lowered edge program's delegates and, by operator, the nodes outside them with their module paths."""
    delegates = 0
    outside: dict[str, dict[str, Any]] = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if getattr(node.target, "__name__", "") == "executorch_call_delegate":
            delegates += 1
            continue
        name = _op_name(node.target)
        entry = outside.setdefault(name, {"op": name, "nodes": 0, "modules": []})
        entry["nodes"] += 1
        path = _where(node)
        if path is not None and path not in entry["modules"]:
            entry["modules"].append(path)
    return {"delegates": delegates, "outside": list(outside.values())}


def kernels(pte: bytes) -> list[str]:
    """The CPU kernels the ``.pte`` calls (``aten::sort.values``), or none when its operator table cannot be read."""
    try:
        return pte_operators(pte)
    except (ValueError, struct.error):
        return []


def json_part(section: Optional[dict[str, Any]]) -> dict[str, Any]:
    """What ``lower --json`` says of it: how much was delegated, and the section without the tensor-name maps (those are for
    ``watch``)."""
    if not section:
        return {}
    return {"delegated": extent(section), "delegation": {k: v for k, v in section.items() if k != "tensor_modules"}}


def extent(section: Optional[dict[str, Any]]) -> Optional[str]:
    """``fully``, ``partially`` or ``not``: how much of the model its delegates run, as aot_arm_compiler says it; None if unknown."""
    if not section:
        return None
    if not section.get("delegates"):
        return "not"
    return "partially" if any(not is_conversion(o["op"]) for o in section.get("outside", [])) else "fully"


def is_conversion(op: str) -> bool:
    """A quantize/dequantize at a delegate's edge: the quantized flow puts them around every delegate, so not a fallback."""
    return op.rpartition(".")[0] in _CONVERSIONS


def line(section: Optional[dict[str, Any]]) -> Optional[str]:
    """``fully delegated (1 partition)``, or ``partially delegated (3 partitions); outside the delegate: aten.sort (2 nodes:
    features.2, features.3)``; None when unknown."""
    how = extent(section)
    if section is None or how is None:
        return None
    delegates = int(section.get("delegates") or 0)
    said = f"{how} delegated" + (f" ({delegates} partition{'s' if delegates != 1 else ''})" if delegates else "")
    ops = [o for o in section.get("outside", []) if not is_conversion(o["op"])]
    if not ops:
        return said
    outside = []
    for o in ops:
        modules = o["modules"][:MAX_MODULES] + (["..."] if len(o["modules"]) > MAX_MODULES else [])
        where = f": {', '.join(modules)}" if modules else ""
        outside.append(f"{o['op'].rpartition('.')[0] or o['op']} ({o['nodes']} node{'s' if o['nodes'] != 1 else ''}{where})")
    conversions = sum(o["nodes"] for o in section.get("outside", []) if is_conversion(o["op"]))
    around = f"; and {conversions} quantize/dequantize node{'s' if conversions != 1 else ''} around them" if conversions else ""
    return f"{said}; outside the delegate: {'; '.join(outside)}{around}"


# -- the operators a .pte runs itself (outside every delegate) ----------------------------------------


class _Table:
    """Just enough of the flatbuffer format to read the ``.pte``'s operator table (schema: executorch's program.fbs)."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vsize = struct.unpack_from("<H", buf, self.vtable)[0]

    def _field(self, index: int) -> Optional[int]:
        slot = 4 + 2 * index
        if slot >= self.vsize:
            return None
        offset = struct.unpack_from("<H", self.buf, self.vtable + slot)[0]
        return self.pos + offset if offset else None

    def _target(self, index: int) -> Optional[int]:
        at = self._field(index)
        return None if at is None else at + struct.unpack_from("<I", self.buf, at)[0]

    def string(self, index: int) -> str:
        at = self._target(index)
        if at is None:
            return ""
        length = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4 : at + 4 + length].decode("utf-8", "replace")

    def tables(self, index: int) -> list["_Table"]:
        at = self._target(index)
        if at is None:
            return []
        length = struct.unpack_from("<I", self.buf, at)[0]
        items = []
        for i in range(length):
            slot = at + 4 + 4 * i
            items.append(_Table(self.buf, slot + struct.unpack_from("<I", self.buf, slot)[0]))
        return items


# Field indices in program.fbs: Program.execution_plan = 1; ExecutionPlan.operators = 6; Operator.name = 0, .overload = 1.
_PROGRAM_PLANS, _PLAN_OPERATORS, _OPERATOR_NAME, _OPERATOR_OVERLOAD = 1, 6, 0, 1


def pte_operators(pte: bytes) -> list[str]:
    """The operators the ``.pte``'s plans call as CPU kernels (``aten::add.out``): what the delegates left to the CPU."""
    if pte[4:6] != b"ET":
        raise ValueError("not an ExecuTorch program")
    program = _Table(pte, struct.unpack_from("<I", pte, 0)[0])
    names = set()
    for plan in program.tables(_PROGRAM_PLANS):
        for op in plan.tables(_PLAN_OPERATORS):
            name, overload = op.string(_OPERATOR_NAME), op.string(_OPERATOR_OVERLOAD)
            names.add(f"{name}.{overload}" if overload else name)
    return sorted(names)
