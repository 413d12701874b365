"""Localized decompositions replayed from stored templates, since what a trace makes of a candidate depends only on what its step key holds.

Why it is exact, and figures: docs/speedups.md#decompositions-replayed-templates.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch

from ..cache.hashing import digest_json, op_name

KIND = "decomp"
_NAMESPACES = frozenset({"aten", "prims"})
_SOURCE_KINDS = frozenset({"val", "tensor_meta", "seq_nr", "from_node", "copy"})


class Refused(Exception):
    """A candidate, template or stored entry outside what a replay reproduces."""


def table_digest(table: Any) -> str | None:
    """A digest of a decomposition table by operator and function name.

    Only functions of torch and ExecuTorch themselves, whose code the
    toolchain part pins (a closure such as torch's ``register_inplace``
    helpers is named by where it is made, and made for the operator it is
    filed under); None for anything else, which then is always traced.
    """
    if not table:
        return "none"
    rows = []
    for op, fn in table.items():
        name = _function_name(fn)
        if name is None:
            return None
        rows.append([str(op), name])
    return digest_json(sorted(rows))


def _function_name(fn: Any) -> Any:
    """``[module, qualname]`` of a torch or ExecuTorch function (a ``partial`` of one with literal or
    operator arguments: ``[name, args, keywords]``); None otherwise."""
    import functools

    if type(fn) is functools.partial:
        inner = _function_name(fn.func)
        args = [_partial_arg(a) for a in fn.args]
        keywords = sorted([k, _partial_arg(v)] for k, v in fn.keywords.items())
        if inner is None or None in args or any(v is None for _, v in keywords):
            return None
        return [inner, args, keywords]
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if module.split(".", 1)[0] not in ("torch", "executorch"):
        return None
    return [module, qualname]


def _partial_arg(a: Any) -> Any:
    if isinstance(a, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ["op", str(a)]
    if a is None or type(a) in (bool, int, str):
        return ["lit", a]
    if callable(a):
        return _function_name(a)
    return None


def key_parts(c: torch.fx.Node, table: str, toolchain: str) -> dict[str, str] | None:
    """The named parts of candidate ``c``'s ``decomp`` step; None when it cannot be keyed."""
    from torch.fx.proxy import _COPY_META_FIELDS

    target = c.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None  # other namespaces may carry user code in their decompositions
    inputs = c.all_input_nodes
    try:
        args = [_ref_of(a, inputs, {}) for a in c.args]
        kwargs = [[k, _ref_of(v, inputs, {})] for k, v in c.kwargs.items()]
        sigs = [_tensor_sig(i.meta.get("val")) for i in inputs]
    except Refused:
        return None
    # The trace copies these fields in torch's own order, whatever order the candidate holds them in (a program
    # served from a stored form holds them as written, a fresh export as traced): the key names them in that order.
    copied = [k for k in _COPY_META_FIELDS if k in c.meta and k not in ("original_aten", "from_node")]
    return {
        "toolchain": toolchain,
        "table": table,
        "op": str(target),
        "args": digest_json([args, kwargs]),
        "inputs": digest_json(sigs),
        "meta": ",".join(copied),
    }


def _tensor_sig(v: Any) -> list:
    if type(v).__name__ != "FakeTensor" or not all(type(d) is int for d in v.shape):
        raise Refused("input value")
    return [list(v.shape), list(v.stride()), str(v.dtype), str(v.device), v.requires_grad, v.storage_offset(), v._is_view()]


def _lit(v: Any) -> dict:
    t = type(v)
    if v is None:
        return {"none": None}
    if t is bool:
        return {"bool": v}
    if t is int:
        return {"int": v}
    if t is float:
        return {"float": v.hex()}
    if t is str:
        return {"str": v}
    if t is torch.dtype:
        return {"dtype": str(v).removeprefix("torch.")}
    if t is torch.device:
        return {"device": str(v)}
    if t is torch.layout:
        return {"layout": str(v).removeprefix("torch.")}
    if t is torch.memory_format:
        return {"memory_format": str(v).removeprefix("torch.")}
    raise Refused(f"literal of type {t.__name__}")


def _unlit(d: Any) -> Any:
    if not isinstance(d, dict) or len(d) != 1:
        raise Refused("literal")
    (kind, v), = d.items()
    if kind == "none" and v is None:
        return None
    if kind == "bool" and type(v) is bool:
        return v
    if kind == "int" and type(v) is int:
        return v
    if kind == "float" and type(v) is str:
        return float.fromhex(v)
    if kind == "str" and type(v) is str:
        return v
    if kind == "device" and type(v) is str:
        return torch.device(v)
    if kind in ("dtype", "layout", "memory_format") and type(v) is str and v.isidentifier():
        value = getattr(torch, v, None)
        expected = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}[kind]
        if type(value) is expected:
            return value
    raise Refused("literal")


