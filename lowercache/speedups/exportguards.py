"""Skip common-subexpression elimination in the guard code a strict export builds and drops uncalled, so the guards and their errors stay stock's.

Why it is exact, and figures: docs/speedups.md#exportguards.
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
