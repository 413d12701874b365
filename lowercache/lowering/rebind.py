"""Rebind: a weights-only change serves the edge program from its structure (issue 54; docs/rebind.md).

A retrained checkpoint keeps the model's structure and moves every value:
weights, and through calibration every scale and zero point. The start of
``to_edge_transform_and_lower``, ExecuTorch's
``_gen_edge_manager_for_partitioners`` (three ``run_decompositions`` calls,
then the edge dialect's passes, each a retrace of the whole graph), only
carries those values: its constants are the quantized program's tensors, its
quantize/dequantize literals the quantized program's, in order (the value
census, ``benchmarks/census_values.py``). With the opt-in ``rebind`` speed-up
that call is a cached step of kind ``edge``:

- key (``edge_parts``): the quantized program with every per-tensor
  quantize/dequantize scale and zero point left out and its tensors as layout
  only, its signature, the partitioner, the edge compile config, the toolchain;
- value (``make_template``): the edge program's graph in ``regionstore``'s form,
  its signature, its graph's name table and codegen, which quantized-program
  tensor each constant is, and the operators kept from decomposition. It is
  made only when, filled with the base program's own values, it rebuilds the
  edge program stock made, node for node; otherwise the entry is a note saying
  why, and later lowerings run stock;
- hit (``fill``): the stored graph with the quantized program's literals in
  order and its tensors by name, and the edge program and its manager made by
  ExecuTorch's own constructors, as stock makes them.

What is not filled is the base run's provenance (``from_node``), which no
output byte reads and every key leaves out.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any, Callable

import torch

from .replay import regionstore
from . import reexport
from .stored.programstore import FormatError, tensor_record
from ..cache.hashing import Unhashable, canon, digest_json, node_form, signature_digest
from ..cache.steps import Session, current_session
from ..cache.store import Entry
from . import arithmetic
from ..speedups.patching import Patch

log = logging.getLogger("lowercache")

VERSION = "edge-template:v2"
KIND = "edge"

# Provenance, which no pass or serializer of the Arm backend or of ExecuTorch's edge and emit stages reads, and
# every key leaves out: a node's history (graph ids) and the source functions it was traced from (which may name
# nodes of graphs long gone). A template does not store it, and a rebuilt program is not compared on it.
_PROVENANCE = frozenset({"from_node", "source_fn_stack", "fwd_source_fn_stack"})
# Metadata a template stores apart from the rest: export's descriptors.
_APART = _PROVENANCE | {"desc"}
_NOT_COMPARED = _PROVENANCE
_METHOD = "forward"


def _filled(node: torch.fx.Node) -> bool:
    """A per-tensor quantize/dequantize node, in the ATen or the edge dialect."""
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    target = node.target._op if isinstance(node.target, EdgeOpOverload) else node.target  # an edge operator wraps its ATen one
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        f"{target.namespace}::{target._opname}.{target._overloadname}" in reexport.FILLED_OPS)


def _pairs(gm: torch.fx.GraphModule) -> list[tuple[float, int]]:
    """The scale and zero point of every filled node in order; Unhashable unless each is a plain float and int."""
    return [reexport.literals(n) for n in gm.graph.nodes if _filled(n)]


def _tensors(program: Any) -> list[list[Any]]:
    """Every held tensor's group, name and layout (not its bytes); Unhashable for anything but a plain CPU tensor."""
    out = []
    for group, items in (("state_dict", program.state_dict), ("constants", program.constants)):
        for name, value in items.items():
            try:
                out.append([group, name, tensor_record(value)])
            except FormatError as err:
                raise Unhashable(str(err)) from None
    return out