def _ref_of(a: Any, inputs: list, body: dict) -> Any:
    """A JSON reference to an argument: an input of the candidate, an earlier node, a container or a literal."""
    if isinstance(a, torch.fx.Node):
        if a in body:
            return ["body", body[a]]
        if a in inputs:
            return ["in", inputs.index(a)]
        raise Refused("argument from outside")
    if isinstance(a, (list, tuple)):
        return ["tuple" if type(a) is tuple else "list", [_ref_of(x, inputs, body) for x in a]]
    return ["lit", _lit(a)]


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload) and target.namespace in _NAMESPACES:
        return op_name(target)
    raise Refused(f"operator {target}")


def _op(name: Any) -> Any:
    if name == "getitem":
        return operator.getitem
    if not isinstance(name, str) or "::" not in name or "." not in name:
        raise Refused("operator name")
    namespace, rest = name.split("::", 1)
    opname, overload = rest.rsplit(".", 1)
    if namespace not in _NAMESPACES:
        raise Refused("operator namespace")
    packet = getattr(getattr(torch.ops, namespace), opname, None)
    op = getattr(packet, overload, None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload):
        raise Refused(f"unknown operator {name}")
    return op


def _chain_shape(chain: Any) -> Any:
    return [
        [ns.node_info.name if ns.node_info else None, ns.node_info.target if ns.node_info else None, ns.pass_name, [a.value for a in ns.action], _chain_shape(ns.from_node)]
        for ns in chain or []
    ]


def _from_node_template(chain: Any, c: torch.fx.Node) -> list:
    """The trace's ``from_node``: sources named as the candidate, down to the candidate's own chain."""
    out = []
    for ns in chain or []:
        if ns.node_info is None or ns.node_info.name != c.name or ns.node_info.target != str(c.target):
            raise Refused("from_node names another node")
        inner = "own" if _chain_shape(ns.from_node) == _chain_shape(c.meta.get("from_node")) else _from_node_template(ns.from_node, c)
        out.append([ns.pass_name, [a.value for a in ns.action], inner])
    return out


def capture(c: torch.fx.Node, body: list, out: torch.fx.Node, input_of: dict, output_of: dict) -> dict:
    """The template of candidate ``c`` from its traced nodes ``body`` (in order) and output ``out``.

    ``input_of`` maps the small program's placeholders to the big program's
    nodes, ``output_of`` each candidate's traced output to that candidate
    (when ``c`` reads another candidate, the trace hands it that output).
    """
    inputs = c.all_input_nodes
    index = {n: j for j, n in enumerate(body)}

    def ref(a: Any) -> Any:
        if isinstance(a, torch.fx.Node) and a not in index:
            owner = output_of.get(a)
            a = owner if owner is not None and owner in inputs else input_of.get(a, a)
        return _ref_of(a, inputs, index)

    nodes = []
    for n in body:
        sources = []
        for k, v in n.meta.items():
            if k in ("val", "tensor_meta", "seq_nr", "from_node"):
                sources.append([k, k])
            elif k == "original_aten":
                sources.append([k, ["op", _op_name(v)]])
            elif k in c.meta and (v is c.meta[k] or v == c.meta[k]):
                sources.append([k, "copy"])
            else:
                raise Refused(f"metadata {k}")
        nodes.append(
            {
                "op": _op_name(n.target),
                "args": [ref(a) for a in n.args],
                "kwargs": [[k, ref(v)] for k, v in n.kwargs.items()],
                "meta": sources,
                "from_node": _from_node_template(n.meta.get("from_node"), c),
            }
        )
    return {"nodes": nodes, "out": ref(out)}


def decode(template: Any, n_inputs: int) -> dict:
    """A stored template, checked: operators resolved, references in range, literals rebuilt."""
    if not isinstance(template, dict) or not isinstance(template.get("nodes"), list):
        raise Refused("template shape")

    def check_ref(r: Any, made: int) -> Any:
        if not isinstance(r, list) or len(r) != 2:
            raise Refused("reference")
        kind, v = r
        if kind == "in" and type(v) is int and 0 <= v < n_inputs:
            return ("in", v)
        if kind == "body" and type(v) is int and 0 <= v < made:
            return ("body", v)
        if kind in ("tuple", "list") and isinstance(v, list):
            return (kind, [check_ref(x, made) for x in v])
        if kind == "lit":
            return ("lit", _unlit(v))
        raise Refused("reference")

    def check_chain(chain: Any) -> list:
        from torch.fx.traceback import NodeSourceAction

        if not isinstance(chain, list):
            raise Refused("from_node")
        out = []
        for item in chain:
            if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str) or not isinstance(item[1], list):
                raise Refused("from_node")
            actions = [NodeSourceAction(a) for a in item[1]]
            inner = "own" if item[2] == "own" else check_chain(item[2])
            out.append((item[0], actions, inner))
        return out

    nodes = []
    try:
        for j, spec in enumerate(template["nodes"]):
            sources = []
            for key, source in spec["meta"]:
                if not isinstance(key, str):
                    raise Refused("metadata key")
                if isinstance(source, list) and len(source) == 2 and source[0] == "op":
                    sources.append((key, ("op", _op(source[1]))))
                elif source in _SOURCE_KINDS and (source == "copy" or source == key):
                    sources.append((key, source))
                else:
                    raise Refused("metadata source")
            nodes.append(
                (
                    _op(spec["op"]),
                    [check_ref(a, j) for a in spec["args"]],
                    [(k, check_ref(v, j)) for k, v in spec["kwargs"]],
                    sources,
                    check_chain(spec["from_node"]),
                )
            )
        out = check_ref(template["out"], len(nodes))
    except (KeyError, TypeError, ValueError) as err:
        raise Refused(f"template: {err}") from None
    return {"nodes": nodes, "out": out}


