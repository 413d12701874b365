"""Regions: the graph cut into the blocks a user recognises, each with a content key.

A lowered model is edited a block at a time, so the unit of reuse across runs
is a block: the module path in each node's ``nn_module_stack``, cut at a
chosen depth (``block2``, ``stages.1.2``, ``mlp``). Every operator node
belongs to exactly one region; nodes a pass made without a module stack
take the region of their nearest producer (else consumer); nodes outside
any module form the region ``(top)``. Placeholders and the output are the
graph's boundary, not region nodes: a region's constants are a part of its
key, its other inputs are boundary tensors.

A region's key is built from named parts, so an edit can be explained:

- ``nodes``: its nodes in a position-independent form: operator, arguments
  with references as "the k-th node of this region", "the j-th tensor from
  outside" or "the i-th constant (dtype, shape)", and the metadata that
  reaches the bytes. No node names: they are numbered over the whole graph.
- ``constants``: the bytes of the constants it reads, in first-use order;
- ``boundary``: the tensors crossing its boundary, in and out: shape, dtype,
  strides and dim order, quantization parameters;
- the toolchain identity (``cache/toolchain.py``).

The same form, with names kept aside, is what the pass census
(``benchmarks/pass_census.py``) compares to decide whether a pass acts within a region.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Iterable

import torch

from ...cache.digests import digest_json
from ...cache.hashing import IGNORED_META, Unhashable, canon, op_name, tensor_digest, without_process_marks
from ...cache.toolchain import toolchain_parts

TOP = "(top)"

# Metadata that is bookkeeping, never output bytes (beyond hashing's own list).
_BOOKKEEPING_META = IGNORED_META | {"debug_handle", "delegation_tag"}

# Metadata a pass may change in place (nested dicts); copied deeply when a region is extracted.
_NESTED_META = ("input_qparams", "output_qparams", "custom")


@dataclasses.dataclass(frozen=True)
class Ref:
    """A reference in a position-independent node form: ``kind`` is local, outside or constant."""

    kind: str
    index: int


@dataclasses.dataclass
class RegionForm:
    """One region's nodes in position-independent form, with the names kept aside."""

    nodes: list[Any]
    constants: list[str]
    boundary: dict[str, list[Any]]
    names: list[str]
    constant_names: list[str]
    inputs: list[str] = dataclasses.field(default_factory=list)  # names of the tensors from outside, in order

    def parts(self) -> dict[str, str]:
        """The named key parts of the region's content (without the toolchain)."""
        return {
            "nodes": digest_json(self.nodes),
            "constants": digest_json(self.constants),
            "boundary": digest_json(self.boundary),
        }


@dataclasses.dataclass(frozen=True)
class Region:
    """A region of one graph: its name (module path) and its operator nodes' names in graph order."""

    name: str
    nodes: tuple[str, ...]


def _paths(node: torch.fx.Node) -> list[str] | None:
    """The module paths on ``node``'s stack, outermost first (``[]`` at the top level); None without a stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return [path for path, _cls in stack.values() if path]


def module_path(node: torch.fx.Node, depth: int, leaves: frozenset[str] = frozenset()) -> str | None:
    """The module path of ``node`` cut at ``depth`` (``(top)`` outside any module); None without a stack.

    A layer in ``leaves`` (a module with no submodules, a conv or a ReLU) at
    that depth joins its parent, unless the parent is the model itself: a
    region is a block, and a fused conv-BN-ReLU is never cut apart.
    """
    paths = _paths(node)
    if paths is None:
        return None
    if not paths:
        return TOP
    index = min(depth, len(paths)) - 1
    if index > 0 and paths[index] in leaves:
        index -= 1
    return paths[index]


def leaf_modules(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The module paths of ``gm``'s stacks that have no submodule on any stack."""
    seen = {p for n in gm.graph.nodes for p in (_paths(n) or ())}
    parents = {p.rsplit(".", 1)[0] for p in seen if "." in p}
    return frozenset(seen - parents)


def is_region_node(node: torch.fx.Node) -> bool:
    """Operator and attribute nodes belong to regions; placeholders and the output are the boundary."""
    return node.op not in ("placeholder", "output")


