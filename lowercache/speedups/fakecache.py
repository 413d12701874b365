"""Let FakeTensor's own cache serve the four quantize/dequantize ops whose pinned Meta kernels are pure functions of what its key holds.

Why it is exact, and figures: docs/speedups.md#fakecache.
"""

from __future__ import annotations

import functools
from typing import Any

from .patching import Patch
from .sourcepin import source_digest

_OPS = ("quantize_per_tensor.default", "dequantize_per_tensor.default",
        "quantize_per_channel.default", "dequantize_per_channel.default")
_KERNELS = ("quantize_per_tensor_meta", "dequantize_per_tensor_meta", "quantize_per_channel_meta",
            "dequantize_per_channel_meta", "_quant_min_max_bounds_check")
_REGISTRAR = "torch/ao/quantization/fx/_decomposed.py"
_PINNED = "957225f2a83b46c3049107251806948cdc398ec20f3b17e8377a7cbf7cc5482a"

_originals: dict[str, Any] = {}
_admitted: frozenset = frozenset()


def kernels_digest() -> str | None:
    """Digest of the Meta kernels' sources as installed."""
    import torch.ao.quantization.fx._decomposed as decomposed

    return source_digest(*(getattr(decomposed, name) for name in _KERNELS))


def meta_registered_by_decomposed(dump: str) -> bool:
    """Whether a ``_dispatch_dump`` says the Meta kernel comes from ``_decomposed.py`` and nothing overrides it."""
    lines = [line for line in dump.splitlines() if line.split(":", 1)[0] in ("Meta", "CompositeImplicitAutograd")]
    return len(lines) == 1 and lines[0].startswith("Meta:") and _REGISTRAR in lines[0].replace("\\", "/")


def _eligible(op: Any) -> bool:
    import torch
    from torch._library.simple_registry import singleton

    schema = op._schema
    banned = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view}
    return (
        meta_registered_by_decomposed(torch._C._dispatch_dump(op.name()))
        and singleton.find(op.name()).fake_impl.kernel is None
        and not op.py_kernels
        and not schema.is_mutable
        and all(arg.alias_info is None for arg in (*schema.arguments, *schema.returns))
        and not banned.intersection(op.tags)
    )


@functools.lru_cache(maxsize=1)
def admitted() -> frozenset:
    """The ops served from FakeTensor's cache; empty when anything differs from what was read."""
    import torch
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the ops)

    if kernels_digest() != _PINNED:
        return frozenset()
    ops = []
    for name in _OPS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.quantized_decomposed, packet), overload)
        if not _eligible(op):
            return frozenset()
        ops.append(op)
    return frozenset(ops)


def _validate_cache_key(self: Any, func: Any, args: Any, kwargs: Any) -> None:
    if func in _admitted:
        return  # every other refusal of _validate_cache_key was ruled out for these ops in _eligible
    return _originals["validate"](self, func, args, kwargs)


def _apply() -> None:
    global _admitted
    from torch._subclasses.fake_tensor import FakeTensorMode

    _admitted = admitted()
    _originals.setdefault("validate", FakeTensorMode._validate_cache_key)
    FakeTensorMode._validate_cache_key = _validate_cache_key


def _undo() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # The original stays in ``_originals``: a dispatch still running in another thread calls through it.
    FakeTensorMode._validate_cache_key = _originals["validate"]
    # A lookup does not validate, so entries made while enabled would keep
    # serving these ops to stock code in this process: drop them.
    cache = FakeTensorMode.cache
    for key in list(cache):
        if key.key[0] in _admitted:
            cache.pop(key, None)


_patch = Patch(_apply, _undo)
enable = _patch.enable
"""Serve the admitted quantize/dequantize ops from FakeTensor's cache (reference counted, thread-safe)."""
disable = _patch.disable
