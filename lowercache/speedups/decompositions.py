"""Skip a ``run_decompositions`` call with nothing to decompose, and re-trace only the nodes of one with little, making exactly the changes a full re-trace makes.

Why it is exact, and figures: docs/speedups.md#decompositions.
"""

from __future__ import annotations

import inspect
import logging
import operator
import sys
from typing import Any, Callable

import torch

from . import decompreplay
from .patching import AttributePatch, Counters

log = logging.getLogger("lowercache")

# Metadata a re-trace of a decomposed graph carries over unchanged or recomputes
# as docs/speedups.md#decompositions lists; a node with any other key takes the stock path.
_KNOWN_META = frozenset(
    {
        "custom",
        "desc",
        "eager_input_vals",
        "example_value",  # dynamo's, on a strict export's lifted placeholders
        "from_node",
        "nn_module_stack",
        "original_aten",
        "seq_nr",
        "source_fn_stack",
        "stack_trace",
        "tensor_meta",
        "torch_fn",
        "val",
    }
)
# Metadata a re-trace drops: set on operator nodes by a partitioner's checks (XNNPACK's configs tag the q/dq nodes
# they would fuse), neither copied by the trace (``torch.fx.proxy._COPY_META_FIELDS``) nor computed by it.
_DROPPED_META = frozenset({"IS_IMPLICIT_Q_DQ_TAG"})
_KNOWN_OPERATOR_META = _KNOWN_META | _DROPPED_META

# Input kinds a functionalizing call may localize, in the order its trace lists them.
_INPUT_ORDER = {"PARAMETER": 0, "BUFFER": 1, "USER_INPUT": 2}

_counts = Counters("skipped", "localized", "full", "replayed")
_count = _counts.count


def stats() -> dict[str, int]:
    """Calls skipped, localized (of which replayed from stored templates) and run in full
    (by ExecuTorch's call site) since the last :func:`reset_stats`."""
    return _counts.snapshot()


def reset_stats() -> None:
    _counts.reset()


def _is_composite_implicit(op: torch._ops.OpOverload) -> bool:
    """A CompositeImplicitAutograd kernel, in C++ or Python (torch's own test)."""
    from torch._export.utils import _is_cia_op

    return _is_cia_op(op)


def _decomposed(op: torch._ops.OpOverload, table: dict) -> bool:
    """Whether ``run_decompositions(table)`` may decompose ``op``, as its table split decides
    (``_split_decomp_table_to_cia_and_python_decomp``): operators in the table are, and a
    CompositeImplicitAutograd one is unless torch preserves it (an ATen operator in
    ``_collect_all_valid_cia_ops``, functional and not in the table). A preserved
    operator of another namespace counts as decomposed: a wasted re-trace, never a wrong one."""
    from torch._export.utils import _collect_all_valid_cia_ops_for_aten_namespace, _is_aten_op

    if op in table:
        return True
    if not _is_composite_implicit(op):
        return False
    return not (_is_aten_op(op) and op in _collect_all_valid_cia_ops_for_aten_namespace())


