"""Digests of what a TOSA pipeline is built from besides the program: the compile spec and registered pass insertions.

Shared by the TOSA step's key (``arm.py``), the flow's and the quantization
stage's keys, and the keys of region states (``regionsplice.py``).
"""

from __future__ import annotations

import copy
from typing import Any

from ..cache.hashing import canon
from ..cache.digests import digest_json


def compile_spec_digest(spec: Any) -> str:
    """Digest of a compile spec as ExecuTorch serializes it (key/value bytes)."""
    return digest_json(canon([(cs.key, cs.value) for cs in _spec_list(spec)]))


def _spec_list(spec: Any) -> list[Any]:
    """``spec._to_list()``, also for a spec ExecuTorch 1.4 parsed back from its list.

    ExecuTorch 1.4's ``_from_list`` keeps ``output_order_workaround`` as the
    decoded string (``''`` for False), on which its ``_to_list`` raises; the
    backend reads only its truth value, so the spec is serialized with that.
    """
    try:
        return spec._to_list()
    except TypeError:
        workaround = getattr(spec, "output_order_workaround", None)
        if not isinstance(workaround, str):
            raise
        normalized = copy.copy(spec)
        normalized.output_order_workaround = bool(workaround)
        return normalized._to_list()


def pass_insertions_digest() -> str | None:
    """Globally registered pass insertions change the pipeline: None when any exist.

    Registered passes are arbitrary user objects, so a step that would run
    them is not keyed (it runs uncached) rather than keyed on a guess.
    """
    import sys

    manager = sys.modules.get("executorch.backends.arm._passes.arm_pass_manager")
    if manager is None:
        return "none"  # not imported yet, so nothing can have been registered
    return None if manager._registered_pass_insertions else "none"
