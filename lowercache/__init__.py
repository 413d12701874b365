"""lowercache: incremental, caching lowering of PyTorch models to Arm targets.

``lowercache.lower(...)`` and ``with lowercache.cached(...)`` are the API (see
:mod:`lowercache.api`). They load lazily, so importing ``lowercache`` alone
does not import torch (``lowercache run`` relies on that).
"""

import sys
from typing import Any

# The modules in this process before any of lowercache ran: the standard library's, and those the interpreter's
# start-up imported (``.pth`` lines, ``sitecustomize``, ``usercustomize``), part of its start-up state (``startup.py``).
STARTED_WITH = tuple(sys.modules)
__version__ = "0.1.0"
__all__ = ["lower", "cached", "write_artifacts", "LowercacheError"]


def __getattr__(name: str) -> Any:
    if name in ("lower", "cached", "write_artifacts"):
        from . import api

        return getattr(api, name)
    if name == "LowercacheError":
        from .errors import LowercacheError

        return LowercacheError
    raise AttributeError(f"module 'lowercache' has no attribute {name!r}")
