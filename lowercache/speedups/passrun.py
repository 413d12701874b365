"""One wrapper on XNNPACK's pass manager run for every speed-up that keeps state for the length of one run.

``checkskip`` and ``retraceskip`` each remember what they saw while ``XNNPACKPassManager.transform`` runs and forget it
after. Each wrapping ``transform`` itself made the order of their undos matter (the first undone put back what it had
found, over the other's wrapper) and put one speed-up's wrapper where the other pins stock's source. Here each adds a
scope by name: the wrapper is installed with the first scope and removed with the last, and :func:`original` is stock's
``transform`` whatever is installed.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager

_lock = threading.Lock()
_scopes: dict[str, Callable[[Any], ContextManager[None]]] = {}
_stock: list[Any] = []  # XNNPACKPassManager.transform while the wrapper is installed


def add(name: str, scope: Callable[[Any], ContextManager[None]]) -> None:
    """Enter ``scope(manager)`` around every run of XNNPACK's pass manager until :func:`remove` of ``name``."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    with _lock:
        if not _scopes:
            _stock.append(XNNPACKPassManager.transform)
            XNNPACKPassManager.transform = _transform
        _scopes[name] = scope


def remove(name: str) -> None:
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    with _lock:
        if _scopes.pop(name, None) is not None and not _scopes:
            XNNPACKPassManager.transform = _stock.pop()


def original() -> Any:
    """Stock's ``XNNPACKPassManager.transform``, for a pin of its source."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    with _lock:
        return _stock[-1] if _stock else XNNPACKPassManager.transform


def _transform(self: Any) -> Any:
    with contextlib.ExitStack() as stack:
        for scope in list(_scopes.values()):
            stack.enter_context(scope(self))
        return _stock[-1](self)