def edge_parts(program: Any, partitioners: list[Any], config: Any) -> dict[str, str] | None:
    """Key parts of the ``edge`` step: everything the call reads but the values; None when it cannot be keyed."""
    try:
        nodes = []
        for node in program.graph.nodes:
            form = node_form(node)
            if _filled(node):
                reexport.literals(node)
                form[3] = canon((node.args[0], "<filled>", "<filled>", *node.args[3:]))
            nodes.append(form)
        gm = program.graph_module
        parts = {
            "graph": digest_json(nodes),
            "signature": signature_digest(program.graph_signature),
            "tensors": digest_json(_tensors(program)),
            "program": digest_json([canon(program.module_call_graph), canon(program.range_constraints),
                                    canon(program.example_inputs), canon(gm.meta), str(getattr(gm.graph._codegen, "pytree_info", None))]),
            "partitioner": digest_json([_partitioner_form(p) for p in partitioners]),
            "config": digest_json(canon(config)),
        }
    except (Unhashable, AttributeError):
        return None
    parts["step"] = VERSION
    parts.update(arithmetic.step_parts())
    return parts


def _partitioner_form(partitioner: Any) -> list[Any]:
    """A partitioner by class and configuration (TOSA specifications, which hold version objects, by name)."""
    from executorch.backends.arm.tosa.specification import TosaSpecification

    def state(value: Any, depth: int = 0) -> Any:
        if isinstance(value, TosaSpecification):
            return ["tosa_spec", str(value)]
        try:
            return canon(value)
        except Unhashable:
            if depth > 3 or not hasattr(value, "__dict__") or type(value).__module__.split(".")[0] != "executorch":
                raise
            return [type(value).__qualname__, {k: state(v, depth + 1) for k, v in sorted(vars(value).items())}]

    return [type(partitioner).__module__, type(partitioner).__qualname__, state(partitioner)]


# --- the stored form ---------------------------------------------------------


def _desc_form(desc: Any) -> list[Any]:
    """A placeholder's export descriptor (``BufferAOTInput(target=...)`` and kin) as its class name and plain fields."""
    from torch._functorch._aot_autograd import descriptors

    cls = type(desc)
    if getattr(descriptors, cls.__name__, None) is not cls or not dataclasses.is_dataclass(desc):
        raise FormatError(f"descriptor {cls.__qualname__}")
    fields = {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc)}
    if not all(v is None or type(v) in (str, int, bool) for v in fields.values()):
        raise FormatError(f"descriptor {cls.__qualname__} with non-plain fields")
    return [cls.__name__, fields]


def _desc(form: Any) -> Any:
    from torch._functorch._aot_autograd import descriptors

    if not (isinstance(form, list) and len(form) == 2 and isinstance(form[0], str) and isinstance(form[1], dict)):
        raise FormatError("bad stored descriptor")
    cls = getattr(descriptors, form[0], None) if form[0].isidentifier() else None
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls) or cls.__module__ != descriptors.__name__:
        raise FormatError(f"unknown descriptor {form[0]!r}")
    if set(form[1]) != {f.name for f in dataclasses.fields(cls)} or not all(v is None or type(v) in (str, int, bool) for v in form[1].values()):
        raise FormatError(f"bad fields for {form[0]}")
    return cls(**form[1])


def _stored_position(meta: dict[str, Any], key: str) -> int:
    """Where ``key`` sits among the metadata keys a template stores with the node."""
    return [k for k in meta if k not in _PROVENANCE].index(key)


def _treespec(spec: Any) -> Any:
    from torch.utils._pytree import treespec_dumps

    return None if spec is None else treespec_dumps(spec)


def _codegen_form(graph: torch.fx.Graph) -> Any:
    codegen = graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if type(codegen) is torch.fx.graph.CodeGen:
        return None
    if type(codegen) is not torch.fx.graph._PyTreeCodeGen or info is None:
        raise FormatError(f"codegen {type(codegen).__qualname__}")
    if not all(isinstance(a, str) for a in info.orig_args):
        raise FormatError("codegen arguments")
    return {"orig_args": list(info.orig_args), "in_spec": _treespec(info.in_spec), "out_spec": _treespec(info.out_spec)}


