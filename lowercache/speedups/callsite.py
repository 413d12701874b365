"""``traceback.format_stack()[-2]`` for ExecuTorch's three node-stamping sites, formatting only the one frame they keep, which gives the same text.

Why it is exact, and figures: docs/speedups.md#callsite.
"""

from __future__ import annotations

import sys
import traceback
import types
from typing import Any

from .sourcepin import source_digest
from .patching import Patch

# (module, function qualname) of each call site, and sha256 of their sources plus
# traceback's own functions that make the full list (executorch 1.5.1, Python 3.11.7).
_SITES = (
    ("executorch.backends.arm._passes.arm_pass", "ArmPass.call_operator"),
    ("executorch.backends.arm._passes.arm_pass_utils", "create_node"),
    ("executorch.backends.transforms.aten_to_dialect_pass", "AtenToDialectPass.call"),
)
_AUDITED_DIGEST = "8a3f1368a2166e28aefa3e505dba3d5e887ac1a5e94b2060259c95a74ffd307e"

_codes: set[Any] = set()
_modules: list[Any] = []


def _functions() -> list[Any]:
    import importlib

    found = []
    for module_name, qualname in _SITES:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        found.append(obj)
    return found


def _audited_sources() -> list[Any]:
    """The call sites, and the traceback functions whose output the fast path reproduces."""
    return [
        *_functions(),
        traceback.format_stack,
        traceback.extract_stack,
        traceback.walk_stack,
        traceback.format_list,
        traceback.StackSummary.extract,
        traceback.StackSummary._extract_from_extended_frame_gen,
        traceback.StackSummary.format,
    ]


def sources_digest() -> str | None:
    return source_digest(*_audited_sources())


def _same(a: Any, b: Any) -> bool:
    """Whether ``format`` would take frames ``a`` and ``b`` as the same line (file, line number, name)."""
    return a.f_code.co_filename == b.f_code.co_filename and a.f_lineno == b.f_lineno and a.f_code.co_name == b.f_code.co_name


def caller_line(frame: Any) -> str | None:
    """``traceback.format_stack(frame)[-2]``, formatting one frame; None where that needs the whole stack."""
    if getattr(sys, "tracebacklimit", None) is not None:
        return None
    caller = frame.f_back
    if caller is None or _same(frame, caller):
        return None
    run, f = 1, caller.f_back
    while f is not None and run <= traceback._RECURSIVE_CUTOFF and _same(f, caller):
        run, f = run + 1, f.f_back
    if run > traceback._RECURSIVE_CUTOFF:
        return None
    (line,) = traceback.StackSummary.extract(iter([(caller, caller.f_lineno)])).format()
    return line


class _CallerLine:
    """What the call sites index: ``[-2]`` only (their pinned source does nothing else)."""

    __slots__ = ("_line",)

    def __init__(self, line: str):
        self._line = line

    def __getitem__(self, index: int) -> str:
        if index != -2:
            raise IndexError(index)
        return self._line


def format_stack(f: Any = None, limit: Any = None) -> Any:
    """``traceback.format_stack``; from a call site, only the frame it keeps is formatted."""
    frame = sys._getframe(1)
    if f is None and limit is None and frame.f_code in _codes:
        line = caller_line(frame)
        if line is not None:
            return _CallerLine(line)
    return traceback.format_stack(frame if f is None else f, limit)


def _shim() -> types.ModuleType:
    """A copy of the ``traceback`` module with :func:`format_stack` in place of its own."""
    shim = types.ModuleType("traceback")
    shim.__dict__.update(traceback.__dict__)
    shim.format_stack = format_stack
    return shim


def _apply() -> None:
    try:
        ok = sources_digest() == _AUDITED_DIGEST
    except (OSError, TypeError, AttributeError, ImportError):
        ok = False
    if not ok:
        return
    shim = _shim()
    for fn, (module_name, _) in zip(_functions(), _SITES):
        module = sys.modules[module_name]
        if module.__dict__.get("traceback") is traceback:
            _codes.add(fn.__code__)
            module.traceback = shim
            _modules.append(module)


def _undo() -> None:
    for module in _modules:
        module.traceback = traceback
    _modules.clear()
    _codes.clear()


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
