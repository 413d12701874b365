"""XNNPACK's ``ConvertToLinearPass`` and ``ConvertToSDPAPass`` write no readable dump of the graph for a debug
message their logger drops.

Why it is exact, and figures: docs/speedups.md#debugtext.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .patching import Patch
from .sourcepin import code_of, resolve, source_digest

# The passes' ``call`` methods, which hand ``graph_module.print_readable(print_output=False)`` to ``logger.debug``
# as they begin and end, and torch's print_readable (executorch 1.5.1, torch 2.13.0).
_SITE_NAMES = ("executorch.backends.xnnpack._passes.convert_to_linear:ConvertToLinearPass.call",
               "executorch.backends.xnnpack._passes.convert_to_sdpa:ConvertToSDPAPass.call")
_AUDITED_DIGEST = "5fde8995f506bfa467f7f41ffb3071ea5a9d60b76120707fddad1d9d675502a6"
DROPPED = "<GraphModule: no readable code written for a debug message the logger drops>"
_sites: set[Any] = set()
_originals: dict[str, Any] = {}


def sources_digest() -> str | None:
    """Digest of the two passes' ``call`` and torch's ``GraphModule.print_readable``."""
    from torch.fx.graph_module import GraphModule

    return source_digest(*(resolve(name) for name in _SITE_NAMES), GraphModule.print_readable)


def _dropped(frame: Any, print_output: Any) -> bool:
    """The dump is for one of the sites' ``logger.debug`` calls, and that logger drops debug messages.

    At the sites, ``logger`` (the module's global) and its ``debug`` method are looked up before the argument is
    built, and ``debug`` asks ``isEnabledFor(DEBUG)`` before it reads its message: the same question, asked here
    right before, with nothing run between the two. ExecuTorch sets both loggers to WARNING.
    """
    if print_output is not False or frame is None or frame.f_code not in _sites:
        return False
    logger = frame.f_globals.get("logger")
    return isinstance(logger, logging.Logger) and not logger.isEnabledFor(logging.DEBUG)


def print_readable(self: Any, print_output: bool = True, *args: Any, **kwargs: Any) -> str:
    """torch's ``print_readable``, unless its text would only be dropped (``_dropped``): then a placeholder.

    Stock's text is the graph's verbose code, made from the graph without changing it (node repr functions are
    swapped for the print and restored), so leaving it unmade changes nothing but the message nobody reads.
    """
    if _dropped(sys._getframe(1), print_output):
        return DROPPED
    return _originals["print_readable"](self, print_output, *args, **kwargs)


def _apply() -> None:
    from torch.fx.graph_module import GraphModule

    if sources_digest() != _AUDITED_DIGEST:
        return
    _sites.update(code_of(name) for name in _SITE_NAMES)
    _originals["print_readable"] = GraphModule.__dict__["print_readable"]
    GraphModule.print_readable = print_readable


def _undo() -> None:
    from torch.fx.graph_module import GraphModule

    if "print_readable" in _originals:
        GraphModule.print_readable = _originals.pop("print_readable")
    _sites.clear()


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