def _first_user(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The user that comes first in graph order (``users`` is in insertion order)."""
    return min(node.users, key=order.__getitem__, default=None)


def functionalizing(program: torch.export.ExportedProgram, table: Any) -> bool:
    """The first call: a pre-dispatch program and an empty table (functionalize, decompose only
    CompositeImplicitAutograd operators)."""
    return isinstance(table, dict) and not table and [v.dialect for v in program.verifiers] == ["TRAINING"]


def _refusal(program: torch.export.ExportedProgram, table: Any) -> str | None:
    """Why the call can be neither skipped nor localized, whatever its nodes (None: it may be).

    A functionalizing call passes here; only :func:`localize_functionalization` takes it.
    """
    if not functionalizing(program, table):
        if not isinstance(table, dict) or not table:
            return "no decomposition table"
        if [v.dialect for v in program.verifiers] != ["ATEN"]:
            return "not yet post-dispatch ATen"
    if any(isinstance(m, torch.fx.GraphModule) for m in program.graph_module.children()):
        return "nested graphs"
    return None


def _node_refusal(node: torch.fx.Node) -> str | None:
    """Why ``node`` keeps the call from being skipped or localized (None: it does not)."""
    known = _KNOWN_OPERATOR_META if node.op == "call_function" else _KNOWN_META
    if not known.issuperset(node.meta):
        return f"metadata {sorted(set(node.meta) - known)}"
    if node.op == "get_attr":
        return "get_attr node"
    return None


def _first_operator_user(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """``node``'s first user when that is an operator call, else None."""
    first = _first_user(node, order)
    if first is None or first.op != "call_function" or not isinstance(first.target, torch._ops.OpOverload):
        return None
    return first


def skippable(program: torch.export.ExportedProgram, table: Any) -> bool:
    """True when ``program.run_decompositions(table)`` would only re-trace."""
    if functionalizing(program, table) or _refusal(program, table) is not None:
        return False
    order = {node: i for i, node in enumerate(program.graph.nodes)}
    for node in order:
        if _node_refusal(node) is not None:
            return False
        if node.op == "placeholder" and "original_aten" in node.meta and _first_operator_user(node, order) is None:
            return False
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            continue
        if not isinstance(target, torch._ops.OpOverload) or target in table or _is_composite_implicit(target):
            return False
    return True


def apply_retrace_metadata(program: torch.export.ExportedProgram) -> None:
    """Give ``program``'s nodes the metadata a re-trace without decompositions would."""
    inputs_meta = _lifted_input_meta(program)
    _retrace_op_metadata(program.graph.nodes)
    for node, meta in inputs_meta.items():
        node.meta = meta


def eager_input_vals(node: torch.fx.Node) -> Any:
    """What a trace records as a stride-sensitive operator's ``eager_input_vals``: its inputs' values (``proxy_tensor``)."""
    from torch.fx.experimental.proxy_tensor import extract_val
    from torch._subclasses.fake_tensor import FakeTensor

    def value(arg: Any) -> Any:
        if not isinstance(arg, torch.fx.Node) or "val" not in arg.meta:
            return None
        val = arg.meta["val"]
        if isinstance(val, torch.Tensor) and not isinstance(val, FakeTensor):
            return None
        return extract_val(val)

    return torch.fx.node.map_aggregate((node.args, node.kwargs), value)


def _retrace_op_metadata(nodes: Any) -> None:
    """``original_aten`` and ``eager_input_vals`` of operator nodes a re-trace carries over unchanged, without the
    metadata it drops."""
    from torch.fx.experimental.proxy_tensor import _should_save_eager_input_vals

    for node in nodes:
        for key in _DROPPED_META.intersection(node.meta):
            del node.meta[key]
        if _returns_nothing(node):
            node.meta.pop("val", None)
            node.meta.pop("tensor_meta", None)
        if node.op == "call_function" and node.target is not operator.getitem:
            node.meta["original_aten"] = node.target
            if _should_save_eager_input_vals(node.target, (node.args, node.kwargs)):
                node.meta["eager_input_vals"] = eager_input_vals(node)


class Unsupported(Exception):
    """The call is outside what ``localize`` reproduces; it runs in full."""


def _candidates(
    program: torch.export.ExportedProgram, table: Any
) -> tuple[list[torch.fx.Node], dict[torch.fx.Node, tuple[tuple, dict]]]:
    """The nodes ``run_decompositions(table)`` can change, after checking the rest cannot;
    and the other operator nodes whose arguments a trace records in another form, with that form."""
    if why := _refusal(program, table):
        raise Unsupported(why)
    if program.range_constraints:
        raise Unsupported("symbolic shapes")  # a trace would also update the constraints
    found, forms = [], {}
    for node in program.graph.nodes:
        if why := _node_refusal(node):
            raise Unsupported(why)
        target = node.target
        if node.op != "output" and not _static_tensors(node.meta.get("val")) and not _returns_nothing(node):
            raise Unsupported(f"{node.name} has a symbolic or non-tensor value")
        if node.op != "call_function" or target is operator.getitem:
            continue
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            raise Unsupported(f"operator {target}")
        if _decomposed(target, table):
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise Unsupported(f"{target} without one tensor output")
            found.append(node)
            continue
        form = dispatch_form(target, node.args, node.kwargs)
        if form is None:
            raise Unsupported(f"arguments of {node.name}")
        if form != (node.args, node.kwargs):
            forms[node] = form
    return found, forms


def _returns_nothing(node: torch.fx.Node) -> bool:
    """An operator without outputs (``_assert_tensor_metadata``); a trace gives it no value."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and not node.target._schema.returns
        and node.meta.get("val") is None
    )


_LITERALS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _literal_equal(value: Any, default: Any) -> bool | None:
    """Whether a value equals an argument's default as the dispatcher compares them (None: unsure)."""
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        if len(value) != len(default):
            return False
        pairs = [_literal_equal(v, d) for v, d in zip(value, default)]
        return None if None in pairs else all(pairs)
    if type(value) is type(default) and type(value) in _LITERALS:
        return value == default
    if {type(value), type(default)} <= {int, float}:  # a Scalar: numerically unequal is unequal either way
        return False if value != default else None
    return None


def dispatch_form(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` as the dispatcher hands them to a tracing mode, so as a trace records them
    (``parseIValuesToPyArgsKwargs``): positional arguments up to the last one not at its default,
    missing ones in between at their defaults; keyword-only ones only when not at their default.
    None when that cannot be told for sure (a value and default of different or non-literal types)."""
    schema = op._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return None
    given = {a.name: v for a, v in zip(positional, args)}
    names = {a.name for a in schema.arguments}
    for name, value in kwargs.items():
        if name in given or name not in names:
            return None
        given[name] = value

    def at_default(arg: Any) -> bool | None:
        if arg.name not in given:
            return True
        value = given[arg.name]
        if not arg.has_default_value():
            return False
        default = arg.default_value
        if value is None or default is None:
            return value is None and default is None
        return _literal_equal(value, default)

    positional_end = 0
    for i, arg in enumerate(positional):
        state = at_default(arg)
        if state is None:
            return None
        if not state:
            positional_end = i + 1
    out_args = []
    for arg in positional[:positional_end]:
        if arg.name in given:
            out_args.append(given[arg.name])
        elif arg.has_default_value() and _literal_equal(arg.default_value, arg.default_value):
            out_args.append(arg.default_value)
        else:
            return None
    out_kwargs = {}
    for arg in schema.arguments:
        if arg.kwarg_only:
            state = at_default(arg)
            if state is None:
                return None
            if not state:
                out_kwargs[arg.name] = given[arg.name]
    return tuple(out_args), out_kwargs


def _static_tensors(val: Any) -> bool:
    """A tensor, or a tuple or list of tensors, of integer sizes only."""
    values = val if isinstance(val, (tuple, list)) else (val,)
    return all(isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape) for v in values)


def _small_program(
    program: torch.export.ExportedProgram, nodes: list[torch.fx.Node]
) -> tuple[torch.export.ExportedProgram, list[torch.fx.Node]]:
    """A program of ``nodes`` alone, their other inputs as placeholders (same fake values); and those inputs."""
    import torch.utils._pytree as pytree
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[torch.fx.Node] = []
    chosen = set(nodes)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in chosen and arg not in env:
                env[arg] = graph.placeholder(arg.name)
                env[arg].meta["val"] = arg.meta["val"]
                inputs.append(arg)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    outputs = [env[n] for n in nodes]
    graph.output(tuple(outputs))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    signature = ExportGraphSignature(
        input_specs=[InputSpec(InputKind.USER_INPUT, TensorArgument(env[i].name), None) for i in inputs],
        output_specs=[OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outputs],
    )
    in_spec = pytree.tree_structure((tuple(inputs), {}))
    out_spec = pytree.tree_structure(tuple(outputs))
    small = torch.export.ExportedProgram(
        root=module,
        graph=graph,
        graph_signature=signature,
        state_dict={},
        range_constraints={},
        module_call_graph=[ModuleCallEntry("", ModuleCallSignature([], [], in_spec, out_spec))],
        example_inputs=None,
        constants={},
        verifiers=program.verifiers,
    )
    return small, inputs


def trace_names(graph: torch.fx.Graph) -> tuple[dict[torch.fx.Node, str], Any]:
    """The node names a trace of ``graph`` gives, and the namespace holding them.

    Operator nodes are named by operator in node order; a multi-output
    operator's outputs are all extracted by ``getitem`` right after it, and
    the unused ones removed later, their names taken all the same.
    """
    namespace = torch.fx.graph._Namespace()
    names: dict[torch.fx.Node, str] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            names[node] = namespace.create_name(node.name if node.op == "placeholder" else "output", node)
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            if node.target is operator.getitem and node in names:
                continue
            raise Unsupported(f"cannot name {node.op} {node.target}")
        names[node] = namespace.create_name(graph._target_to_str(node.target.overloadpacket.__name__), node)
        val = node.meta.get("val")
        items: dict[int, torch.fx.Node] = {}
        for user in node.users:
            if user.target is operator.getitem:
                index = user.args[1] if len(user.args) == 2 and not user.kwargs else None
                if not isinstance(val, (tuple, list)) or not isinstance(index, int) or index in items:
                    raise Unsupported(f"getitem of {node.name}")
                items[index] = user
        if isinstance(val, (tuple, list)):
            if not all(isinstance(v, torch.Tensor) for v in val) or any(u.target is not operator.getitem for u in node.users):
                raise Unsupported(f"outputs of {node.name}")
            following, after = [], node.next
            for _ in items:
                following.append(after)
                after = after.next
            if following != [items[i] for i in sorted(items)]:  # a trace puts them right after, in order
                raise Unsupported(f"getitems of {node.name} not right after it")
            for index in range(len(val)):
                name = namespace.create_name("getitem", items.get(index))
                if index in items:
                    names[items[index]] = name
    return names, namespace


def _stored_templates(candidates: list, table: Any) -> tuple[dict, dict | None]:
    """Each candidate's ``decomp`` step parts, and the decoded templates when every candidate has one."""
    from ..cache.hashing import digest_json
    from ..cache.steps import current_session
    from ..cache.toolchain import toolchain_parts

    session = current_session()
    if session is None or not candidates:
        return {}, None
    table_id = decompreplay.table_digest(table)
    if table_id is None:
        return {}, None
    toolchain = digest_json(toolchain_parts())
    keys = {c: decompreplay.key_parts(c, table_id, toolchain) for c in candidates}
    if any(parts is None for parts in keys.values()):
        return keys, None
    templates = {}
    for c in candidates:
        entry = session.lookup(decompreplay.KIND, str(c.target), keys[c])
        if entry is None:
            return keys, None
        try:
            template = decompreplay.decode(entry.meta.get("template"), len(c.all_input_nodes))
        except decompreplay.Refused as why:
            log.warning("stored decomposition of %s is unusable (%s); tracing", c.name, why)
            return keys, None
        if not decompreplay.applicable(template, c):
            return keys, None
        templates[c] = template
    return keys, templates


def _store_templates(candidates: list, keys: dict, bodies: list, outputs: list, input_of: dict) -> None:
    """Record each traced candidate's template as its ``decomp`` step."""
    from ..cache.steps import current_session
    from ..cache.store import Entry

    session = current_session()
    if session is None:
        return
    output_of = dict(zip(outputs, candidates))
    for c, body, out in zip(candidates, bodies, outputs):
        parts = keys.get(c)
        if parts is None:
            continue
        try:
            template = decompreplay.capture(c, body, out, input_of, output_of)
        except decompreplay.Refused:
            continue
        session.remember(decompreplay.KIND, str(c.target), parts, Entry(meta={"template": template}))


def localize(program: torch.export.ExportedProgram, table: Any, original: Callable[..., Any]) -> None:
    """``program.run_decompositions(table)`` in place, re-tracing only the nodes it can change.

    Raises :class:`Unsupported` before touching ``program`` when the call is
    outside what this reproduces.
    """
    from torch.export.graph_signature import TensorArgument

    graph = program.graph
    candidates, forms = _candidates(program, table)
    trace_names(graph)  # the structure must be one whose names are known
    order = {node: i for i, node in enumerate(graph.nodes)}
    inputs_meta = _lifted_input_meta(program)
    for node in inputs_meta:
        if node.users and _first_operator_user(node, order) is None:
            raise Unsupported(f"first user of {node.name}")
    new_nodes: set[torch.fx.Node] = set()
    replaced: dict[str, torch.fx.Node] = {}
    keys, templates = _stored_templates(candidates, table)
    if templates is not None:
        chosen = set(candidates)
        read = {c: {c.all_input_nodes[j] for j in decompreplay.references(templates[c])} for c in candidates}
        for c in candidates:  # as the trace's check below: a node whose every use is decomposed away
            for node in c.all_input_nodes:
                if node.op != "placeholder" and all(u in chosen for u in node.users):
                    if not any(node in read[u] for u in node.users):
                        raise Unsupported(f"{node.name} would lose all its uses")
        seq_nr = torch.autograd._get_sequence_nr() - 1  # what the trace would stamp (it runs without grad)
        inputs_of = {c: list(c.all_input_nodes) for c in candidates}  # as the keys saw them
        planned: dict[torch.fx.Node, list] = {}
        value_of: dict[torch.fx.Node, Any] = {}  # a replaced candidate's value
        for c in candidates:
            input_values = [value_of[n] if n in value_of else n.meta.get("val") for n in inputs_of[c]]
            try:
                planned[c], value_of[c] = decompreplay.values(c, templates[c], input_values)
            except decompreplay.Refused as why:
                log.warning("stored decomposition of %s does not apply (%s); tracing in full", c.name, why)
                raise Unsupported(f"template of {c.name}: {why}") from None
        replacement: dict[torch.fx.Node, torch.fx.Node] = {}
        for c in candidates:
            inputs = [replacement.get(n, n) for n in inputs_of[c]]
            out = replacement[c] = decompreplay.insert(graph, c, templates[c], inputs, planned[c], seq_nr, new_nodes)
            c.replace_all_uses_with(out)
            replaced[c.name] = out
            graph.erase_node(c)
        _count("replayed")
    elif candidates:
        small, inputs = _small_program(program, candidates)
        try:
            traced = original(small, table)
        except Exception as err:  # the full call decides what happens on this program
            raise Unsupported(f"small program: {type(err).__name__}: {err}") from None
        placeholders = traced.graph.find_nodes(op="placeholder")
        outputs = list(traced.graph.output_node().args[0])
        if len(placeholders) != len(inputs) or len(outputs) != len(candidates):
            raise Unsupported("the small program's signature changed")
        names, _ = trace_names(traced.graph)
        if any(names[n] != n.name for n in traced.graph.nodes):
            raise Unsupported("the small program's trace removed nodes")
        chosen = set(candidates)
        # A node whose every use is decomposed away would be dropped by the full trace's dead-code pass.
        for used, node in [*zip(placeholders, inputs), *zip(outputs, candidates)]:
            if node.op != "placeholder" and all(u in chosen for u in node.users) and not set(used.users) - {traced.graph.output_node()}:
                raise Unsupported(f"{node.name} would lose all its uses")
        owner: dict[torch.fx.Node, int] = {}
        for i, out in enumerate(outputs):  # each candidate's nodes: what its output needs, back to earlier ones
            stack = [out]
            while stack:
                n = stack.pop()
                if n.op != "placeholder" and n not in owner:
                    owner[n] = i
                    stack.extend(n.all_input_nodes)
        body = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
        if any(n not in owner for n in body):
            raise Unsupported("a node of the small program's trace belongs to no candidate")
        mapped: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, inputs))
        _store_templates(candidates, keys, [[n for n in body if owner[n] == i] for i in range(len(candidates))], outputs, mapped)
        for i, candidate in enumerate(candidates):
            with graph.inserting_before(candidate):
                for n in body:
                    if owner[n] == i:
                        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), mapped.__getitem__)
                        new = graph.create_node(n.op, n.target, args, kwargs)
                        new.meta = dict(n.meta)
                        mapped[n] = new
                        new_nodes.add(new)
            candidate.replace_all_uses_with(mapped[outputs[i]])
            replaced[candidate.name] = mapped[outputs[i]]
            graph.erase_node(candidate)
    try:
        names, namespace = trace_names(graph)
    except Unsupported as err:  # checked on both parts before the change: cannot happen
        raise AssertionError(f"localized decomposition left an unnamed structure: {err}") from None
    renamed = {node.name: name for node, name in names.items() if node.name != name}
    renamed.update((old, names[node]) for old, node in replaced.items())  # a replaced output's name follows
    for node, name in names.items():
        node.name = name
    graph._graph_namespace = namespace
    for spec in program.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg = TensorArgument(renamed[spec.arg.name])
    for entry in program.module_call_graph:
        if entry.signature is not None:
            for args in (entry.signature.inputs, entry.signature.outputs):
                args[:] = [TensorArgument(renamed[a.name]) if isinstance(a, TensorArgument) and a.name in renamed else a for a in args]
    for node, (args, kwargs) in forms.items():
        node.args, node.kwargs = args, kwargs
    _retrace_op_metadata(n for n in graph.nodes if n not in new_nodes)
    for node, meta in inputs_meta.items():
        node.meta = meta
    program.graph_module.recompile()


def localize_functionalization(program: torch.export.ExportedProgram, original: Callable[..., Any]) -> torch.export.ExportedProgram:
    """``program.run_decompositions({})`` on a pre-dispatch program, re-tracing only the nodes it can change.

    The first call functionalizes and decomposes the CompositeImplicitAutograd
    operators torch does not preserve. Without mutations there is nothing to
    functionalize, so it is :func:`localize` with an empty table, plus what the
    trace adds to a pre-dispatch program: operator arguments in the form a
    trace records them (:func:`dispatch_form`); every placeholder's ``desc``
    (its input descriptor); a lifted input's metadata as
    :func:`_lifted_input_meta` gives it; and on every operator node
    ``seq_nr``, the autograd sequence number at the time of the call. The
    trace runs under ``torch.no_grad()`` (torch's ``_export_to_aten_ir``), so
    it records no autograd node and that number stays put, and no operator's
    output requires grad: a float program's operator nodes lose the
    ``requires_grad`` their ``tensor_meta`` had from export (parameters keep
    theirs). The result is a new program, as the real call returns, leaving
    ``program`` as it was (the caller may still hold it). Raises
    :class:`Unsupported` when the call is outside this.
    """
    from torch._export.verifier import Verifier
    from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput, PlainAOTInput
    from torch.export.graph_signature import InputKind, OutputKind

    if not functionalizing(program, {}):
        raise Unsupported("not a functionalizing call")
    signature = program.graph_signature
    ranks = [_INPUT_ORDER.get(spec.kind.name) for spec in signature.input_specs]
    if None in ranks or ranks != sorted(ranks):  # the trace lists parameters, buffers, then user inputs
        raise Unsupported(f"inputs of kinds {[spec.kind.name for spec in signature.input_specs]}")
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs) or program.constants:
        raise Unsupported("mutations, tokens or lifted constants")
    for node in program.graph.nodes:
        val = node.meta.get("val")
        grad = any(isinstance(v, torch.Tensor) and v.requires_grad for v in (val if isinstance(val, (tuple, list)) else (val,)))
        if grad and node.op != "placeholder":  # export gives operator values without grad; a trace's would differ
            raise Unsupported(f"{node.name}'s value requires grad")
    seq_nr = torch.autograd._get_sequence_nr() - 1
    result = _copied(program)
    placeholders = result.graph.find_nodes(op="placeholder")
    if [spec.arg.name for spec in result.graph_signature.input_specs] != [node.name for node in placeholders]:
        raise Unsupported("placeholders out of signature order")
    localize(result, {}, original)
    users = 0
    for spec, node in zip(result.graph_signature.input_specs, placeholders):
        if spec.kind == InputKind.USER_INPUT:
            node.meta["desc"] = PlainAOTInput(users)
            users += 1
        else:
            node.meta["desc"] = (ParamAOTInput if spec.kind == InputKind.PARAMETER else BufferAOTInput)(spec.target)
    for node in result.graph.nodes:
        if node.op == "call_function":
            node.meta["seq_nr"] = seq_nr
            if "tensor_meta" in node.meta:
                node.meta["tensor_meta"] = _without_grad(node.meta["tensor_meta"])
    result._verifiers = [Verifier]
    return result


def _without_grad(meta: Any) -> Any:
    """``tensor_meta`` as the no-grad trace records it: ``requires_grad`` false, the rest unchanged."""
    if isinstance(meta, (tuple, list)) and not hasattr(meta, "_fields"):
        return type(meta)(_without_grad(m) for m in meta)
    if hasattr(meta, "_replace") and getattr(meta, "requires_grad", False):
        return meta._replace(requires_grad=False)
    return meta


def _lifted_input_meta(program: torch.export.ExportedProgram) -> dict[torch.fx.Node, dict]:
    """The metadata a re-trace gives each lifted input's (parameter, buffer, constant) placeholder.

    ``run_decompositions`` unlifts the program (the placeholder becomes a
    ``get_attr`` holding its metadata, ``from_node`` replaced), then
    ``_collect_param_buffer_metadata`` copies onto it, from each operator that
    reads it in graph order, the traced fields (``_COPY_META_FIELDS``) but
    ``custom``, later readers overwriting earlier ones; without the
    ``nn_module_stack`` and ``stack_trace`` that metadata lands on the new
    placeholder (``_populate_param_buffer_metadata_to_new_gm``).
    """
    from torch.export.graph_signature import InputKind
    from torch.fx.proxy import _COPY_META_FIELDS
    from torch.fx.traceback import NodeSource, NodeSourceAction

    fields = [f for f in _COPY_META_FIELDS if f != "custom"]
    lifted = {spec.arg.name for spec in program.graph_signature.input_specs if spec.kind != InputKind.USER_INPUT}
    collected = {}
    for node in program.graph.find_nodes(op="placeholder"):
        if node.name not in lifted:
            continue
        meta = dict(node.meta)
        meta["from_node"] = [NodeSource(node, "ExportedProgram.module().unlift()", [NodeSourceAction.CREATE, NodeSourceAction.REPLACE])]
        collected[node] = meta
    for node in program.graph.nodes:
        if node.op == "call_function" and not isinstance(node.target, torch._ops.HigherOrderOperator):
            for arg in node._input_nodes:
                if arg in collected:
                    collected[arg].update((f, node.meta[f]) for f in fields if f in node.meta)
    for meta in collected.values():
        meta.pop("nn_module_stack", None)
        meta.pop("stack_trace", None)
    return collected


def _copied(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A new program over a copy of ``program``'s graph (node metadata dicts copied, values shared)."""
    import copy

    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(program.graph._codegen)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    outputs, old_output = graph.graph_copy(program.graph, env, return_output_node=True)
    renamed = [old.name for old, new in env.items() if new.name != old.name]
    if renamed:  # export names nodes past FX's namespace (an input called `input`); a copy cannot keep the name
        raise Unsupported(f"node names FX would rename on a copy: {renamed[:3]}")
    graph.output(outputs).meta = dict(old_output.meta)
    module = torch.fx.GraphModule(program.graph_module, graph)
    module.meta.update(program.graph_module.meta)
    return torch.export.ExportedProgram(
        root=module,
        graph=graph,
        graph_signature=copy.deepcopy(program.graph_signature),
        state_dict=dict(program.state_dict),
        range_constraints=dict(program.range_constraints),
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=dict(program.constants),
        verifiers=program.verifiers,
    )


def _called_by_edge_generation(frame: Any) -> bool:
    """Only ExecuTorch's own call site drops the old program; a user's script may keep it (a wrapper, ``rebind``'s,
    names the function it wraps in ``__wrapped__``)."""
    from executorch.exir.program import _program

    return frame is not None and frame.f_code is inspect.unwrap(_program._gen_edge_manager_for_partitioners).__code__


def _run_decompositions(self: torch.export.ExportedProgram, decomp_table: Any = None, *args: Any, **kwargs: Any):
    original = _patch.originals[torch.export.ExportedProgram]
    caller = sys._getframe(1)
    if args or kwargs or not _called_by_edge_generation(caller):
        return original(self, decomp_table, *args, **kwargs)
    if skippable(self, decomp_table):
        apply_retrace_metadata(self)
        _count("skipped")
        return self
    try:
        if functionalizing(self, decomp_table):
            result = localize_functionalization(self, original)  # a new program: the caller's may be in use
        else:
            localize(self, decomp_table, original)
            result = self
    except Unsupported as why:
        log.debug("run_decompositions in full (%s)", why)
        _count("full")
        return original(self, decomp_table, *args, **kwargs)
    _count("localized")
    return result


_patch = AttributePatch(lambda: [torch.export.ExportedProgram], "run_decompositions", _run_decompositions)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
