"""Stack summaries whose frames look up their source line when it is first read, as Python's own ``StackSummary.extract``
makes them, instead of at once: the same text, and no line looked up for the frames a tracer's filter drops.

Why it is exact, and figures: docs/speedups.md#stacklines.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Iterator

from .patching import AttributePatch
from .sourcepin import source_digest

# sha256 over the sources of torch's _extract_symbolized_tb, the CapturedTraceback.summary that calls it (torch 2.13.0)
# and the FrameSummary members that make and read a line (Python 3.11.7).
_AUDITED_DIGEST = "c9875db7356599b2c595a3e77db9f69ac9fade46497bb81703b0cfa829e32113"


def _audited_sources() -> list[Any]:
    from torch.utils import _traceback

    frame = traceback.FrameSummary
    return [_traceback._extract_symbolized_tb, _traceback.CapturedTraceback.summary, frame.__init__, frame.__eq__,
            frame.__getitem__, frame.__iter__, frame.line.fget, frame._original_line.fget]


def sources_digest() -> str | None:
    """Digest of the sources whose behaviour this module relies on."""
    return source_digest(*_audited_sources())


def _extract_symbolized_tb(tb: Any, skip: int) -> traceback.StackSummary:
    """torch's ``_extract_symbolized_tb`` with each frame's line left for its first reader (``lookup_line=False``)."""
    stack = traceback.StackSummary()
    for f in reversed(tb[skip:]):
        stack.append(traceback.FrameSummary(f["filename"], f["line"], f["name"], lookup_line=False))
    return stack


def _traceback_module() -> list[Any]:
    """torch's ``_traceback`` module, whose ``summary`` calls the function by its global name; none when the pin differs."""
    from torch.utils import _traceback

    return [_traceback] if sources_digest() == _AUDITED_DIGEST else []


_patch = AttributePatch(_traceback_module, "_extract_symbolized_tb", _extract_symbolized_tb)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


@contextlib.contextmanager
def when_on() -> Iterator[None]:
    """On for the block when the registry has it on: for a model's own export, which runs before a target family's
    hooks (and alone on a warm hit), and makes most of a lowering's stack summaries."""
    from . import registry

    with active() if registry.is_on("stacklines") else contextlib.nullcontext():
        yield
