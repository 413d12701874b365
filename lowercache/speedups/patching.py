"""Reference-counted monkeypatches: applied on the first enable, undone on the last disable.

lowercache changes ExecuTorch's behaviour only by wrapping functions, and
only while a lowering needs it; nested and concurrent users share one patch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable, Iterator


class Patch:
    """A patch with an ``apply`` and an ``undo``, both run under a lock."""

    def __init__(self, apply: Callable[[], None], undo: Callable[[], None]):
        self._apply = apply
        self._undo = undo
        self._lock = threading.Lock()
        self._depth = 0

    def enable(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._apply()
            self._depth += 1

    def disable(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._undo()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.enable()
        try:
            yield
        finally:
            self.disable()


class AttributePatch(Patch):
    """Sets attribute ``name`` of every object ``owners()`` returns to ``value``
    while enabled, and restores the originals (kept in ``originals``, by owner,
    as ``getattr`` returns them) on the last disable. ``owners`` is called at
    apply time, so the modules or classes it names are imported only when the
    patch is first needed. What is restored is the owner's own entry (a
    classmethod or staticmethod stays one; an inherited attribute is inherited
    again), not the bound value in ``originals``."""

    def __init__(self, owners: Callable[[], Iterable[Any]], name: str, value: Any):
        self.originals: dict[Any, Any] = {}
        entries: dict[Any, Any] = {}

        def apply() -> None:
            for owner in owners():
                self.originals[owner] = getattr(owner, name)
                entries[owner] = vars(owner).get(name, _INHERITED)
                setattr(owner, name, value)

        def undo() -> None:
            for owner, entry in entries.items():
                if entry is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, entry)
            self.originals.clear()
            entries.clear()

        super().__init__(apply, undo)


_INHERITED = object()


class Counters:
    """What a speed-up did since the last reset, by name: counted from any thread, read as one snapshot."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0)

    def count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            for name in self._counts:
                self._counts[name] = 0
