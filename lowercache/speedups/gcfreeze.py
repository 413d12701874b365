"""Freeze the objects alive when a lowering starts, so full collections skip them; only when their cyclic garbage is reclaimed changes.

Why it is exact, and figures: docs/speedups.md#gcfreeze.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

from . import registry

_lock = threading.Lock()
_depth = 0
_owned = False


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block (docs/speedups.md#gcfreeze)."""
    global _depth, _owned
    with _lock:
        if _depth == 0:
            _owned = gc.isenabled() and gc.get_freeze_count() == 0 and registry.is_on("gcfreeze")
            if _owned:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _owned:
                gc.unfreeze()
                _owned = False