def _codegen(form: Any) -> Any:
    from torch.utils._pytree import treespec_loads

    if form is None:
        return torch.fx.graph.CodeGen()
    if not (isinstance(form, dict) and set(form) == {"orig_args", "in_spec", "out_spec"}
            and isinstance(form["orig_args"], list) and all(isinstance(a, str) for a in form["orig_args"])):
        raise FormatError("bad stored codegen")
    specs = []
    for key in ("in_spec", "out_spec"):
        if form[key] is not None and not isinstance(form[key], str):
            raise FormatError("bad stored tree spec")
        specs.append(None if form[key] is None else treespec_loads(form[key]))
    return torch.fx.graph._PyTreeCodeGen(torch.fx.graph._PyTreeInfo(list(form["orig_args"]), *specs))


def _verifier_form(program: Any) -> dict[str, Any]:
    """What the edge program's verifier was made with (ExecuTorch makes a class per program)."""
    verifiers = program.verifiers
    if len(verifiers) != 1:
        raise FormatError("verifiers")
    instance = verifiers[0]()
    if type(instance).__qualname__ != "EXIREdgeDialectVerifier.<locals>._EXIREdgeDialectVerifier":
        raise FormatError(f"verifier {type(instance).__qualname__}")
    return {
        "enable": instance.enable,
        "use_dim_order": instance.use_dim_order,
        "exceptions": sorted(regionstore.encode_target(op) for op in instance._core_aten_ops_exception_list),
        "preserve": sorted(regionstore.encode_target(op) for op in instance._preserve_ops),
    }


def _ops(forms: Any) -> list[Any]:
    if not isinstance(forms, list):
        raise FormatError("bad stored operator list")
    return [regionstore.decode_target(f) for f in forms]


def _encode(edge: Any, program: Any, preserved: list[Any]) -> Entry:
    """The template of ``edge`` (made from ``program``); FormatError when it cannot be one."""
    gm = edge.graph_module
    if dict(gm.named_children()) or list(gm.named_parameters()) or list(gm.named_buffers()) or gm.meta:
        raise FormatError("the edge graph module holds state")
    graph = gm.graph
    nodes = list(graph.nodes)
    sources = {id(t): [group, name] for group, items in (("state_dict", program.state_dict), ("constants", program.constants))
               for name, t in items.items()}
    constants = []
    for group, items in (("state_dict", edge.state_dict), ("constants", edge.constants)):
        for name, t in items.items():
            if id(t) not in sources:
                raise FormatError(f"constant {name} is not carried: to_edge made it")
            constants.append([group, name, *sources[id(t)], tensor_record(t)])
    if any("desc" in n.meta and n.op != "placeholder" for n in nodes):
        raise FormatError("a descriptor outside the placeholders")
    namespace = graph._graph_namespace
    doc = {
        "nodes": regionstore.encode_nodes(graph, _APART),
        "descs": [[i, _stored_position(n.meta, "desc"), _desc_form(n.meta["desc"])] for i, n in enumerate(nodes) if "desc" in n.meta],
        "inputs": regionstore.encode_signature(edge.graph_signature),
        "codegen": _codegen_form(graph),
        "names": {"used": sorted(namespace._used_names), "base_count": sorted(namespace._base_count.items())},
        "preserved": sorted(regionstore.encode_target(op) for op in preserved),
        "verifier": _verifier_form(edge),
    }
    meta = {"format": VERSION, "constants": constants, "literals": _sources(edge, program)}
    return Entry(meta=meta, blobs={"program.json": json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()})