def _qdq(node: torch.fx.Node) -> str | None:
    """``quantize`` or ``dequantize`` for a quantize/dequantize node, else None."""
    name = op_name(node.target)
    for kind in ("dequantize", "quantize"):
        if f"::{kind}_per" in name:
            return kind
    return None


def membership(gm: torch.fx.GraphModule, depth: int = 1) -> dict[torch.fx.Node, str]:
    """The region of every operator node of ``gm``.

    A node without a module path of its own takes a neighbour's region: a
    node a pass built without copying a module stack, and the quantize and
    dequantize nodes the quantizer inserts (their stack is the root's). A
    quantize node goes with its producer (it quantizes that block's output);
    any other node with its consumer (a dequantize of a weight or an
    activation feeds it, a decomposition's first node was made for it);
    failing that, the other side; failing both, ``(top)``. Deterministic.
    """
    members: dict[torch.fx.Node, str] = {}
    unplaced = []
    leaves = leaf_modules(gm)
    for node in gm.graph.nodes:
        if not is_region_node(node):
            continue
        path = module_path(node, depth, leaves)
        if path is None or (path == TOP and _qdq(node)):
            unplaced.append(node)
        else:
            members[node] = path

    def producer(node: torch.fx.Node) -> str | None:
        return next((members[a] for a in node.all_input_nodes if a in members), None)

    def consumer(node: torch.fx.Node) -> str | None:
        return next((members[u] for u in node.users if u in members), None)

    for node in unplaced:
        if _qdq(node) == "quantize" and producer(node) is not None:
            members[node] = producer(node)
    for node in reversed(unplaced):
        if node not in members and consumer(node) is not None:
            members[node] = consumer(node)
    for node in unplaced:
        if node not in members:
            members[node] = producer(node) or TOP
    return {n: members[n] for n in gm.graph.nodes if n in members}


def cut(gm: torch.fx.GraphModule, depth: int = 1) -> list[Region]:
    """The regions of ``gm`` in order of their first node; each operator node is in exactly one."""
    by_region: dict[str, list[str]] = {}
    for node, region in membership(gm, depth).items():
        by_region.setdefault(region, []).append(node.name)
    return [Region(name, tuple(nodes)) for name, nodes in by_region.items()]


