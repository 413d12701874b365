"""Declared pass-through conditions for ExecuTorch passes without ``target_ops``.

fastcopy trusts a pass with a node when the pass provably hands that node's
op to the base ``call_operator`` unchanged. Arm passes say so with a
``target_ops`` guard that fastcopy reads from the syntax tree. ExecuTorch's
own ``to_edge`` / ``to_executorch`` passes have no such guard; for the ones
that cost the most this registry states the condition, read from their
``call_operator``, as a function of the pass instance and the node.

Each entry is pinned to a digest of the ``call_operator`` source it was read
from: if the installed ExecuTorch differs, the entry does not apply and the
pass is interpreted the stock way.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Callable

Gate = Callable[[Any, Any], bool]  # (pass instance, fx node) -> the op goes to the base unchanged


def _normalize_transpose(module: Any) -> Gate:
    import torch

    return lambda p, n: not (n.target == torch.ops.aten.t.default)


def _replace_broken_ops(module: Any) -> Gate:
    def gate(p: Any, n: Any) -> bool:
        try:
            return not n.target.is_view
        except Exception:  # stock would raise from the same expression: let it
            return False

    return gate


def _memory_format_ops(module: Any) -> Gate:
    edge_op, dim_order_ops = module.EdgeOpOverload, module.DimOrderOpsMap
    return lambda p, n: not (isinstance(n.target, edge_op) and n.target in dim_order_ops)


def _remove_mixed_type(module: Any) -> Gate:
    import torch

    aten = torch.ops.aten
    allow = dict.fromkeys(
        (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.div.Tensor_mode, aten.minimum.default)
    )
    return lambda p, n: len(n.args) <= 1 or n.target not in allow


def _legalize_dim_order(module: Any) -> Gate:
    return lambda p, n: n.target not in p._target_ops


# (module, class) -> (sha256 of the class's call_operator source, gate factory given the module)
REGISTRY: dict[tuple[str, str], tuple[str, Callable[[Any], Gate]]] = {
    ("executorch.exir.passes.normalize_transpose_pass", "NormalizeTransposePass"): (
        "15582fd1c7803f6ac268a67f900ba446f4b71361dd14e0676a283d73fb041414",
        _normalize_transpose,
    ),
    ("executorch.exir.passes.replace_broken_ops_with_function_ops_pass", "ReplaceBrokenOpsWithFunctionalOpsPass"): (
        "003ef8cf927c5270b34d475c73b1a88e3f702dea9681d792b63336b8e318ee6b",
        _replace_broken_ops,
    ),
    ("executorch.exir.passes.memory_format_ops_pass", "MemoryFormatOpsPass"): (
        "69781c022ffac19fa8a99171e23558fd178438ae6535238834635d1ca2f1b155",
        _memory_format_ops,
    ),
    ("executorch.exir.passes.remove_mixed_type_operators", "RemoveMixedTypeOperators"): (
        "c93ec8a5e72fd3f0563f3ac036c9ecb4c78697c13a1c0f0774d7e553a30d0544",
        _remove_mixed_type,
    ),
    ("executorch.exir.passes.legalize_portable_dim_order_pass", "LegalizePortableDimOrderPass"): (
        "0111c295203206c2d37a89df5baf2767cb1bc3b1c18f85e3929aa8078f0acabc",
        _legalize_dim_order,
    ),
}


def source_digest(fn: Any) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def gate_for(klass: type) -> Gate | None:
    """The declared pass-through condition of ``klass.call_operator``, if its source is the one read."""
    entry = REGISTRY.get((klass.__module__, klass.__qualname__))
    fn = klass.__dict__.get("call_operator")
    if entry is None or fn is None:
        return None
    pinned, factory = entry
    if source_digest(fn) != pinned:
        return None
    import sys

    return factory(sys.modules[klass.__module__])