def _sources(edge: Any, program: Any) -> list[int]:
    """For each filled node of ``edge``, in order, which filled node of ``program`` its literals are.

    By identity: to_edge hands a node's arguments on as they are, so a carried scale is the very float object of
    the quantized program's node (nodes that share one, a quantize and its dequantize, share it by construction).
    A literal that is no such object was not carried: FormatError.
    """
    theirs = [n for n in program.graph.nodes if _filled(n)]
    by_identity: dict[int, int] = {}
    for k, node in enumerate(theirs):
        reexport.literals(node)
        by_identity.setdefault(id(node.args[1]), k)
    sources = []
    for node in edge.graph_module.graph.nodes:
        if not _filled(node):
            continue
        k = by_identity.get(id(node.args[1]))
        if k is None or reexport.literals(node) != reexport.literals(theirs[k]):
            raise FormatError(f"{node.name}: its scale and zero point are not carried from the quantized program")
        sources.append(k)
    return sources


def fill(template: Entry, program: Any, config: Any) -> tuple[Any, list[Any]]:
    """The edge program from ``template`` with ``program``'s values, and the operators kept from decomposition.

    FormatError when the template does not fit ``program`` (or is a note that no template could be made).
    """
    from executorch.exir.verification.verifier import EXIREdgeDialectVerifier

    if template.meta.get("format") != VERSION:
        raise FormatError(template.meta.get("reason", "not an edge template"))
    try:
        doc = json.loads(template.blobs["program.json"])
    except (KeyError, ValueError) as err:
        raise FormatError(f"edge template JSON: {err}") from None
    if not isinstance(doc, dict):
        raise FormatError("bad edge template")
    graph = regionstore.decode_nodes(doc.get("nodes"), regionstore.fake_mode(program))
    nodes = list(graph.nodes)
    pairs = _pairs(program.graph_module)
    filled = [n for n in nodes if _filled(n)]
    sources = _list(template.meta.get("literals"))
    if len(filled) != len(sources) or not all(type(k) is int and 0 <= k < len(pairs) for k in sources):
        raise FormatError("the template's quantize nodes do not match the program")
    for node, k in zip(filled, sources):
        scale, zero_point = pairs[k]
        node.args = (node.args[0], scale, zero_point, *node.args[3:])
    for item in _list(doc.get("descs")):
        if not (isinstance(item, list) and len(item) == 3 and type(item[1]) is int):
            raise FormatError("bad stored descriptor")
        node = nodes[_index(item[0], nodes)]
        items = list(node.meta.items())
        items.insert(item[1], ("desc", _desc(item[2])))  # where stock has it: key order is kept
        node.meta = dict(items)
    names = doc.get("names")
    if not (isinstance(names, dict) and isinstance(names.get("used"), list) and isinstance(names.get("base_count"), list)):
        raise FormatError("bad stored name table")
    graph._graph_namespace._used_names = {str(n) for n in names["used"]}
    graph._graph_namespace._base_count = {str(k): int(v) for k, v in names["base_count"]}
    graph._codegen = _codegen(doc.get("codegen"))
    groups: dict[str, dict[str, torch.Tensor]] = {"state_dict": {}, "constants": {}}
    for item in _list(template.meta.get("constants")):
        if not (isinstance(item, list) and len(item) == 5 and item[0] in groups and item[2] in groups):
            raise FormatError("bad stored constant")
        group, name, source_group, source, record = item
        held = getattr(program, source_group).get(source)
        if not isinstance(held, torch.Tensor) or tensor_record(held) != record:
            raise FormatError(f"tensor {source} does not match the template")
        groups[group][name] = held
    signature = regionstore.decode_signature(doc.get("inputs"), graph)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    verifier = doc.get("verifier")
    preserved = _ops(doc.get("preserved"))
    if not isinstance(verifier, dict):
        raise FormatError("bad stored verifier")
    edge = _checked_program(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=groups["state_dict"],
        range_constraints=program.range_constraints,
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=groups["constants"],
        verifiers=[EXIREdgeDialectVerifier(edge_compile_config=config, class_only=True, preserve_ops=_ops(verifier.get("preserve")))],
    )
    return edge, preserved


