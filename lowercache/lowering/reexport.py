"""The re-export that ends the quantization stage, as a step that survives weight edits.

The stage ends with ``torch.export.export(converted)``: a full trace of the
converted GraphModule, a large part of the stage, then the stored
form of its result. When only weights change, the converted
graph keeps its structure; what changes are the scale and zero point
literals of per-tensor quantize/dequantize nodes and the values of its
tensor attributes (folded weights, biases, per-channel qparams). The trace
reads neither: it records the literals as they are and the tensors by name.

So the step's key is the converted graph with those literals and tensor
values left out (``template_parts``), and its value is a *template*: the
stored form of the exported program (``programstore.encode``'s JSON) without
tensors. A hit fills the template with this converted graph's own literals
and tensors (``fill``) and gives the entry ``programstore.encode`` would have
written for a fresh export, which ``programstore.decode`` rebuilds as on any hit.

Why filling is exact: a template is only stored when the exported graph
corresponds to the converted one node for node (same operators in the same
order, arguments equal under the node mapping, every lifted tensor equal to
the converted module's attribute of the same name) and the k-th filled node
of the JSON holds the k-th literal pair of the converted graph
(``make_template``). With the key equal, the new converted graph differs
from the stored one only in what is filled, and the trace copies both
through unchanged. What is not filled is the base run's: the metadata that
two stock exports of one graph in one process already differ in
(``from_node`` graph ids; torch's ``_torchdynamo_disable`` markers in
``custom``, which depend on what the process traced before). Neither
reaches an output byte; the tests compare the rest with a fresh export.

A strict export (dynamo's, aot_arm_compiler's default) is its own key
(``strict`` part). A program carries metadata the stored form drops and a
script may read: ``tensor_meta``, ``example_value`` and ``eager_input_vals``
on nodes, and the module's ``meta`` (dynamo's entries; a non-strict export's
copies of the converted module's). A template records which nodes carry
which (``_derived_record``); a hit derives them again from the rebuilt
``val`` as the trace did, and takes the copied module entries from the
converted module (``restore``). A strict template is only
kept when the stored program, so restored, has every node's key form and the
module's ``meta`` of the fresh export; a non-strict one that cannot be
restored so is kept without the record, served as stored (``lower`` reads
none of it).
"""

from __future__ import annotations

import json
import logging
import operator
from typing import Any, Callable, Protocol, Sequence

import torch

from .stored import programstore
from ..cache.hashing import (
    IGNORED_META,
    Unhashable,
    canon,
    digest_json,
    inputs_digest,
    node_form,
    op_name,
    tensor_bytes,
)
from ..cache.steps import Session, current_session
from ..cache.store import Entry
from . import arithmetic
from ..speedups.decompositions import eager_input_vals
from ..speedups.patching import AttributePatch

log = logging.getLogger("lowercache")

REEXPORT_VERSION = "torch.export.export(converted):template:v2"

# Operators whose scale and zero point are filled in, and the names torch's
# serializer gives those arguments.
FILLED_OPS = frozenset(
    {"quantized_decomposed::quantize_per_tensor.default", "quantized_decomposed::dequantize_per_tensor.default"}
)
_FILLED_ARGS = ("scale", "zero_point")
_LIFTED_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
# pt2e's per-node annotation, read by prepare_pt2e: the trace neither reads
# nor copies it, and it is the largest part of hashing a converted graph.
_KEY_IGNORED_META = IGNORED_META | {"quantization_annotation"}


# Node metadata an export leaves that the stored form does not carry, each a
# function of rebuilt ``val``s; and ``val`` itself, which the rebuilt output
# node has and a fresh one lacks.
_DERIVED_META = ("tensor_meta", "example_value", "eager_input_vals", "val")


def is_filled(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) in FILLED_OPS


def literals(node: torch.fx.Node) -> tuple[float, int]:
    """A filled node's scale and zero point; Unhashable unless they are a plain float and int."""
    if len(node.args) < 3 or node.kwargs or type(node.args[1]) is not float or type(node.args[2]) is not int:
        raise Unhashable(f"{node.name}: scale and zero point are not literals")
    return node.args[1], node.args[2]


def graph_literals(converted: torch.fx.GraphModule) -> list[tuple[float, int]]:
    """The scale and zero point of every filled node, in graph order."""
    return [literals(n) for n in converted.graph.nodes if is_filled(n)]


