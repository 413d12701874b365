"""Build the FX graph of a stored program straight from torch.export's JSON.

torch's deserializer first turns the JSON into schema dataclasses (a tagged
union object per argument) and then walks those. For a stored quantized
DeiT-tiny that is some 50,000 union objects and most of a one-second warm
hit. ``GraphBuilder`` walks the decoded JSON itself and calls the same FX
graph methods, with the same arguments, in the same order as
``GraphModuleDeserializer.deserialize_graph``, so the graph, its node names
and its metadata come out the same; the rest of the program (signature,
module call graph, the ExportedProgram) is still torch's own code.

Only the subset a static-shape quantized program uses is built here: ATen
and other ``OpOverload`` calls with tensor, scalar and list arguments, and
tensor outputs. Anything else (symbolic values, higher-order ops, nested
graphs, custom objects, assertion ops) raises ``Unsupported`` before the
program is returned, and the caller rebuilds the whole program with torch's
deserializer instead. ``tests/unit/test_graphbuild.py`` compares both, node by node.
"""

from __future__ import annotations

import keyword
import operator
from collections import OrderedDict
from typing import Any

import torch

from ...speedups.patching import AttributePatch


class Unsupported(Exception):
    """The graph uses something only torch's deserializer builds."""


class RawGraph:
    """The decoded JSON of a schema ``Graph``, standing where the schema object would."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc


# A schema Graph with nothing in it: what the rest of the program is converted
# with, before the raw graph takes its place.
EMPTY_GRAPH = {"inputs": [], "outputs": [], "nodes": [], "tensor_values": {}, "sym_int_values": {}, "sym_bool_values": {}}

_SYMBOLIC_TABLES = ("sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values")


class GraphBuilder:
    """``deserialize_graph`` for a ``RawGraph``, on torch's deserializer ``owner``."""

    def __init__(self, owner: Any):
        from torch._export.serde import serialize as serde

        self.owner = owner
        self.graph: torch.fx.Graph = owner.graph
        self.nodes: dict[str, torch.fx.Node] = owner.serialized_name_to_node
        self.dtypes = serde._SERIALIZE_TO_TORCH_DTYPE
        self.formats = serde._SERIALIZE_TO_TORCH_MEMORY_FORMAT
        self.layouts = serde._SERIALIZE_TO_TORCH_LAYOUT
        self.unsupported_targets = set(serde._SYM_OPS) | {
            torch.ops.aten.item.default,
            torch.ops.aten._assert_scalar.default,
            torch.ops.aten.sym_constrain_range_for_size.default,
        }
        self.tensor_values: dict[str, Any] = {}
        self.vals: dict[str, Any] = {}
        self.devices: dict[tuple[str, int | None], torch.device] = {}
        self.operators: dict[str, Any] = {}
        self.module_stacks: dict[str, tuple[tuple[str, tuple[str, str]], ...]] = {}
        self.source_fns: dict[str, tuple[tuple[str, Any], ...]] = {}

    def build(self, raw: RawGraph) -> torch.fx.Graph:
        doc = raw.doc
        if any(doc.get(table) for table in _SYMBOLIC_TABLES):
            raise Unsupported("symbolic values or custom objects")
        self.tensor_values = doc["tensor_values"]
        graph = self.graph
        for i, input_ in enumerate(doc["inputs"]):
            ((kind, value),) = input_.items()
            if kind == "as_tensor":
                name = value["name"]
                placeholder = graph.placeholder(name)
                placeholder.name = name
                self.sync(name, placeholder)
            elif kind in ("as_int", "as_float", "as_bool", "as_none", "as_string"):
                name = self.owner.signature.input_specs[i].arg.name or f"arg{i}"
                placeholder = graph.placeholder(name)
                placeholder.meta["val"] = self.argument(input_)
            else:
                raise Unsupported(f"graph input {kind}")
        for node in doc["nodes"]:
            self.node(node)
        outputs = [self.graph_output(output) for output in doc["outputs"]]
        single = doc.get("is_single_tensor_return", False)
        if single:
            if len(outputs) != 1:
                raise Unsupported("a single tensor return with several outputs")
            result: Any = outputs[0]
        else:
            result = tuple(outputs)
        output_node = graph.output(result)
        first = output_node.args[0]
        if single:
            if not isinstance(first, torch.fx.Node):
                raise Unsupported("a single tensor return that is not a node")
            output_node.meta["val"] = first.meta["val"]
        else:
            output_node.meta["val"] = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in first)
        # torch then looks for unbacked symbols in every value; with no symbolic
        # table and every size an int (``fake`` checks) there are none to find.
        return graph

    def fake(self, name: str) -> Any:
        """The value of ``name``, built once (torch's LazyMap), as ``programstore._fake_from_meta`` builds it."""
        from torch._subclasses.fake_tensor import FakeTensor

        val = self.vals.get(name)
        if val is not None:
            return val
        meta = self.tensor_values[name]
        sizes = tuple(_static_int(v) for v in meta["sizes"])
        strides = tuple(_static_int(v) for v in meta["strides"])
        device_doc = meta["device"]
        key = (device_doc["type"], device_doc.get("index"))
        device = self.devices.get(key)
        if device is None:
            device = torch.device(type=key[0]) if key[1] is None else torch.device(type=key[0], index=key[1])
            self.devices[key] = device
        dtype = self.dtypes[meta["dtype"]]
        fake = FakeTensor(self.owner.fake_tensor_mode, torch.empty_strided(sizes, strides, dtype=dtype, device="meta"), device)
        val = fake.requires_grad_(True) if meta["requires_grad"] else fake
        self.vals[name] = val
        return val

    def sync(self, name: str, fx_node: torch.fx.Node) -> None:
        """``sync_fx_node``: the serialized name, the lookup entry and the value."""
        if name in self.nodes:
            raise Unsupported(f"node {name} defined twice")
        fx_node.name = name
        self.nodes[name] = fx_node
        fx_node.meta["val"] = self.fake(name)

    def operator(self, serialized: str) -> Any:
        target = self.operators.get(serialized)
        if target is None:
            target = self.operators[serialized] = self.owner.deserialize_operator(serialized)
        return target

    def node(self, node: dict[str, Any]) -> None:
        target = self.operator(node["target"])
        if not isinstance(target, torch._ops.OpOverload) or target in self.unsupported_targets:
            raise Unsupported(f"target {node['target']}")
        outputs = node["outputs"]
        name = node.get("name")
        if not name:
            name = outputs[0]["as_tensor"]["name"] if _single_tensor_return(target) else None
        args, kwargs = self.inputs(target, node["inputs"])
        fx_node = self.graph.create_node("call_function", target, args, kwargs, name)
        self.outputs(node, outputs, fx_node)
        meta = fx_node.meta
        meta.update(self.metadata(node["metadata"]))
        if "nn_module_stack" not in meta:
            meta["nn_module_stack"] = {}

    def inputs(self, target: Any, inputs: list[dict[str, Any]]) -> tuple[tuple[Any, ...], OrderedDict[str, Any]]:
        """``deserialize_inputs``: schema order, each value positional or keyword as recorded."""
        kinds = {i["name"]: i.get("kind") for i in inputs}
        actual = {i["name"]: self.argument(i["arg"]) for i in inputs}
        args: list[Any] = []
        kwargs: OrderedDict[str, Any] = OrderedDict()
        for name, positional, is_keyword, kwarg_only in _schema_args(target):
            if name in actual:
                kind = kinds[name]
                if kind == 1:  # ArgumentKind.POSITIONAL
                    args.append(actual[name])
                    continue
                if kind == 2 and not is_keyword:  # ArgumentKind.KEYWORD
                    kwargs[name] = actual[name]
                    continue
            if positional:
                args.append(actual[name])
            elif is_keyword:
                if kwarg_only:
                    raise Unsupported(f"keyword-only argument {name} named as a keyword")
                if kwargs:
                    kwargs = OrderedDict()
                args.append(actual[name])
            elif name in actual:
                kwargs[name] = actual[name]
        return tuple(args), kwargs

    def argument(self, arg: dict[str, Any]) -> Any:
        """``deserialize_input`` on a decoded ``Argument`` union."""
        ((kind, value),) = arg.items()
        if kind == "as_none":
            return None
        if kind == "as_tensor":
            return self.nodes[value["name"]]
        if kind == "as_int" or kind == "as_bool" or kind == "as_string":
            return value
        if kind == "as_float":
            return float(value)
        if kind == "as_scalar_type":
            return self.dtypes[value]
        if kind == "as_memory_format":
            return self.formats[value]
        if kind == "as_layout":
            return self.layouts[value]
        if kind == "as_device":
            index = value.get("index")
            return torch.device(type=value["type"]) if index is None else torch.device(type=value["type"], index=index)
        if kind == "as_complex":
            return complex(float(value["real"]), float(value["imag"]))
        if kind == "as_sym_int":
            return _static_int(value)
        if kind == "as_string_to_argument":
            return {k: self.argument(v) for k, v in value.items()}
        if kind == "as_operator":
            return self.operator(value)
        if isinstance(value, list):
            if not value:
                return []
            if kind == "as_tensors":
                return [self.nodes[a["name"]] for a in value]
            if kind in ("as_ints", "as_bools", "as_strings"):
                return list(value)
            if kind == "as_floats":
                return [float(v) for v in value]
            if kind == "as_int_lists":
                return [tuple(dims) for dims in value]
            if kind == "as_float_lists":
                return [[float(v) for v in floats] for floats in value]
            if kind == "as_nested_tensors":
                return [[self.nodes[a["name"]] for a in inner] for inner in value]
            if kind == "as_sym_ints":
                return [_static_int(v) for v in value]
            if kind == "as_optional_tensors":
                return [self.optional_tensor(a) for a in value]
        raise Unsupported(f"argument {kind}")

    def optional_tensor(self, arg: dict[str, Any]) -> torch.fx.Node | None:
        ((kind, value),) = arg.items()
        if kind == "as_none":
            return None
        if kind == "as_tensor":
            return self.nodes[value["name"]]
        raise Unsupported(f"optional tensor {kind}")

    def outputs(self, node: dict[str, Any], outputs: list[dict[str, Any]], fx_node: torch.fx.Node) -> None:
        """``deserialize_outputs`` for an ``OpOverload`` call."""
        if not outputs:
            return
        if len(outputs) == 1:
            ((kind, value),) = outputs[0].items()
            if kind == "as_tensor":
                self.sync(value["name"], fx_node)
                return
            if kind == "as_none":
                fx_node.meta["val"] = None
                fx_node._rename(f"{self.graph._target_to_str(fx_node.target)}_unused")
                return
            if kind != "as_tensors" or not value:
                raise Unsupported(f"node output {kind}")
        # Several values: a getitem node each, sharing one parse of the metadata.
        shared = self.metadata(node["metadata"])
        vals: list[Any] = []
        if len(outputs) == 1:
            for idx, tensor in enumerate(outputs[0]["as_tensors"]):
                self.getitem(vals, fx_node, tensor["name"], idx, shared)
        else:
            self.getitems(vals, fx_node, outputs, shared)
        fx_node.meta["val"] = tuple(vals)
        self.nodes[fx_node.name] = fx_node

    def getitem(self, vals: list[Any], fx_node: torch.fx.Node, name: str, idx: int, shared: dict[str, Any]) -> None:
        item = self.graph.create_node("call_function", operator.getitem, (fx_node, idx), name=name)
        self.sync(name, item)
        vals.append(item.meta["val"])
        item.meta.update(shared)

    def getitems(self, vals: list[Any], fx_node: torch.fx.Node, outputs: list[dict[str, Any]], shared: dict[str, Any]) -> None:
        for idx, output in enumerate(outputs):
            ((kind, value),) = output.items()
            if kind == "as_tensor":
                self.getitem(vals, fx_node, value["name"], idx, shared)
            elif kind == "as_tensors":
                listed = self.graph.create_node("call_function", operator.getitem, (fx_node, idx))
                inner: list[Any] = []
                vals.append(inner)
                for j, tensor in enumerate(value):
                    self.getitem(inner, listed, tensor["name"], j, shared)
                listed.meta.update(shared)
                listed.meta["val"] = inner
            elif kind == "as_none":
                item = self.graph.create_node("call_function", operator.getitem, (fx_node, idx), name="as_none")
                vals.append(None)
                item.meta["val"] = None
                item.meta.update(shared)
            else:
                raise Unsupported(f"node output {kind}")

    def graph_output(self, output: dict[str, Any]) -> Any:
        ((kind, value),) = output.items()
        if kind == "as_tensor":
            return self.nodes[value["name"]]
        if kind == "as_int" or kind == "as_bool":
            return value
        if kind == "as_float":
            return float(value)
        if kind == "as_none":
            return None
        raise Unsupported(f"graph output {kind}")

    def metadata(self, metadata: dict[str, str]) -> dict[str, Any]:
        """``deserialize_metadata``, with the module and source-function stacks parsed once per text."""
        ret: dict[str, Any] = {}
        if stack_trace := metadata.get("stack_trace"):
            ret["stack_trace"] = stack_trace
        if text := metadata.get("nn_module_stack"):
            items = self.module_stacks.get(text)
            if items is None:
                items = self.module_stacks[text] = tuple(_module_stack_item(item) for item in text.split(";"))
            ret["nn_module_stack"] = dict(items)
        if text := metadata.get("source_fn_stack"):
            sources = self.source_fns.get(text)
            if sources is None:
                sources = self.source_fns[text] = tuple(self.source_fn(item) for item in text.split(";"))
            ret["source_fn_stack"] = list(sources)
        if text := metadata.get("torch_fn"):
            ret["torch_fn"] = tuple(text.split(";"))
        if text := metadata.get("custom"):
            import json

            ret["custom"] = json.loads(text)
        if text := metadata.get("from_node"):
            import json

            ret["from_node"] = self.owner._deserialize_from_node(json.loads(text))
        return ret

    def source_fn(self, item: str) -> tuple[str, Any]:
        """One ``name,target`` entry, the target resolved as ``deserialize_meta_func`` does."""
        name, target_text = item.split(",")
        if target_text.startswith("torch.nn"):
            target: Any = torch.nn
            path = target_text.split(".")[2:]
        elif target_text.startswith("torch"):
            target = torch
            path = target_text.split(".")[1:]
        else:
            return name, self.owner.deserialize_operator(target_text)
        for part in path:
            if not hasattr(target, part):
                return name, target_text
            target = getattr(target, part)
        return name, target


