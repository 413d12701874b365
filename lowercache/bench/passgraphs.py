"""The graph each call of chosen Arm passes returns during a lowering, in a comparable form.

For proving a speed-up that changes how a pass computes its result (``propagate``) against the pass as stock runs
it: lower twice, with and without it, and compare every graph the pass returned, node by node.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch


def form(value: Any) -> Any:
    """A comparable form of an argument or metadata value: tensors by their metadata, nodes by name, ops by name."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, torch.Tensor):
        return ("tensor", type(value) is FakeTensor, value.dtype, tuple(value.shape), value.stride(), value.device,
                value.storage_offset(), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(form(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, form(v)) for k, v in value.items()))
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ("op", str(value))
    return repr(value)


def provenance(chain: Any) -> Any:
    """A ``from_node`` chain by the names, targets, passes and actions it records (graph ids differ between runs)."""
    return [
        [s.name, s.target, s.pass_name, [a.value for a in s.action], provenance(s.from_node)] for s in chain or []
    ]


def describe(graph_module: torch.fx.GraphModule) -> list:
    """Every node: kind, name, target, arguments, users in order, and every metadata key in order with its value.

    Two values record the process's history rather than the graph, and differ between two stock lowerings in one
    process: ``seq_nr`` (autograd's global sequence number) is left out, and ``custom`` is taken without the marks
    torch's dynamo-disable wrapper leaves the first time a function is traced (``hashing.without_process_marks``).
    Neither reaches an output byte.
    """
    from ..cache.hashing import without_process_marks

    def meta(key: str, value: Any) -> Any:
        if key == "from_node":
            return provenance(value)
        return form(without_process_marks(value) if key == "custom" else value)

    return [
        (n.op, n.name, str(n.target), form(n.args), form(n.kwargs), [u.name for u in n.users],
         [(k, meta(k, v)) for k, v in n.meta.items() if k != "seq_nr"])
        for n in graph_module.graph.nodes
    ]


def graphs_after(names: tuple[str, ...], lower: Callable[[], Any]) -> tuple[list[tuple[str, list]], Any]:
    """``lower()``'s result, and the described graph of every call of an Arm pass whose class is named in ``names``."""
    from executorch.backends.arm._passes.arm_pass import ArmPass

    original = ArmPass.__call__
    seen: list[tuple[str, list]] = []

    def call(self: Any, graph_module: Any) -> Any:
        result = original(self, graph_module)
        if type(self).__name__ in names and result is not None:
            seen.append((type(self).__name__, describe(result.graph_module)))
        return result

    ArmPass.__call__ = call
    try:
        return seen, lower()
    finally:
        ArmPass.__call__ = original


def lowered_with(speedups: str, lower: Callable[[], Any]) -> Any:
    """``lower()`` under ``LOWERCACHE_SPEEDUPS=speedups``."""
    before = os.environ.get("LOWERCACHE_SPEEDUPS")
    os.environ["LOWERCACHE_SPEEDUPS"] = speedups
    try:
        return lower()
    finally:
        if before is None:
            os.environ.pop("LOWERCACHE_SPEEDUPS")
        else:
            os.environ["LOWERCACHE_SPEEDUPS"] = before