def _constants(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Placeholder name -> value, for every lifted parameter, buffer and constant."""
    values: dict[str, Any] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.target is None:
            continue
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
        if isinstance(value, torch.Tensor):
            values[spec.arg.name] = value
    return values


def _safe_canon(value: Any) -> Any:
    try:
        return canon(value)
    except Unhashable:  # e.g. a serializer's enum in the metadata: its repr names it, unless it holds an address
        text = repr(value)
        return ["repr", type(value).__qualname__, None if " at 0x" in text else text]


def _meta_form(node: torch.fx.Node) -> dict[str, Any]:
    return {k: _safe_canon(without_process_marks(v) if k == "custom" else v) for k, v in sorted(node.meta.items()) if k not in _BOOKKEEPING_META}


def tensor_facts(node: torch.fx.Node) -> list[Any]:
    """What a consumer can read of a tensor from across a boundary: meta, dim order, quantization."""
    val = node.meta.get("val")
    facts: list[Any] = [_safe_canon(val)]
    if isinstance(val, torch.Tensor):
        try:
            facts.append(["dim_order", list(val.dim_order())])
        except (RuntimeError, ValueError):  # ambiguous strides: the strides above still say it
            facts.append(["dim_order", None])
    for key in ("input_qparams", "output_qparams", "tosa_special_dtype"):
        if key in node.meta:
            facts.append([key, _safe_canon(node.meta[key])])
    if "quantize" in op_name(node.target):  # a q/dq node: its scale and zero point are literals
        facts.append(["qargs", _safe_canon(node.args[1:])])
    return facts


def _without_autograd(form: Any) -> Any:
    """``form`` with the ``requires_grad`` flag of every tensor's canonical metadata left out."""
    if isinstance(form, list):
        if len(form) == 6 and form[0] == "tensor" and isinstance(form[5], bool):
            return form[:5]
        return [_without_autograd(x) for x in form]
    if isinstance(form, dict):
        return {k: _without_autograd(v) for k, v in form.items()}
    return form


def region_form(
    ep: torch.export.ExportedProgram,
    nodes: Iterable[torch.fx.Node],
    constants: dict[str, torch.Tensor] | None = None,
    autograd: bool = True,
) -> RegionForm:
    """The position-independent form of ``nodes`` (one region's, in graph order) of ``ep``.

    ``autograd=False`` leaves out whether fake values require grad: no
    output byte depends on it (the census compares without it).
    """
    nodes = list(nodes)
    constants = _constants(ep) if constants is None else constants
    local = {n: i for i, n in enumerate(nodes)}
    outside: dict[torch.fx.Node, int] = {}
    used: dict[torch.fx.Node, int] = {}

    def ref(a: torch.fx.Node) -> Ref:
        if a in local:
            return Ref("local", local[a])
        if a.op == "placeholder" and a.name in constants:
            return Ref("constant", used.setdefault(a, len(used)))
        return Ref("outside", outside.setdefault(a, len(outside)))

    forms = []
    for n in nodes:
        args = torch.fx.node.map_arg(n.args, ref)
        kwargs = torch.fx.node.map_arg(n.kwargs, ref)
        forms.append([n.op, op_name(n.target), _safe_canon(args), _safe_canon(kwargs), _meta_form(n)])
    const_nodes = sorted(used, key=used.get)
    forms.append(["constants", [tensor_facts(c) for c in const_nodes]])
    exported = [n for n in nodes if any(u not in local for u in n.users)]
    boundary = {
        "in": [tensor_facts(a) for a in sorted(outside, key=outside.get)],
        "out": [[local[n], tensor_facts(n)] for n in exported],
    }
    if not autograd:
        forms, boundary = _without_autograd(forms), _without_autograd(boundary)
    return RegionForm(
        nodes=forms,
        constants=[tensor_digest(constants[c.name]) for c in const_nodes],
        boundary=boundary,
        names=[n.name for n in nodes],
        constant_names=[c.name for c in const_nodes],
        inputs=[a.name for a in sorted(outside, key=outside.get)],
    )


def whole_form(ep: torch.export.ExportedProgram) -> RegionForm:
    """The form of every operator node of ``ep``, as one region."""
    return region_form(ep, [n for n in ep.graph_module.graph.nodes if is_region_node(n)])


def region_parts(ep: torch.export.ExportedProgram, depth: int = 1) -> dict[str, dict[str, str]]:
    """Named key parts of every region of ``ep``: nodes, constants, boundary and the toolchain."""
    members = membership(ep.graph_module, depth)
    constants = _constants(ep)
    toolchain = digest_json(toolchain_parts())
    out = {}
    for region in cut(ep.graph_module, depth):
        chosen = [n for n in ep.graph_module.graph.nodes if members.get(n) == region.name]
        parts = region_form(ep, chosen, constants).parts()
        parts["toolchain"] = toolchain
        out[region.name] = parts
    return out


def region_keys(ep: torch.export.ExportedProgram, depth: int = 1) -> dict[str, str]:
    """The content key of every region of ``ep``."""
    return {name: digest_json(parts) for name, parts in region_parts(ep, depth).items()}


def copied_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """A node's metadata with the dicts a pass may change in place copied deeply."""
    return {k: copy.deepcopy(v) if k in _NESTED_META else v for k, v in meta.items()}


def extract(ep: torch.export.ExportedProgram, members: dict[torch.fx.Node, str], region: str) -> torch.export.ExportedProgram:
    """``region`` of ``ep`` as a standalone program.

    Its inputs are the constants it reads (same names, kinds and values) and
    one user input per tensor from outside, a placeholder carrying the
    producer's name and metadata; its outputs are its tensors used outside.
    Node names and metadata are those of ``ep``, so a pass sees the region
    as it sees it inside the whole graph, but for what lies beyond the boundary.
    """
    from torch.export.graph_signature import (
        ExportGraphSignature,
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    if any(spec.kind != OutputKind.USER_OUTPUT for spec in ep.graph_signature.output_specs):
        raise ValueError("programs that mutate buffers or return gradients are not cut into regions")
    gm = ep.graph_module
    nodes, constant_inputs, user_inputs, specs = _inputs(ep, members, region)
    inside = set(nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    input_specs = []
    for a in constant_inputs + user_inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = copied_meta(a.meta)
        spec = specs.get(a.name) if a in constant_inputs else None
        input_specs.append(spec or InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(name=env[a].name), target=None))
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = copied_meta(n.meta)
    outputs = [env[n] for n in nodes if any(u not in inside for u in n.users)]
    graph.output(tuple(outputs))
    signature = ExportGraphSignature(
        input_specs=input_specs,
        output_specs=[OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=o.name), target=None) for o in outputs],
    )
    targets = {specs[p.name].target for p in constant_inputs}
    # A shallow copy with its graph replaced, as ExecuTorch's pass manager makes them: no
    # verification, which a graph halfway through the Arm pipeline would not pass.
    program = copy.copy(ep)
    program._graph_module = torch.fx.GraphModule(gm, graph)
    program._graph_signature = signature
    program._state_dict = {k: v for k, v in ep.state_dict.items() if k in targets}
    program._constants = {k: v for k, v in ep.constants.items() if k in targets}
    return program