def _static_int(value: dict[str, Any]) -> int:
    """A ``SymInt`` union that holds a plain int."""
    ((kind, number),) = value.items()
    if kind != "as_int" or type(number) is not int:
        raise Unsupported(f"symbolic size {kind}")
    return number


def _module_stack_item(item: str) -> tuple[str, tuple[str, str]]:
    """``key,path,type`` split at top-level commas, as torch's ``metadata_split``."""
    out = []
    start, depth = 0, 0
    for end, c in enumerate(item):
        if c in "[(":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(item[start:end])
            start = end + 1
    out.append(item[start:])
    if len(out) != 3:
        raise Unsupported("nn_module_stack entry without three parts")
    return out[0], (out[1], out[2])


_SCHEMA_ARGS: dict[Any, tuple[tuple[str, bool, bool, bool], ...]] = {}


def _schema_args(target: Any) -> tuple[tuple[str, bool, bool, bool], ...]:
    """Per schema argument: name, positional when unrecorded, a Python keyword, keyword-only."""
    found = _SCHEMA_ARGS.get(target)
    if found is None:
        found = _SCHEMA_ARGS[target] = tuple(
            (a.name, not a.has_default_value() and not a.kwarg_only, keyword.iskeyword(a.name), a.kwarg_only)
            for a in target._schema.arguments
        )
    return found


def _single_tensor_return(target: Any) -> bool:
    returns = target._schema.returns
    return len(returns) == 1 and isinstance(returns[0].real_type, torch.TensorType)


def _deserializer_class() -> list[Any]:
    from torch._export.serde import serialize as serde

    return [serde.GraphModuleDeserializer]


def _deserialize_graph(self: Any, serialized_graph: Any) -> torch.fx.Graph:
    if isinstance(serialized_graph, RawGraph):
        return GraphBuilder(self).build(serialized_graph)
    return raw_graphs.originals[_deserializer_class()[0]](self, serialized_graph)


# While active, torch's deserializer builds a RawGraph with GraphBuilder (other graphs as before).
raw_graphs = AttributePatch(_deserializer_class, "deserialize_graph", _deserialize_graph)
