"""What a delegate call's fake run reads, so that a retrace can reuse its earlier result when all of it is unchanged.

Why it is exact, and figures: docs/speedups.md#retrace-delegate-calls.
"""

from __future__ import annotations

import functools
import operator
import sys
from typing import Any

from .sourcepin import source_digest

# sha256 over the sources of torch's executorch_call_delegate CPU, fake and
# autograd implementations, ExportedProgram.module and the unlift it calls (torch 2.13.0).
_AUDITED_DIGEST = "5a355bae09aa73e6c3821666d36d03232af9be861be550c0dec7cefc206e087b"
_HOP_MODULE = "torch._higher_order_ops.executorch_call_delegate"


def sources_digest() -> str | None:
    """Digest of the torch sources whose behaviour :func:`signature` relies on."""
    import torch._higher_order_ops.executorch_call_delegate  # noqa: F401  (the module, not the operator)
    from torch.export import ExportedProgram, _unlift

    hop = sys.modules[_HOP_MODULE]
    return source_digest(
        hop.call_delegate_cpu,
        hop.call_delegate_fake_tensor_mode,
        hop.call_delegate_autograd,
        ExportedProgram.module,
        _unlift._unlift_exported_program_lifted_states,
    )


@functools.cache
def _audited() -> bool:
    try:
        return sources_digest() == _AUDITED_DIGEST
    except (AttributeError, KeyError):  # a torch without these functions
        return False


def operator_if_loaded() -> Any:
    """The ``executorch_call_delegate`` operator, or None when nothing has imported it."""
    hop = sys.modules.get(_HOP_MODULE)
    return getattr(hop, "executorch_call_delegate", None)


def _meta(t: Any) -> tuple | None:
    """A tensor's full metadata, with its exact type; None when any size is symbolic."""
    shape = tuple(t.shape)
    stride = t.stride()
    offset = t.storage_offset()
    if type(offset) is not int or any(type(d) is not int for d in shape + stride):
        return None
    return (type(t), t.dtype, t.device, t.layout, shape, stride, offset, t.requires_grad, t.is_conj(), t.is_neg(), t._is_view())


@functools.cache
def _literal_types() -> frozenset:
    import torch

    return frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _arg(a: Any, index: dict, out: list) -> bool:
    """Append ``a``'s description to ``out``; False when it holds anything but nodes and literals."""
    import torch

    t = type(a)
    if t is torch.fx.Node:
        position = index.get(a)
        if position is None:
            return False  # a node of another graph
        out.append(("node", position))
        return True
    if t is float:
        out.append((float, a.hex()))
        return True
    if t is tuple or isinstance(a, list):
        out.append(("(" if t is tuple else "[", len(a)))
        return all(_arg(item, index, out) for item in a)
    if t in _literal_types():
        out.append((t, a))
        return True
    return False


def _tensor_entries(items: Any) -> tuple | None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    entries = []
    for name, value in sorted(items, key=operator.itemgetter(0)):
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return None
        meta = _meta(value)
        if meta is None:
            return None
        entries.append((name, meta))
    return tuple(entries)


def _example(value: Any) -> tuple | None:
    import torch
    from torch.utils import _pytree as pytree

    if value is None:
        return ()
    leaves, spec = pytree.tree_flatten(value)
    out: list = [spec]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            meta = _meta(leaf)
            if meta is None:
                return None
            out.append(meta)
        elif type(leaf) in _literal_types() or type(leaf) is float:
            out.append((type(leaf), leaf.hex() if type(leaf) is float else leaf))
        else:
            return None
    return tuple(out)


def signature(lowered: Any) -> tuple[tuple, bool] | None:
    """``(description, reads_tosa_context)`` of what the delegate's fake run reads, or None.

    None means the run may read something the description would miss, so it
    must be dispatched.
    """
    from executorch.exir.lowered_backend_module import LoweredBackendModule
    from torch.export import ExportedProgram

    from . import oppolicy

    if type(lowered) is not LoweredBackendModule or not _audited():
        return None
    ep = lowered.original_module
    if type(ep) is not ExportedProgram or "module" in ep.__dict__ or ep.range_constraints:
        return None
    gm = ep.graph_module
    if next(gm.children(), None) is not None:
        return None
    index: dict = {}
    nodes: list = []
    tosa = False
    for position, node in enumerate(ep.graph.nodes):
        index[node] = position
        entry: list = [node.op]
        if node.op == "placeholder":
            val = node.meta.get("val")
            meta = _meta(val) if hasattr(val, "stride") else ("no tensor", repr(val))
            if meta is None:
                return None
            entry += [node.name, node.target, meta]
        elif node.op == "call_function":
            if node.target is not operator.getitem:
                policy = oppolicy.policy(node.target)
                if policy is None:
                    return None
                tosa = tosa or policy[1]
            entry.append(node.target)
            if not _arg(tuple(node.args), index, entry):
                return None
            for name in sorted(node.kwargs):
                entry.append(name)
                if not _arg(node.kwargs[name], index, entry):
                    return None
        elif node.op == "output":
            if not _arg(tuple(node.args), index, entry):
                return None
        else:
            return None
        nodes.append(tuple(entry))
    state = _tensor_entries(ep.state_dict.items())
    constants = _tensor_entries(ep.constants.items())
    example = _example(ep.example_inputs)
    if state is None or constants is None or example is None:
        return None
    call_signature = ep.module_call_graph[0].signature if ep.module_call_graph else None
    description = (
        tuple(nodes),
        repr(ep.graph_signature.input_specs),
        repr(ep.graph_signature.output_specs),
        ep.call_spec.in_spec,
        ep.call_spec.out_spec,
        tuple(call_signature.forward_arg_names or ()) if call_signature is not None else None,
        tuple(ep._guards_code),
        tuple(v.dialect for v in ep.verifiers),
        state,
        constants,
        example,
    )
    return description, tosa
