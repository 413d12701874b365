"""Let FakeTensor's own dispatch cache serve the quantize/dequantize ops.

FakeTensorMode caches the output metadata of an op call keyed by the op, the
arguments' metadata and literals, and the dispatch state, and on a hit
builds a fresh FakeTensor with that metadata instead of running the op's
fake kernel. It refuses every op that is not built into torch
(``_validate_cache_key``: "non-builtin"), since a custom op's kernel may read
global state. That refusal covers ``quantized_decomposed.*``, which is every
other node of a quantized graph: on a DeiT-tiny Ethos-U55 lowering 49,306
dispatches bypassed the cache for it, about 0.1 ms each.

Four of those ops are admitted here, each only after checking, when the
patch is first enabled, that the op is what was read:

- its Meta kernel (the one FakeTensor runs) is registered by
  ``torch/ao/quantization/fx/_decomposed.py`` (the dispatcher's own record),
  with no fake impl, no Python kernels and no CompositeImplicitAutograd
  kernel overriding it;
- the schema is functional (not mutable, no alias annotations) and carries
  none of the tags for which FakeTensor refuses builtin ops;
- the sources of the four Meta kernels and the bounds check they call hash
  to the pinned digest (torch 2.13.0). Those kernels read only their
  arguments' dtype, rank and literals, may raise, and return
  ``torch.empty_like(input, dtype=...)``: a pure function of exactly what the
  cache key holds, so a hit yields what the kernel would (torch's
  ``fake_tensor_cache_crosscheck_enabled`` agrees in the tests).

Everything else FakeTensor checks (constant or symbolic arguments, real
tensors, output aliasing) still applies to them as to builtin ops. TOSA
dialect ops stay excluded: their kernels read the lowering context.
Measured uncached, one process each: MobileNetV2 Ethos-U55 10.3 s -> 9.2 s,
DeiT-tiny Ethos-U55 72 s -> 64.5 s, same bytes.
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