def _inputs(ep: torch.export.ExportedProgram, members: dict[torch.fx.Node, str], region: str) -> tuple[
        list[torch.fx.Node], list[torch.fx.Node], list[torch.fx.Node], dict[str, Any]]:
    """``region``'s nodes, the constants it reads (in graph order), the other tensors it reads (in first-use order), and
    ``ep``'s input specs by name."""
    from torch.export.graph_signature import InputKind

    gm = ep.graph_module
    nodes = [n for n in gm.graph.nodes if members.get(n) == region]
    inside = set(nodes)
    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs if hasattr(spec.arg, "name")}
    inputs: dict[torch.fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a, None)
    constant_inputs = [p for p in gm.graph.nodes if p in inputs and p.op == "placeholder" and specs[p.name].kind != InputKind.USER_INPUT]
    user_inputs = [a for a in inputs if a not in constant_inputs]
    return nodes, constant_inputs, user_inputs, specs


def user_input_names(ep: torch.export.ExportedProgram, members: dict[torch.fx.Node, str], region: str) -> list[str]:
    """The names of the user inputs ``extract`` would give ``region``'s program, in its order, without building it.

    The placeholders are made in a scratch graph in ``extract``'s order, so a
    name FX would change (one that shadows a builtin) is changed alike.
    """
    _nodes, constant_inputs, user_inputs, _specs = _inputs(ep, members, region)
    graph = torch.fx.Graph()
    for a in constant_inputs:
        graph.placeholder(a.name)
    return [graph.placeholder(a.name).name for a in user_inputs]


def input_facts(program: torch.export.ExportedProgram) -> list[list[Any]]:
    """The facts of the tensors ``program`` takes from outside, in first-use order."""
    nodes = [n for n in program.graph_module.graph.nodes if is_region_node(n)]
    return region_form(program, nodes).boundary["in"]


def adopt_input_facts(program: torch.export.ExportedProgram, sources: list[torch.fx.Node]) -> None:
    """Give the k-th tensor ``program`` takes from outside (first-use order) the metadata of ``sources[k]``."""
    nodes = [n for n in program.graph_module.graph.nodes if is_region_node(n)]
    by_name = {n.name: n for n in program.graph_module.graph.nodes}
    inputs = region_form(program, nodes).inputs
    if len(inputs) != len(sources):
        raise ValueError(f"the region takes {len(inputs)} tensors from outside, not {len(sources)}")
    for name, source in zip(inputs, sources):
        by_name[name].meta = copied_meta(source.meta)


_SUFFIX = re.compile(r"(.*)_(\d+)$")


def name_relation(whole: list[str], alone: list[str]) -> str:
    """How a region's names in the whole graph relate to its names lowered alone.

    ``same``; ``offset``: each name stem is numbered from a per-stem counter
    at the region's start (the counter is the one boundary fact needed);
    ``renumbered``: the region's names interleave with other regions'.
    """
    if whole == alone:
        return "same"
    if len(whole) != len(alone):
        return "renumbered"
    offsets: dict[str, int] = {}
    for w, a in zip(whole, alone):
        (ws, wi), (as_, ai) = _split(w), _split(a)
        if ws != as_ or offsets.setdefault(ws, wi - ai) != wi - ai:
            return "renumbered"
    return "offset"


def _split(name: str) -> tuple[str, int]:
    m = _SUFFIX.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)
