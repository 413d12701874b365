"""``lowercache run``'s hook in the wrapped process: each target family's steps cached once the script imports them.

The ``sitecustomize`` that ``lowercache run`` puts on the command's
PYTHONPATH (``run/_site``) installs an import hook, so that when the script
imports a family's backend (``Family.hook_modules``: ExecuTorch's TOSA
backend and Vela for Arm, ``XnnpackBackend`` for XNNPACK), the family's
hooks module wraps them (``install_permanently``: the TOSA preprocess and
Vela steps, each XNNPACK partition's preprocess) and they record into one
session for the process. Nothing is imported until the script itself
imports the backend. The same ``sitecustomize`` starts the command-level
recorder (``run/replay.py``) that lets a later unchanged run be replayed
without running the script.
"""

from __future__ import annotations

import atexit
import importlib.abc
import logging
import sys
from typing import Any


def _inside(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _initializing(finished: str, packages: tuple[str, ...]) -> bool:
    """Whether a module of ``packages`` other than ``finished`` is still executing (imported half way)."""
    return any(
        name != finished and _inside(name, packages) and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls back once a watched module, and the import of its package it was part of, has finished executing.

    A hook module can finish while the module of its package that imported
    it is still executing (a script that imports Arm's ``tosa.partitioner``
    first imports ``tosa.backend`` half way through it); installing then
    would import the half-made partitioner and fail the script. So every
    module of the watched ``packages`` is followed while a watched one is
    outstanding, and the callback waits until none of them is half imported.
    """

    def __init__(self, watched: tuple[str, ...], packages: tuple[str, ...], callback: Any):
        self.watched = set(watched)
        self.packages = packages
        self.pending: list[str] = []
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if not (self.watched or self.pending) or not _inside(fullname, self.packages):
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(module, _original=original_exec):
                    _original(module)
                    self._finished(module.__name__)

                loader.exec_module = exec_module
                return spec
        return None

    def _finished(self, name: str) -> None:
        if name in self.watched:
            self.watched.discard(name)
            self.pending.append(name)
        if self.pending and not _initializing(name, self.packages):
            ready, self.pending = self.pending, []
            for module_name in ready:
                try:
                    self.callback(module_name)
                except Exception as e:  # never fail the script's import because of the cache
                    logging.getLogger("lowercache").warning("caching is off for this process (%s)", e)
                    return


_session: list[Any] = []


def _process_session() -> Any:
    if not _session:
        from ..api import open_store
        from ..config import load_settings
        from ..cache.steps import Session

        store = open_store(load_settings())
        session = Session(store)
        _session.append(session)
        if store is not None:
            atexit.register(store.close)
            atexit.register(session.flush_counts)
    return _session[0]


def activate_in_process() -> None:
    """Arrange for every target family's hook modules to be wrapped (by the family's hooks) when (or if) they are imported."""
    import importlib

    from ..targets import FAMILIES

    hooked_by = {m: f.hooks for f in FAMILIES for m in f.hook_modules}

    def on_import(name: str) -> None:
        from ..cache import steps

        from ..config import load_settings
        from ..speedups import registry

        from ..lowering import reexport

        registry.select(load_settings().speedups)
        steps.set_fallback(_process_session)
        importlib.import_module(hooked_by[name]).install_permanently(name)
        if not reexport.script_patch.originals:
            from . import ahead

            reexport.run_ahead_with(ahead)
            reexport.script_patch.enable()  # the script's own re-export after convert_pt2e, as a step

    already = [m for m in hooked_by if m in sys.modules]
    for name in already:
        on_import(name)
    packages = tuple(dict.fromkeys(f.package for f in FAMILIES if f.hook_modules))
    sys.meta_path.insert(0, _AfterImport(tuple(m for m in hooked_by if m not in already), packages, on_import))
