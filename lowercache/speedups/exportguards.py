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

While installed, and only inside that call, torch's CSE pass keeps every
expression as written, so ``build_guard_function`` emits the plain if-chain
it falls back to itself when the pass hits the recursion limit. The shape
guards are produced as before, so a constraint violation raises as before.
What changes is the text of a function nobody calls, visible only in
dynamo's debug log (``TORCH_LOGS=guards``). The torch code involved is
pinned by a source digest (``registry.py``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from .patching import Patch

_originals: dict[str, Any] = {}
_tls = threading.local()


def _dropping_now() -> bool:
    """Whether this thread is inside a strict export's constraint check (its guards are dropped)."""
    return getattr(_tls, "dropping", False)


@contextlib.contextmanager
def _dropping() -> Iterator[None]:
    outer = _dropping_now()
    _tls.dropping = True
    try:
        yield
    finally:
        _tls.dropping = outer


def _constraint_check(*args: Any, **kwargs: Any) -> None:
    with _dropping():
        return _originals["check"](*args, **kwargs)


def _scoped_cse_pass(stock: type) -> type:
    """Torch's ``PyExprCSEPass``, except that inside a constraint check it counts nothing and replaces nothing."""

    class ScopedCSEPass(stock):  # type: ignore[misc, valid-type]
        def count(self, exprs: list[str]) -> None:
            if not _dropping_now():
                super().count(exprs)

        def replace(self, expr: str) -> tuple[list[str], str]:
            return ([], expr) if _dropping_now() else super().replace(expr)

    return ScopedCSEPass


def _apply() -> None:
    from torch._dynamo import functional_export, guards

    _originals["pass"] = guards.PyExprCSEPass
    _originals["check"] = functional_export._suggest_or_raise_constraint_violation
    guards.PyExprCSEPass = _scoped_cse_pass(guards.PyExprCSEPass)
    functional_export._suggest_or_raise_constraint_violation = _constraint_check


def _undo() -> None:
    from torch._dynamo import functional_export, guards

    guards.PyExprCSEPass = _originals.pop("pass")
    functional_export._suggest_or_raise_constraint_violation = _originals.pop("check")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


def enabled() -> bool:
    """Whether the patch is installed right now."""
    import sys

    guards = sys.modules.get("torch._dynamo.guards")
    return guards is not None and guards.PyExprCSEPass.__module__ == __name__
