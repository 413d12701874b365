"""Keep the garbage collector's full passes off the objects a lowering starts with.

A lowering allocates millions of short-lived objects (FX nodes, metadata
dicts, fake tensors), which trigger full (generation 2) collections, and each
full collection walks every tracked object in the process: torch's and
ExecuTorch's modules, the caller's model, whatever else the caller holds.
Measured on MobileNetV2 (Ethos-U55, one block edited): 3 full collections took
0.84 s of a 7.8 s lowering; with the starting objects frozen, 6 took 0.17 s.

``gc.freeze()`` moves the objects alive at the start into the permanent
generation, which collections skip; objects the lowering creates are
collected as usual, and ``gc.unfreeze()`` hands the frozen ones back at the
end. This changes when cyclic garbage among the starting objects is reclaimed
(after the lowering instead of during it), never what the lowering computes.

Nested and concurrent lowerings share one freeze. A process whose collector
is disabled, or that froze objects itself (``gc.get_freeze_count() > 0``,
e.g. before forking workers), is left alone: unfreezing would undo its freeze.
Off with ``LOWERCACHE_SPEEDUPS=all,-gcfreeze`` (``registry.py``).
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
    """Freeze the objects alive now for the duration of the block (see module docstring)."""
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
