"""Skip the re-trace of a ``run_decompositions`` call that has nothing to decompose.

``to_edge_transform_and_lower`` calls ``run_decompositions`` three times for a
partitioner that preserves ops (``_gen_edge_manager_for_partitioners``): to
functionalize, with the partitioner's ops kept, and once more with the full
table after the kept ops were renamed into ``EDGE_DO_NOT_DECOMP``. On the
graphs lowercache sees the third call usually finds nothing left to
decompose, yet re-traces the whole program through AOT dispatch (about a third
of all decomposition time). ExecuTorch itself skips such a call on its other
branch ("safe to skip when none of those targets occur in the graph").

A re-trace of an already decomposed graph keeps every node, name, argument
and value; what it changes is metadata, and this module makes exactly those
changes instead of re-tracing:

- every operator node's ``original_aten`` becomes its own operator;
- a parameter, buffer or constant placeholder that has an ``original_aten``
  takes its first user's (a lifted input is created when that op first reads
  it; for an ``EDGE_DO_NOT_DECOMP`` operator, the ATen operator its kernel runs);
- operators that need exact strides get ``eager_input_vals``, computed by
  torch's own helpers from the inputs' values.

The skip applies only under conditions that make this the whole effect: the
program is already in post-dispatch ATen form, the table is non-empty and none
of its operators occur, every node is a plain operator call (no
CompositeImplicitAutograd operator, no higher-order operator or nested
graph), and every node's metadata is of the kinds above or ones a re-trace
carries over unchanged, and the call comes from ExecuTorch's
``_gen_edge_manager_for_partitioners``, which drops the program it passed in
(the skip returns that program, changed in place; a user's script under
``lowercache run`` keeps its own calls stock). ``tests/test_decompositions.py`` compares the result,
node by node and key by key, with the real call on the test models.
"""

from __future__ import annotations

import operator
import sys
import threading
from typing import Any

import torch

from .patching import AttributePatch

# Metadata a re-trace of a decomposed graph carries over unchanged or recomputes
# as described above; a node with any other key takes the stock path.
_KNOWN_META = frozenset(
    {
        "custom",
        "desc",
        "eager_input_vals",
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

_lock = threading.Lock()
_stats = {"skipped": 0}


def stats() -> dict[str, int]:
    """Calls skipped since the last :func:`reset_stats`."""
    with _lock:
        return dict(_stats)


def reset_stats() -> None:
    with _lock:
        _stats["skipped"] = 0


def _is_composite_implicit(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _first_user(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The user that comes first in graph order (``users`` is in insertion order)."""
    return min(node.users, key=order.__getitem__, default=None)


def _kept_as(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The ATen operator behind an ``EDGE_DO_NOT_DECOMP`` one (its kernel is that operator,
    which is what touches a lifted input first); any other operator itself."""
    from executorch.exir.program._program import transform_op_to_aten_op

    return transform_op_to_aten_op.get(str(op), op)


def skippable(program: torch.export.ExportedProgram, table: Any) -> bool:
    """True when ``program.run_decompositions(table)`` would only re-trace."""
    if not isinstance(table, dict) or not table:
        return False
    if [v.dialect for v in program.verifiers] != ["ATEN"]:
        return False
    if any(isinstance(m, torch.fx.GraphModule) for m in program.graph_module.children()):
        return False
    order = {node: i for i, node in enumerate(program.graph.nodes)}
    for node in order:
        if not _KNOWN_META.issuperset(node.meta):
            return False
        if node.op == "get_attr":
            return False
        if node.op == "placeholder" and "original_aten" in node.meta:
            first = _first_user(node, order)
            if first is None or first.op != "call_function" or not isinstance(first.target, torch._ops.OpOverload):
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
    from torch.fx.experimental.proxy_tensor import _should_save_eager_input_vals, extract_val
    from torch._subclasses.fake_tensor import FakeTensor

    def value(arg: Any) -> Any:
        if not isinstance(arg, torch.fx.Node) or "val" not in arg.meta:
            return None
        val = arg.meta["val"]
        if isinstance(val, torch.Tensor) and not isinstance(val, FakeTensor):
            return None
        return extract_val(val)

    order = {node: i for i, node in enumerate(program.graph.nodes)}
    for node in order:
        if node.op == "call_function" and node.target is not operator.getitem:
            node.meta["original_aten"] = node.target
            if _should_save_eager_input_vals(node.target, (node.args, node.kwargs)):
                node.meta["eager_input_vals"] = torch.fx.node.map_aggregate((node.args, node.kwargs), value)
    for node in order:
        if node.op == "placeholder" and "original_aten" in node.meta:
            node.meta["original_aten"] = _kept_as(_first_user(node, order).target)


def _called_by_edge_generation(frame: Any) -> bool:
    """Only ExecuTorch's own call site drops the old program; a user's script may keep it."""
    from executorch.exir.program import _program

    return frame is not None and frame.f_code is _program._gen_edge_manager_for_partitioners.__code__


def _run_decompositions(self: torch.export.ExportedProgram, decomp_table: Any = None, *args: Any, **kwargs: Any):
    caller = sys._getframe(1)
    if args or kwargs or not _called_by_edge_generation(caller) or not skippable(self, decomp_table):
        return _patch.originals[torch.export.ExportedProgram](self, decomp_table, *args, **kwargs)
    apply_retrace_metadata(self)
    with _lock:
        _stats["skipped"] += 1
    return self


_patch = AttributePatch(lambda: [torch.export.ExportedProgram], "run_decompositions", _run_decompositions)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
