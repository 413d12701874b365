"""The XNNPACK integration: what the flow asks a family's backend module, for ExecuTorch's XNNPACK backend.

No hook point is wrapped yet: an XNNPACK lowering is cached as the whole
flow and its quantization stage (``quantize.py``), and runs stock code
inside them, with no speed-up installed. The key parts that are
XNNPACK's own: the partitioner's configuration (:func:`compile_spec_digest`)
and the backend's sources, its flatbuffer schema included
(:func:`backend_source_parts`), which the common toolchain part does not hash.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from ..speedups.patching import Patch
from ..targets.xnnpack import QUANTIZER_MODULE, XNNPACK_MODULE
from ..cache.digests import digest_json
from ..cache.toolchain import source_digest

BACKEND_SOURCES = (".py", ".fbs")  # the delegate's payload is serialized with the backend's own schema


def compile_spec_digest(spec: Any) -> str:
    """Digest of the partitioner ``spec`` (its keyword arguments) makes: its configs and their enabled precisions, its
    mode, and the compile specs it hands the backend. What each config accepts is the backend's code (its source part)."""
    from ..targets.xnnpack import FAMILY

    partitioner = FAMILY.partitioner(None, spec)  # type: ignore[arg-type]  # the target is not read
    return digest_json({
        "partitioner": type(partitioner).__qualname__,
        "arguments": sorted(spec),
        "configs": [[name, type(c).__module__ + "." + type(c).__qualname__, sorted(str(p) for p in c.enabled_precision_types)]
                    for name, c in partitioner.target_partitioner_configs.items()],
        "per_op_mode": bool(partitioner.per_op_mode),
        "backend": partitioner.delegation_spec.backend_id,
        "compile_specs": [[cs.key, cs.value.hex()] for cs in partitioner.delegation_spec.compile_specs],
    })


def pass_insertions_digest() -> str:
    """XNNPACK has no registry of user pass insertions: its pass list is the backend's code."""
    return "none"


def spec_after_quantize(spec: Any) -> None:
    """The stock quantization stage leaves XNNPACK's partitioner arguments as they were: nothing to reproduce."""


def import_quantizer() -> None:
    """Import what the stock quantization stage imports, which a hit on the stage skips: the XNNPACK quantizer."""
    importlib.import_module(QUANTIZER_MODULE)


def backend_source_parts() -> dict[str, str]:
    """The XNNPACK backend's sources (Python and flatbuffer schema): a local patch misses though the version is the same."""
    spec = importlib.util.find_spec("executorch")
    root = os.path.join(list(spec.submodule_search_locations or [])[0], "backends", "xnnpack") if spec else ""
    return {"xnnpack_backend_src": source_digest(root, suffixes=BACKEND_SOURCES)}


def import_backend() -> None:
    """Import the XNNPACK backend (seconds in a new process): only on a miss."""
    importlib.import_module(XNNPACK_MODULE)
    importlib.import_module("executorch.backends.xnnpack.partition.xnnpack_partitioner")


def _nothing() -> None:
    """No hook point and no speed-up is installed for XNNPACK yet."""


_hooks = Patch(_nothing, _nothing)
hooks = _hooks.active


def install_permanently(module_name: str) -> None:
    """``lowercache run`` wraps no XNNPACK module yet (the family lists no hook module)."""
