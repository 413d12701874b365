"""Skip common-subexpression elimination in guard code that a strict export builds and then drops.

A strict ``torch.export`` (dynamo's; aot_arm_compiler's default) ends its
capture with ``_suggest_or_raise_constraint_violation``. That function builds
the frame's guards (``build_guards``) for one reason: producing the shape
guards raises ``ConstraintViolationError`` when a dimension declared dynamic
was specialized. The guard manager it builds is never called, because export
skips dynamo's guard sanity check, and it is dropped on return.

Building it still generates Python code for the shape guards, and
``build_guard_function`` first runs a CSE pass (``PyExprCSEPass``) that
unparses every sub-expression of every guard. Export keeps static shapes, so
there is one guard per dimension of every parameter. On MobileNetV2 this pass
is 0.75 s of a 2.4 s export, and 0.35 s of the 2.1 s re-export after
``convert_pt2e``.

While installed, and only inside that call, ``build_guard_function`` emits
the guard function without CSE. This is the same if-chain dynamo falls back
to itself when the pass hits the recursion limit. The shape guards are
produced as before, so a constraint violation raises as before. What changes
is the text of a function nobody calls, visible only in dynamo's debug log
(``TORCH_LOGS=guards``). The four torch functions involved are pinned by a
source digest (``registry.py``).
"""

from __future__ import annotations

import threading
from typing import Any

from .patching import Patch

_originals: dict[str, Any] = {}
_tls = threading.local()


def _guard_function_without_cse(code_parts: list[str], closure_args: str) -> tuple[str, str]:
    """``build_guard_function``'s output with an identity ``replace``, as on its RecursionError path."""
    from torch._inductor.utils import IndentedBuffer

    guard_body = IndentedBuffer()
    for expr in code_parts:
        guard_body.writeline(f"if not ({expr}):")
        with guard_body.indent():
            guard_body.writeline("return False")
    guard = IndentedBuffer()
    guard.writeline("def guard(L):")
    with guard.indent():
        guard.splice(guard_body)
        guard.writeline("return True")
    make_guard_fn = IndentedBuffer()
    make_guard_fn.writeline(f"def ___make_guard_fn({closure_args}):")
    with make_guard_fn.indent():
        make_guard_fn.splice(guard)
        make_guard_fn.writeline("return guard")
    return guard_body.getvalue(), make_guard_fn.getvalue()


def _build_guard_function(code_parts: list[str], closure_args: str) -> tuple[str, str]:
    if getattr(_tls, "discarded", False):
        return _guard_function_without_cse(code_parts, closure_args)
    return _originals["build"](code_parts, closure_args)


def _constraint_check(*args: Any, **kwargs: Any) -> None:
    outer = getattr(_tls, "discarded", False)
    _tls.discarded = True
    try:
        return _originals["check"](*args, **kwargs)
    finally:
        _tls.discarded = outer


def _apply() -> None:
    from torch._dynamo import functional_export, guards

    _originals["build"] = guards.build_guard_function
    _originals["check"] = functional_export._suggest_or_raise_constraint_violation
    guards.build_guard_function = _build_guard_function
    functional_export._suggest_or_raise_constraint_violation = _constraint_check


def _undo() -> None:
    from torch._dynamo import functional_export, guards

    guards.build_guard_function = _originals.pop("build")
    functional_export._suggest_or_raise_constraint_violation = _originals.pop("check")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


def enabled() -> bool:
    """Whether the patch is installed right now."""
    import sys

    guards = sys.modules.get("torch._dynamo.guards")
    return guards is not None and guards.build_guard_function is _build_guard_function
