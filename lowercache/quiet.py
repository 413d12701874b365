"""Third-party noise kept out of lowercache's own output.

Importing torch, torchao and ExecuTorch's Arm backend, and lowering through
them, prints screens of warnings that are not the user's to act on: torchao's
CUDA extensions failing to load on a CPU machine, pytree deprecations,
FutureWarnings from inside torch. The CLI captures them (Python warnings, and
log records below ERROR from third-party loggers); ``-v`` prints each distinct
one once at the end.
lowercache's own lines, errors and anything at ERROR or above pass through.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Iterator

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
THIRD_PARTY = ("torch", "torchao", "executorch", "tosa", "tosa_tools", "ethosu", "transformers", "numpy")


class Noise:
    """What was held back, in order, each distinct line once."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[str] = set()

    def add(self, line: str) -> None:
        if line not in self._seen:
            self._seen.add(line)
            self.lines.append(line)


class _Divert(logging.Filter):
    """Holds back third-party warnings from a handler (ERROR and above, and what it would not print anyway, pass)."""

    def __init__(self, noise: Noise, handler: logging.Handler):
        super().__init__()
        self.noise = noise
        self.floor = max(handler.level, logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.floor <= record.levelno < logging.ERROR or record.name.split(".")[0] not in THIRD_PARTY:
            return True
        self.noise.add(f"{record.levelname.lower()} ({record.name}): {record.getMessage()}")
        return False


def _handlers() -> set[logging.Handler]:
    """Every handler a third-party record can reach: root's, lastResort, and the third-party loggers' own."""
    found = set(logging.root.handlers)
    if logging.lastResort is not None:
        found.add(logging.lastResort)
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in THIRD_PARTY:
            found.update(logging.getLogger(name).handlers)
    return found


_inherited: list[str] = []


def inherit(lines: list[str]) -> None:
    """Count lines held back before this process's command began as its own: a server's child, whose imports the server made."""
    _inherited[:] = lines


@contextlib.contextmanager
def captured(import_torch: bool = False) -> Iterator[Noise]:
    """Hold back third-party warnings for the block. ``import_torch`` first, so torch's own log handler exists to filter."""
    noise = Noise()
    for line in _inherited:
        noise.add(line)
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if os.path.abspath(str(filename)).startswith(_PACKAGE_DIR):
            previous(message, category, filename, lineno, file, line)
        else:
            noise.add(f"{category.__name__}: {message}")

    warnings.showwarning = show
    diverts: dict[logging.Handler, _Divert] = {}
    try:
        if import_torch:
            import torch  # noqa: F401  (creates torch's logger and its handler)
        for handler in _handlers():
            diverts[handler] = _Divert(noise, handler)
            handler.addFilter(diverts[handler])
        yield noise
    finally:
        for handler, divert in diverts.items():
            handler.removeFilter(divert)
        warnings.showwarning = previous


def print_held_back(noise: Noise, verbose: bool) -> None:
    """``-v``: every held-back line. Without it nothing: a failure's one line names its cause, and torch's import-time
    warnings are not it."""
    if verbose and noise.lines:
        print(f"lowercache: {len(noise.lines)} third-party warning(s) held back:", file=sys.stderr)
        for line in noise.lines:
            print(f"  {line}", file=sys.stderr)
