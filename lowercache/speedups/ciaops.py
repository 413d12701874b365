"""Collect torch's CompositeImplicitAutograd operators with one registry walk per collection, since the first walk materializes every operator the others would find.

Why it is exact, and figures: docs/speedups.md#ciaops.
"""

from __future__ import annotations

import threading
from typing import Any

from .sourcepin import source_digest
from .patching import Patch

# sha256 over the sources of _collect_all_valid_cia_ops, _collect_all_valid_cia_ops_for_namespace
# and _materialize_cpp_cia_ops in torch._export.utils (torch 2.13.0).
_AUDITED_DIGEST = "d468ced7e7e40ff8ac9dbb392048c07aa022912e9d83df0a245b13f5cbd6abde"
# The modules that hold ``_collect_all_valid_cia_ops`` under its own name (imported by name).
_HOLDERS = ("torch._export.utils", "torch.export.decomp_utils", "torch.export.exported_program")
_originals: dict[str, Any] = {}
_tls = threading.local()


def sources_digest() -> str | None:
    """Digest of the torch sources whose behaviour this module relies on."""
    from torch._export import utils

    return source_digest(utils._collect_all_valid_cia_ops, utils._collect_all_valid_cia_ops_for_namespace, utils._materialize_cpp_cia_ops)


def _collect() -> Any:
    outer = getattr(_tls, "walked", None)
    _tls.walked = False
    try:
        return _originals["collect"]()
    finally:
        _tls.walked = outer


def _materialize() -> None:
    walked = getattr(_tls, "walked", None)
    if walked:
        return  # this collection has walked the registry already
    _originals["materialize"]()
    if walked is not None:
        _tls.walked = True


def _modules() -> list[Any]:
    import importlib

    return [importlib.import_module(name) for name in _HOLDERS]


def _apply() -> None:
    try:
        ok = sources_digest() == _AUDITED_DIGEST
    except AttributeError:  # a torch without these functions
        ok = False
    if not ok:
        return
    modules = _modules()
    utils = modules[0]
    _originals["collect"] = utils._collect_all_valid_cia_ops
    _originals["materialize"] = utils._materialize_cpp_cia_ops
    for module in modules:
        if getattr(module, "_collect_all_valid_cia_ops", None) is _originals["collect"]:
            module._collect_all_valid_cia_ops = _collect
            _originals.setdefault("holders", []).append(module)
    utils._materialize_cpp_cia_ops = _materialize


def _undo() -> None:
    if "collect" not in _originals:
        return
    for module in _originals.pop("holders", []):
        module._collect_all_valid_cia_ops = _originals["collect"]
    _modules()[0]._materialize_cpp_cia_ops = _originals["materialize"]
    _originals.clear()


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


def enabled() -> bool:
    """Whether the patch is installed right now."""
    import sys

    utils = sys.modules.get("torch._export.utils")
    return utils is not None and utils._materialize_cpp_cia_ops is _materialize
