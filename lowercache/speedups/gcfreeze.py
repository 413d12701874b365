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
_kept = False  # the process keeps its heap frozen itself (:func:`freeze_for_children`)


def freeze_for_children() -> None:
    """Collect, then freeze the heap for good: a forking server's children share its pages instead of copying those the
    collector would touch. Its lowerings then leave the freeze alone without asking ``gc.get_freeze_count()``, which
    walks every frozen object (millions in a warm server: 0.02-0.06 s a lowering)."""
    global _kept
    gc.collect()
    gc.freeze()
    _kept = True


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block (docs/speedups.md#gcfreeze)."""
    global _depth, _owned
    with _lock:
        if _depth == 0:
            _owned = not _kept and gc.isenabled() and registry.is_on("gcfreeze") and gc.get_freeze_count() == 0
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
