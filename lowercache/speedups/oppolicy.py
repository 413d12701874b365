"""Which operator calls a retrace may serve from a recorded value, and what each call dispatches.

An op qualifies when calling it twice on equal fake inputs must give equal
fake outputs: a functional ATen-family op (no mutation, no data-dependent or
seeded output, no write alias) whose outputs are all tensors. Shared by the
retrace shim (``retrace.py``) and the delegate-call description
(``delegatecall.py``).
"""

from __future__ import annotations

import functools
from typing import Any

_ALLOWED_NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed", "dim_order_ops", "tosa"})

# op target -> None when ineligible, else (result may alias an input, fake kernel reads the TOSA
# context, the op the call dispatches: see _kernel).
_op_policy: dict[Any, tuple[bool, bool, Any] | None] = {}


def policy(target: Any) -> tuple[bool, bool, Any] | None:
    """None when ``target`` must always be dispatched, else ``(may_alias, reads_tosa_context, kernel)``."""
    try:
        return _op_policy[target]
    except KeyError:
        pass
    except TypeError:  # unhashable target
        return None
    _op_policy[target] = result = _compute_policy(target)
    return result


def _compute_policy(target: Any) -> tuple[bool, bool, Any] | None:
    import torch
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    op = target._op if isinstance(target, EdgeOpOverload) else target
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if op.namespace not in _ALLOWED_NAMESPACES:
        return None
    schema = op._schema
    if schema.is_mutable:
        return None
    banned = {
        torch.Tag.data_dependent_output,
        torch.Tag.dynamic_output_shape,
        torch.Tag.nondeterministic_seeded,
        torch.Tag.inplace_view,
        torch.Tag.maybe_aliasing_or_mutating,
    }
    if banned.intersection(op.tags):
        return None
    if not schema.returns:
        return None
    aliases = False
    for ret in schema.returns:
        rtype = ret.type
        if isinstance(rtype, torch._C.ListType):
            rtype = rtype.getElementType()
        if not isinstance(rtype, torch._C.TensorType):
            return None
        if ret.alias_info is not None:
            if ret.alias_info.is_write:
                return None
            aliases = True
    return aliases, op.namespace == "tosa", _kernel(target)


def _kernel(target: Any) -> Any:
    """What calling ``target`` dispatches: an edge op's ATen op, when its call only forwards to it.

    ``EdgeOpOverload.__call__`` is ``return self._op(*args, **kwargs)``, so a
    dispatch of an edge op is a dispatch of its ATen op: records are kept by
    the latter, and a retrace that turns ``aten.X`` into ``edge.aten.X``
    (``to_edge``'s op replacement) can reuse what the ATen op computed.
    """
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    if type(target) is not EdgeOpOverload or not _edge_call_forwards():
        return target
    return target._op


@functools.cache
def _edge_call_forwards() -> bool:
    """Whether ``EdgeOpOverload.__call__`` is exactly the forwarding line (read once per process)."""
    import inspect
    import textwrap

    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    call = textwrap.dedent(inspect.getsource(EdgeOpOverload.__call__))
    return call == "def __call__(self, *args, **kwargs):\n    return self._op(*args, **kwargs)\n"