def _attribute(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _attribute_form(value: Any) -> list:
    if not isinstance(value, torch.Tensor):
        raise Unhashable(f"attribute of type {type(value).__name__}")
    kind = "parameter" if isinstance(value, torch.nn.Parameter) else "tensor"
    return [kind, canon(value), list(value.stride())]


def _reads_no_values(target: Any) -> bool:
    """Whether tracing a call can only see its inputs' metadata. Constant
    attributes are real tensors while the trace runs, so an operator whose
    output depends on data (``item``, ``nonzero``) would bake a value left
    out of the key into the program; any Python callable but ``getitem`` might too."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not ({torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape} & set(target.tags))


def _plain_graph_module(module: Any) -> bool:
    """A GraphModule of torch's own class (each instance gets its own subclass for ``forward``)."""
    cls = type(module)
    own = cls.__qualname__ == "GraphModule.__new__.<locals>.GraphModuleImpl"
    return cls is torch.fx.GraphModule or (own and cls.__bases__ == (torch.fx.GraphModule,))


def template_parts(
    converted: torch.fx.GraphModule, example_inputs: Sequence[Any], strict: bool = False
) -> dict[str, str] | None:
    """Key parts of the re-export, literals and tensor values left out; None if it cannot be keyed."""
    if not _plain_graph_module(converted) or converted._forward_hooks or converted._forward_pre_hooks:
        return None
    try:
        nodes = []
        for node in converted.graph.nodes:
            form = node_form(node, _KEY_IGNORED_META)
            if is_filled(node):
                literals(node)
                form[3] = canon((node.args[0], "<filled>", "<filled>", *node.args[3:]))
            elif node.op == "get_attr":
                form.append(_attribute_form(_attribute(converted, str(node.target))))
            elif node.op == "call_function" and not _reads_no_values(node.target):
                return None
            elif node.op not in ("placeholder", "call_function", "output"):
                return None
            nodes.append(form)
        codegen = converted.graph._codegen
        module = {
            "training": converted.training,
            "modules": [[name, type(m).__qualname__] for name, m in converted.named_modules()],
            "state": [
                [name, _attribute_form(t)]
                for name, t in [*converted.named_parameters(), *converted.named_buffers()]
            ],
            "codegen": [type(codegen).__qualname__, str(getattr(codegen, "pytree_info", None))],
            "meta": canon(converted.meta),
        }
        parts = {
            "graph": digest_json(nodes),
            "module": digest_json(module),
            "example_inputs": inputs_digest([tuple(example_inputs)]),
        }
    except (Unhashable, AttributeError):
        return None
    parts["step"] = REEXPORT_VERSION
    if strict:  # only then, so that ``lower``'s non-strict key is unchanged
        parts["strict"] = "true"
    parts.update(arithmetic.step_parts())
    return parts


def _lifted(program: torch.export.ExportedProgram) -> dict[str, str]:
    """Lifted placeholder name -> the attribute it stands for."""
    return {
        spec.arg.name: spec.target
        for spec in program.graph_signature.input_specs
        if spec.kind.name in _LIFTED_KINDS
    }


def _compared(node: torch.fx.Node) -> bool:
    """Nodes compared one to one. The trace adds a ``_assert_tensor_metadata``
    before each ``to``: it reads tensor metadata only, which the key holds."""
    if node.op == "output":
        return True
    return node.op == "call_function" and node.target is not torch.ops.aten._assert_tensor_metadata.default


def _same_argument(ours: Any, theirs: Any, mapped: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    """Whether two node arguments are equal under the node mapping. Tuples and
    lists count as alike, and keyword order does not count: the trace records
    them as it likes, and an operator cannot tell. Floats must be bit for bit the same."""
    if isinstance(ours, torch.fx.Node):
        return mapped.get(ours) is theirs
    if isinstance(ours, (list, tuple)) and not hasattr(ours, "_fields"):
        return (
            isinstance(theirs, (list, tuple))
            and not hasattr(theirs, "_fields")
            and len(ours) == len(theirs)
            and all(_same_argument(a, b, mapped) for a, b in zip(ours, theirs))
        )
    if isinstance(ours, dict):
        return (
            isinstance(theirs, dict)
            and ours.keys() == theirs.keys()
            and all(_same_argument(ours[k], theirs[k], mapped) for k in ours)
        )
    if type(ours) is not type(theirs) or isinstance(ours, (torch.Tensor, torch.fx.GraphModule)):
        return False
    if type(ours) is float:
        return ours.hex() == theirs.hex() if ours == ours else theirs != theirs
    return bool(ours == theirs)


def _corresponds(converted: torch.fx.GraphModule, program: torch.export.ExportedProgram) -> bool:
    """Whether the exported graph is the converted one, node for node."""
    lifted = _lifted(program)
    by_target = {target: n for n in program.graph.nodes if (target := lifted.get(n.name)) is not None}
    theirs_inputs = [n for n in program.graph.nodes if n.op == "placeholder" and n.name not in lifted]
    ours_inputs = [n for n in converted.graph.nodes if n.op == "placeholder"]
    if len(ours_inputs) != len(theirs_inputs):
        return False
    mapped: dict[torch.fx.Node, torch.fx.Node] = dict(zip(ours_inputs, theirs_inputs))
    for node in converted.graph.nodes:
        if node.op == "get_attr":
            if str(node.target) not in by_target:
                return False
            mapped[node] = by_target[str(node.target)]
    ours = [n for n in converted.graph.nodes if _compared(n)]
    exported = [n for n in program.graph.nodes if _compared(n)]
    if len(ours) != len(exported):
        return False
    for mine, theirs in zip(ours, exported):
        if mine.op != theirs.op or mine.target is not theirs.target:
            return False
        if not _same_argument((mine.args, mine.kwargs), (theirs.args, theirs.kwargs), mapped):
            return False
        mapped[mine] = theirs
    for group in (program.state_dict, program.constants):
        for name, value in group.items():
            try:
                ours_value = _attribute(converted, name)
            except AttributeError:
                return False
            if not isinstance(ours_value, torch.Tensor):
                return False
            if ours_value is value:
                continue
            layout = (ours_value.dtype, ours_value.shape, ours_value.stride())
            if layout != (value.dtype, value.shape, value.stride()) or tensor_bytes(ours_value) != tensor_bytes(value):
                return False
    return True


def _filled_doc_nodes(doc: dict[str, Any]) -> list[dict[str, dict[str, Any]]]:
    """The JSON's filled nodes in order, as {argument name: argument} for the filled arguments."""
    filled = []
    for node in doc["graph_module"]["graph"]["nodes"]:
        target = node.get("target", "")
        namespace, _, rest = target.removeprefix("torch.ops.").partition(".")
        if f"{namespace}::{rest}" in FILLED_OPS:
            args = {a["name"]: a["arg"] for a in node["inputs"] if a.get("name") in _FILLED_ARGS}
            if set(args) != set(_FILLED_ARGS) or "as_float" not in args["scale"] or "as_int" not in args["zero_point"]:
                raise programstore.FormatError(f"filled node {target} without literal scale and zero point")
            filled.append(args)
    return filled


def _plain_json(value: Any) -> bool:
    if value is None or type(value) in (bool, int, str):
        return True
    if type(value) is list:
        return all(_plain_json(v) for v in value)
    return type(value) is dict and all(type(k) is str and _plain_json(v) for k, v in value.items())


def _derived_record(program: torch.export.ExportedProgram, converted: torch.fx.GraphModule) -> dict[str, Any]:
    """Which nodes carry which ``_DERIVED_META`` key, and the module's ``meta``; Unhashable if that cannot be stored."""
    module: dict[str, Any] = {}
    for key, value in program.graph_module.meta.items():
        if key in converted.meta and value is converted.meta[key]:
            module[key] = {"from_converted": True}  # a non-strict export copies the converted module's entries
        elif key == "dynamo_compile_id" and type(value).__name__ == "CompileId":
            module[key] = {"compile_id": [value.frame_id, value.frame_compile_id, value.compiled_autograd_id]}
        elif _plain_json(value):
            module[key] = {"value": value}
        else:
            raise Unhashable(f"module metadata {key} of type {type(value).__name__}")
    nodes = [[key for key in _DERIVED_META if key in node.meta] for node in program.graph.nodes]
    return {"nodes": nodes, "module": module}


def restore(program: torch.export.ExportedProgram, record: dict[str, Any], converted: torch.fx.GraphModule) -> None:
    """Give a rebuilt export the metadata a fresh one has (``_derived_record``); FormatError if it does not fit."""
    from torch._guards import CompileId
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    nodes = list(program.graph.nodes)
    if not isinstance(record.get("nodes"), list) or len(record["nodes"]) != len(nodes):
        raise programstore.FormatError("the template's metadata does not match the program's nodes")
    for node, keys in zip(nodes, record["nodes"]):
        if not isinstance(keys, list) or not set(keys) <= set(_DERIVED_META):
            raise programstore.FormatError("unknown metadata in the template")
        if "val" not in keys:
            node.meta.pop("val", None)
        value = node.meta.get("val")
        if ("val" in keys) != ("val" in node.meta) or ("tensor_meta" in keys and not isinstance(value, torch.Tensor)):
            raise programstore.FormatError(f"{node.name}: no value to derive metadata from")
        if "tensor_meta" in keys:
            node.meta["tensor_meta"] = _extract_tensor_metadata(value)
        if "example_value" in keys:
            node.meta["example_value"] = value
        if "eager_input_vals" in keys:
            node.meta["eager_input_vals"] = eager_input_vals(node)
    module: dict[str, Any] = {}
    for key, stored in record.get("module", {}).items():
        compile_id = stored.get("compile_id") if isinstance(stored, dict) else None
        if stored == {"from_converted": True} and key in converted.meta:
            module[key] = converted.meta[key]
        elif isinstance(compile_id, list) and len(compile_id) == 3 and all(v is None or type(v) is int for v in compile_id):
            module[key] = CompileId(
                frame_id=compile_id[0], frame_compile_id=compile_id[1], compiled_autograd_id=compile_id[2]
            )
        elif isinstance(stored, dict) and set(stored) == {"value"} and _plain_json(stored["value"]):
            module[key] = stored["value"]
        else:
            raise programstore.FormatError(f"module metadata {key} in a form the template does not write")
    program.graph_module.meta.clear()
    program.graph_module.meta.update(module)


def _key_forms(program: torch.export.ExportedProgram) -> list:
    return [node_form(node) for node in program.graph.nodes]


def _restores_exactly(
    program: torch.export.ExportedProgram, stored: Entry, record: dict[str, Any], converted: torch.fx.GraphModule
) -> bool:
    """Whether the stored program, rebuilt and restored, is the fresh export in every key form and in its module's ``meta``."""
    try:
        rebuilt = programstore.decode(stored)
        restore(rebuilt, record, converted)
        return _key_forms(rebuilt) == _key_forms(program) and canon(rebuilt.graph_module.meta) == canon(
            program.graph_module.meta
        )
    except (programstore.FormatError, Unhashable) as err:
        log.debug("re-export's metadata not restorable (%s)", err)
        return False


def _derives_exactly(program: torch.export.ExportedProgram, record: dict[str, Any]) -> bool:
    """``_restores_exactly`` for a non-strict export, at a fraction of its cost (it runs on
    every miss of ``lower``'s step): the rebuilt program's ``val``s are the fresh one's
    (what serving a non-strict program has always rested on), so deriving from the fresh program's own ``val``s must
    give its metadata. The module's ``meta`` needs no check: ``restore`` puts back each recorded entry, the copied
    ones as the converted module's own objects, which is how ``_derived_record`` found them."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    try:
        for node, keys in zip(program.graph.nodes, record["nodes"]):
            value = node.meta.get("val")
            if "tensor_meta" in keys and (
                not isinstance(value, torch.Tensor) or _extract_tensor_metadata(value) != node.meta["tensor_meta"]
            ):
                return False
            if "example_value" in keys and node.meta["example_value"] is not value:
                return False
            if "eager_input_vals" in keys and canon(eager_input_vals(node)) != canon(node.meta["eager_input_vals"]):
                return False
        return True
    except Unhashable as err:
        log.debug("re-export's metadata not derivable (%s)", err)
        return False


def make_template(
    converted: torch.fx.GraphModule, program: torch.export.ExportedProgram, stored: Entry, strict: bool = False
) -> Entry | None:
    """The template of an exported program and its stored form; None if filling it would not be exact."""
    if not _corresponds(converted, program):
        return None
    pairs = graph_literals(converted)
    doc = json.loads(stored.blobs["program.json"])
    filled = _filled_doc_nodes(doc)
    if len(filled) != len(pairs):
        return None
    for args, (scale, zero_point) in zip(filled, pairs):
        if args["scale"]["as_float"] != scale or args["zero_point"]["as_int"] != zero_point:
            return None
    # A list: stored meta is written with sorted keys, and the order is the program's.
    tensors = [
        [name, _record_only(r)] for name, r in stored.meta["tensors"].items() if not name.startswith("example_inputs/")
    ]
    meta: dict[str, Any] = {"format": REEXPORT_VERSION, "tensors": tensors, "strict": strict}
    try:
        derived = _derived_record(program, converted)
    except Unhashable:
        derived = None
    if derived is not None and (
        _restores_exactly(program, stored, derived, converted) if strict else _derives_exactly(program, derived)
    ):
        meta["derived"] = derived
    elif strict:
        return None
    return Entry(meta=meta, blobs={"program.json": stored.blobs["program.json"]})


def _record_only(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("offset", "size")}


def fill(
    template: Entry, converted: torch.fx.GraphModule, example_inputs: Sequence[Any], spec_digest: str
) -> tuple[Entry, dict[str, Any]]:
    """The stored form of ``converted``'s export, from a template, and its JSON parsed (for
    ``programstore.decode``, which would parse it again); FormatError if it does not fit."""
    if template.meta.get("format") != REEXPORT_VERSION:
        raise programstore.FormatError(template.meta.get("reason", "not a re-export template"))
    pairs = graph_literals(converted)
    doc = json.loads(template.blobs["program.json"])
    filled = _filled_doc_nodes(doc)
    if len(filled) != len(pairs):
        raise programstore.FormatError("the template's quantize nodes do not match the converted graph")
    for args, (scale, zero_point) in zip(filled, pairs):
        args["scale"]["as_float"] = scale
        args["zero_point"]["as_int"] = zero_point
    groups: dict[str, dict[str, torch.Tensor]] = {"state_dict": {}, "constants": {}}
    for blob, record in template.meta["tensors"]:
        group, _, name = blob.partition("/")
        try:
            value = _attribute(converted, name)
        except AttributeError:
            raise programstore.FormatError(f"the converted model has no tensor {name}") from None
        if group not in groups or not isinstance(value, torch.Tensor) or programstore.tensor_record(value) != record:
            raise programstore.FormatError(f"tensor {name} does not match the template")
        groups[group][name] = value
    groups["example_inputs"] = {str(i): t for i, t in enumerate(example_inputs)}
    graph = json.dumps(doc, allow_nan=False).encode("utf-8")  # parses back to ``doc`` exactly
    return programstore.stored_entry(graph, groups, spec_digest, doc), doc


def export(
    converted: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    spec_digest: str,
    session: Session,
    storing: bool,
    exporter: Callable[..., torch.export.ExportedProgram] | None = None,
    strict: bool = False,
) -> tuple[torch.export.ExportedProgram, Entry]:
    """The stage's re-export through the ``reexport`` step: the program, and the stage's entry.

    ``exporter``: the unpatched ``torch.export.export`` (``lowercache run``);
    ``strict``: the script's export is dynamo's.
    """
    parts = template_parts(converted, example_inputs, strict) if storing else None
    made: list[tuple[torch.export.ExportedProgram, Entry]] = []
    run_export = exporter or torch.export.export
    options = {"strict": True} if strict else {}

    def compute() -> Entry:
        program = run_export(converted, tuple(example_inputs), **options)
        stored = programstore.encode_or_note(program, spec_digest, storing)
        made.append((program, stored))
        if parts is None:
            return stored
        if not stored.meta.get("stored", True):
            return Entry(meta={"reason": stored.meta["reason"]})
        template = make_template(converted, program, stored, strict)
        return template if template is not None else Entry(meta={"reason": "export does not map node for node"})

    if parts is None:
        compute()
        return made[0]
    template = session.run("reexport", "converted model", parts, compute)
    if made:
        return made[0]
    try:
        if template.meta.get("strict") is not strict:
            raise programstore.FormatError("template of the other kind of export")
        entry, doc = fill(template, converted, example_inputs, spec_digest)
        program = programstore.decode(entry, doc)
        if "derived" in template.meta:
            restore(program, template.meta["derived"], converted)
        return program, entry
    except Exception as err:  # a template that does not fill is a miss, never a crash
        usable_format = template.meta.get("format") == REEXPORT_VERSION
        if usable_format:
            log.warning("cached re-export template unusable (%s); exporting", err)
        fresh = compute()
        if usable_format:
            session.replace("reexport", parts, fresh)
        return made[0]


_SPEC_ORDER = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR", "CUSTOM_OBJ", "TOKEN", "USER_INPUT")


def laid_out_as_strict(
    program: torch.export.ExportedProgram, converted: torch.fx.GraphModule
) -> torch.export.ExportedProgram | None:
    """A non-strict re-export of ``converted`` laid out as a strict one is; None if this cannot be done.

    For the runner (``run/ahead.py``) only: dynamo lifts the converted model's
    tensors in the order its ``forward`` first reads them and gives each
    lifted placeholder an ``example_value``, where the non-strict trace lifts
    them in the module's own order, tensors the graph never reads among them.
    The rest of the two programs differs only in metadata the step keys leave
    out. Nothing laid out so is stored under a re-export key or given to a
    script: its worth is that the steps after it reach the script's keys, and
    a key it misses costs only the runner's time.
    """
    first_read: dict[str, int] = {}
    for node in converted.graph.nodes:
        if node.op == "get_attr":
            first_read.setdefault(str(node.target), len(first_read))
    specs = program.graph_signature.input_specs
    lifted = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    if any(s.kind.name not in _SPEC_ORDER for s in specs) or sorted(placeholders) != sorted(s.arg.name for s in specs):
        return None
    unread = [s for s in specs if s.kind.name in lifted and s.target not in first_read]
    if any(placeholders[s.arg.name].users for s in unread):
        return None
    for spec in unread:  # a tensor the graph never reads (a weight folded away) is in dynamo's state, not its inputs
        program.graph.erase_node(placeholders.pop(spec.arg.name))
    ordered = sorted(
        (s for s in specs if s.arg.name in placeholders),
        key=lambda s: (_SPEC_ORDER.index(s.kind.name), first_read[s.target] if s.kind.name in lifted else 0),
    )
    first_other = next(n for n in program.graph.nodes if n.op != "placeholder")
    for spec in ordered:
        node = placeholders[spec.arg.name]
        first_other.prepend(node)
        if spec.kind.name in lifted and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    program.graph_module.recompile()
    signature = torch.export.graph_signature.ExportGraphSignature(
        input_specs=ordered, output_specs=list(program.graph_signature.output_specs)
    )
    return program._update(program.graph_module, signature)


def _in_script(mod: Any, args: Any, kwargs: Any = None, **options: Any) -> torch.export.ExportedProgram:
    """``torch.export.export`` inside ``lowercache run``: a converted model's re-export is the ``reexport`` step.

    A script's quantization ends as ``lower``'s does, with
    ``torch.export.export(convert_pt2e(...), inputs)``. That call, exactly
    so (no option but ``strict``), is the same step as ``lower``'s: an
    unchanged model or a weights edit is served as ``lower`` serves it. A
    non-strict call has ``lower``'s key and shares its entries; a strict one
    (aot_arm_compiler's default) is keyed apart, and its served program gets
    back dynamo's metadata (``restore``). Any other call is torch's own; the
    first strict export of a module that is not a GraphModule also starts the
    runner (``run/ahead.py``), which takes that export non-strict, and its
    strict re-export as ``lower``'s non-strict step laid out as the strict
    program (``laid_out_as_strict``), which is cheaper than dynamo's trace.
    """
    original = script_patch.originals[torch.export]
    session = current_session()
    strict = options.get("strict", False)
    if (session is None or kwargs or any(v for k, v in options.items() if k != "strict") or type(strict) is not bool
            or not isinstance(args, tuple) or not isinstance(mod, torch.fx.GraphModule)
            or not any(is_filled(n) for n in mod.graph.nodes)):
        if strict is True and session is not None and not isinstance(mod, torch.fx.GraphModule) and _runner.fork(session):
            options = {**options, "strict": False}  # this is the runner: from here on the non-strict way
        return original(mod, args, kwargs, **options)
    if strict and _runner.running_ahead():
        try:
            program = export(mod, args, "", session, session.store is not None, exporter=original)[0]
            laid_out = laid_out_as_strict(program, mod)
        except Exception as err:  # noqa: BLE001 - the runner then goes the script's way
            log.debug("run ahead: no non-strict re-export (%s)", err)
            laid_out = None
        if laid_out is not None:
            return laid_out
    return export(mod, args, "", session, session.store is not None, exporter=original, strict=strict)[0]


class Runner(Protocol):
    """What the script patch asks of ``lowercache run``'s runner ahead (``run/ahead.py``)."""

    def fork(self, session: Session) -> bool: ...

    def running_ahead(self) -> bool: ...


class _NoRunner:
    """Nothing runs ahead until ``run/hook.py`` names the runner: the lowering room does not import the run room."""

    @staticmethod
    def fork(session: Session) -> bool:
        return False

    @staticmethod
    def running_ahead() -> bool:
        return False


_runner: Runner = _NoRunner()


def run_ahead_with(runner: Runner) -> None:
    """Let the script patch start ``runner`` at a script's first strict export (``run/hook.py``, with the patch)."""
    global _runner
    _runner = runner


# On for the life of a ``lowercache run`` process (run/hook.py), never in ``lower``'s own flow.
script_patch = AttributePatch(lambda: [torch.export], "export", _in_script)