def _checked_program(root: Any, graph: torch.fx.Graph, graph_signature: Any, state_dict: dict[str, Any], range_constraints: Any,
                     module_call_graph: Any, example_inputs: Any, constants: dict[str, Any], verifiers: list[Any]) -> Any:
    """``ExportedProgram(...)``, made as its constructor makes it but for its last step, ``validate()``.

    The verifiers only check (the signature against the graph, the operators allowed, each operator's dtypes and
    its tensors' contiguity: all structure), and this program's structure is the one the template was checked
    against, which stock's edge program passed; the check would pass again, and it costs as much as the rest of
    the hit together. The constructor is pinned by ``rebind``'s source digest (speedups/registry.py).
    """
    from torch.export import exported_program as ep

    program = ep.ExportedProgram.__new__(ep.ExportedProgram)
    graph._codegen = torch.fx.graph.CodeGen()
    program._graph_module = ep._create_graph_module_for_export(root, graph)
    if isinstance(root, torch.fx.GraphModule):
        program._graph_module.meta.update(root.meta)
    ep._common_getitem_elimination_pass(program._graph_module, graph_signature, module_call_graph)
    program._graph_signature = graph_signature
    program._state_dict = state_dict
    program._range_constraints = range_constraints
    program._module_call_graph = module_call_graph
    program._example_inputs = example_inputs
    program._constants = constants or {}
    program._verifiers = verifiers
    program._guards_code = ep._convert_guards_to_code(program._graph_module)
    return program


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise FormatError("bad stored list")
    return value


def _index(value: Any, nodes: list[torch.fx.Node]) -> int:
    if type(value) is not int or not 0 <= value < len(nodes):
        raise FormatError("bad stored node index")
    return value


# --- the check at the miss ---------------------------------------------------


def _meta_form(meta: dict[str, Any]) -> Any:
    """A node's metadata in its key order (a consumer may walk it in order), provenance left out."""
    return [[k, canon(v)] for k, v in meta.items() if k not in _NOT_COMPARED]


def _program_form(edge: Any) -> list[Any]:
    """Everything of an edge program the rest of the lowering reads, for comparing a rebuilt one with stock's."""
    from torch.utils._pytree import treespec_dumps

    graph = edge.graph_module.graph
    nodes = [[n.op, n.name, n.target if n.op == "placeholder" else regionstore.encode_target(n.target) if n.op == "call_function" else "output",
              canon(n.args), canon(n.kwargs), _meta_form(n.meta), repr(n.type)] for n in graph.nodes]
    info = getattr(graph._codegen, "pytree_info", None)
    namespace = graph._graph_namespace
    return [
        nodes,
        [type(graph._codegen).__qualname__, None if info is None else [list(info.orig_args), treespec_dumps(info.in_spec) if info.in_spec else None,
                                                                       treespec_dumps(info.out_spec) if info.out_spec else None]],
        [sorted(namespace._used_names), sorted(namespace._base_count.items())],
        [[s.kind.name, s.arg.name, s.target, s.persistent] for s in edge.graph_signature.input_specs],
        [[s.kind.name, s.arg.name, s.target] for s in edge.graph_signature.output_specs],
        [[name, id(t)] for name, t in edge.state_dict.items()],
        [[name, id(t)] for name, t in edge.constants.items()],
        canon(edge.module_call_graph), canon(edge.range_constraints), id(edge.example_inputs),
        _verifier_form(edge), edge.dialect, canon(edge.graph_module.meta), sorted(vars(edge)),
    ]


def make_template(edge: Any, program: Any, config: Any, preserved: list[Any]) -> Entry:
    """The template of the edge program stock made from ``program``, checked to rebuild it; else a note why not."""
    try:
        template = _encode(edge, program, preserved)
        rebuilt, kept = fill(template, program, config)
        if _program_form(rebuilt) != _program_form(edge):
            raise FormatError("the template does not rebuild stock's edge program")
        if {str(op) for op in kept} != {str(op) for op in preserved}:
            raise FormatError("the kept operators differ")
    except (FormatError, Unhashable) as err:
        return Entry(meta={"reason": str(err)})
    return template


