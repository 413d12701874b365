"""A lowering's inputs as named on a command line, checked without importing torch: the MODEL argument
(``path/to/file.py:factory`` or a saved ``.pt2``) names a file, and the target (with Vela's options) is known.

Loading and the target registry check them again; asked first, a mistyped path or target fails at once, before torch is
imported or a server is started.
"""

from __future__ import annotations

import os
from typing import Optional


def model_problem(spec: str) -> Optional[str]:
    """Why ``spec`` names no model file (the message ``lower`` prints), or None when the file is there."""
    if spec.endswith(".pt2"):
        return None if os.path.isfile(spec) else f"saved program not found: {spec}"
    path, sep, factory = spec.rpartition(":")
    if not sep or not path or not factory:
        return f"bad model {spec!r}; expected path/to/file.py:factory or a .pt2 file"
    if not os.path.isfile(path):
        return f"model file not found: {path}"
    return None


def problem(model: str, target: str, system_config: Optional[str] = None, memory_mode: Optional[str] = None) -> Optional[str]:
    """The one line a ``lower`` or ``verify`` of these inputs fails with before lowering anything, or None."""
    from .errors import LowercacheError
    from .targets import resolve

    found = model_problem(model)
    if found is not None:
        return found
    try:
        resolve(target, system_config=system_config, memory_mode=memory_mode)
    except LowercacheError as e:
        return str(e)
    return None