def applicable(template: dict, c: torch.fx.Node) -> bool:
    """Whether every metadata field the template copies from the candidate is there to copy."""
    return all(source != "copy" or key in c.meta for node in template["nodes"] for key, source in node[3])


def references(template: dict) -> set[int]:
    """The candidate inputs a template's nodes read."""
    found: set[int] = set()

    def walk(r: Any) -> None:
        if r[0] == "in":
            found.add(r[1])
        elif r[0] in ("tuple", "list"):
            for x in r[1]:
                walk(x)

    for _, args, kwargs, _, _ in template["nodes"]:
        for a in args:
            walk(a)
        for _, v in kwargs:
            walk(v)
    walk(template["out"])
    return found


def _resolve(r: Any, inputs: list, made: list) -> Any:
    """A decoded reference with inputs and earlier nodes taken from ``inputs`` and ``made``."""
    kind, v = r
    if kind == "in":
        return inputs[v]
    if kind == "body":
        return made[v]
    if kind == "tuple":
        return tuple(_resolve(x, inputs, made) for x in v)
    if kind == "list":
        return [_resolve(x, inputs, made) for x in v]
    return v


def values(c: torch.fx.Node, template: dict, input_values: list) -> tuple[list, Any]:
    """The value of each of ``c``'s nodes, and of its replacement, computed before the graph is touched.

    Each operator runs on its inputs' values in the program's fake mode
    without grad, as the trace runs it; ``extract_val`` as the tracer
    applies it. Raises :class:`Refused` when anything fails (the call is
    then made in full, on the untouched program).
    """
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import extract_val

    tensors = [v for v in (c.meta.get("val"), *input_values) if isinstance(v, torch.Tensor)]
    made: list = []

    def value(r: Any) -> Any:
        return _resolve(r, input_values, made)

    try:
        mode = detect_fake_mode(tensors)
        if mode is None:
            raise Refused("no fake mode")
        for target, args_t, kwargs_t, _, _ in template["nodes"]:
            args = tuple(value(a) for a in args_t)
            kwargs = {k: value(v) for k, v in kwargs_t}
            with torch.no_grad(), mode:
                made.append(extract_val(target(*args, **kwargs)))
        return made, value(template["out"])
    except Refused:
        raise
    except Exception as err:  # a template that does not fit: the trace decides
        raise Refused(f"{type(err).__name__}: {err}") from None


def insert(graph: torch.fx.Graph, c: torch.fx.Node, template: dict, inputs: list, made_values: list, seq_nr: int, new_nodes: set) -> torch.fx.Node:
    """Insert ``c``'s nodes from ``template`` before it, with the values :func:`values` computed;
    returns the node (or input) that replaces ``c``.

    ``inputs`` are ``c``'s inputs as its key saw them, each an earlier
    candidate's replacement where it was one.
    """
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
    from torch.fx.traceback import NodeSource

    made: list = []

    def build(r: Any) -> Any:
        return _resolve(r, inputs, made)

    def chain(template_chain: list) -> list:
        out = []
        for pass_name, actions, inner in template_chain:
            source = NodeSource(None, pass_name, list(actions))
            source.node_info = NodeSource.NodeInfo(name=c.name, target=str(c.target), graph_id=id(graph))
            source.from_node = copy.deepcopy(c.meta.get("from_node", [])) if inner == "own" else chain(inner)
            out.append(source)
        return out

    with graph.inserting_before(c):
        for (target, args_t, kwargs_t, sources, from_node), val in zip(template["nodes"], made_values):
            node = graph.create_node("call_function", target, tuple(build(a) for a in args_t), {k: build(v) for k, v in kwargs_t})
            meta: dict[str, Any] = {}
            for key, source in sources:
                if source == "val":
                    meta[key] = val
                elif source == "tensor_meta":
                    meta[key] = _extract_tensor_metadata(val)
                elif source == "seq_nr":
                    meta[key] = seq_nr
                elif source == "from_node":
                    meta[key] = chain(from_node)
                elif source == "copy":
                    meta[key] = copy.copy(c.meta[key])
                else:
                    meta[key] = copy.copy(source[1])  # original_aten: the tracer copies it per node
            node.meta = meta
            made.append(node)
            new_nodes.add(node)
    return build(template["out"])