# --- the step ----------------------------------------------------------------


def _served(session: Session, parts: dict[str, str], original: Callable[..., Any], partitioner: dict[str, list[Any]],
            aten_programs: dict[str, Any], config: Any, constant_methods: Any, generate_etrecord: bool) -> Any:
    from executorch.exir.program._program import EdgeProgramManager

    program = aten_programs[_METHOD]
    made: list[Any] = []

    def compute() -> Entry:
        config_before = copy.copy(config)  # as the edge program's verifier was made with it: before the call adds its exceptions
        manager = original(partitioner, aten_programs, config, constant_methods, generate_etrecord)
        made.append(manager)
        edge = manager.exported_program(_METHOD)
        return make_template(edge, program, config_before, list(edge.verifiers[0]()._preserve_ops))

    entry = session.run(KIND, "edge program", parts, compute)
    record = session.records[-1]
    if made:
        reason = entry.meta.get("reason")
        record.note = f"not served next time: {reason}" if reason else "template recorded"
        return made[0]
    if entry.meta.get("format") != VERSION:  # the structure has no template, only the note why: stock runs
        record.outcome = "bypass"
        record.note = f"not served: {entry.meta.get('reason', 'not an edge template')}"
        compute()
        return made[0]
    exceptions = config._core_aten_ops_exception_list
    try:
        edge, preserved = fill(entry, program, config)
        config._core_aten_ops_exception_list = list(set(exceptions) | set(preserved))  # as stock's call does
        manager = EdgeProgramManager({_METHOD: edge}, constant_methods, config, preserved)
    except Exception as err:  # noqa: BLE001 - a template that does not serve is a stock run, never a failed lowering
        config._core_aten_ops_exception_list = exceptions
        log.warning("cached edge template unusable (%s); running to_edge", err)
        record.note = f"not served: {err}"
        session.replace(KIND, parts, compute())
        return made[0]
    record.note = f"re-bound {len(entry.meta['literals'])} literal pairs and {len(entry.meta['constants'])} tensors"
    return manager


def _gen_edge(partitioner: Any, aten_programs: Any, config: Any, constant_methods: Any = None, generate_etrecord: Any = False) -> Any:
    """``_gen_edge_manager_for_partitioners`` through the ``edge`` step, for one method lowered for one partitioner."""
    original = _gen_edge.__wrapped__  # type: ignore[attr-defined]
    session = current_session()
    parts = None
    if (session is not None and not generate_etrecord and not constant_methods and isinstance(aten_programs, dict)
            and list(aten_programs) == [_METHOD] and isinstance(partitioner, dict) and len(partitioner.get(_METHOD, [])) == 1
            and not config.preserve_ops and not config._core_aten_ops_exception_list):
        parts = edge_parts(aten_programs[_METHOD], partitioner[_METHOD], config)
    if parts is None:
        return original(partitioner, aten_programs, config, constant_methods, generate_etrecord)
    return _served(session, parts, original, partitioner, aten_programs, config, constant_methods, generate_etrecord)


def _owner() -> Any:
    import executorch.exir.program._program as program_module

    return program_module


_NAME = "_gen_edge_manager_for_partitioners"


def _apply() -> None:
    owner = _owner()
    _gen_edge.__wrapped__ = getattr(owner, _NAME)  # type: ignore[attr-defined]  # what it wraps, as functools.wraps names it
    setattr(owner, _NAME, _gen_edge)


def _undo() -> None:
    setattr(_owner(), _NAME, _gen_edge.__wrapped__)  # type: ignore[attr-defined]
    del _gen_edge.__wrapped__  # type: ignore[attr-defined]


_patch = Patch(_apply, _undo)
enable = _patch.enable  # while a lowering runs, when the registry has ``rebind`` on
disable = _patch.disable
active = _patch.active
