"""Observer qparams as a cached step.

``convert_pt2e`` asks every observer for its scale and zero point, and the
Arm quantizer's bias qspec derivation asks the activation and weight
observers a second time; ``HistogramObserver.calculate_qparams`` runs a
costly non-linear search each time. The answer is a pure function of the
observer's type, its configuration and its statistics (histogram, min/max),
so it is a step: key = those parts, value = the scale and zero-point tensors
as bytes. Within a run the second call is a hit; across runs, only observers
whose statistics changed are recomputed.

Only torchao's own observer classes are served (a user subclass may change
the computation); anything else, or anything that cannot be hashed, runs the
original method.

A miss still pays for the search itself; ``speedups/paramsearch.py`` makes it cheaper.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..speedups.patching import Patch
from ..cache.hashing import (
    Unhashable,
    canon,
    digest_json,
    dtype_name,
    tensor_bytes,
    tensor_digest,
    tensor_from_bytes,
)
from ..cache.steps import current_session
from ..cache.store import Entry

_originals: dict[type, Any] = {}


def _observer_classes() -> tuple[type, ...]:
    from torchao.quantization.pt2e import observer as obs

    return (obs.HistogramObserver, obs.MinMaxObserver, obs.PerChannelMinMaxObserver)


def _served_types() -> set[type]:
    from torchao.quantization.pt2e import observer as obs

    return {
        obs.HistogramObserver,
        obs.MinMaxObserver,
        obs.MovingAverageMinMaxObserver,
        obs.PerChannelMinMaxObserver,
        obs.MovingAveragePerChannelMinMaxObserver,
    }


def observer_parts(observer: torch.nn.Module) -> dict[str, str]:
    """Key parts: type, public configuration, and every buffer's content."""
    config = {k: v for k, v in vars(observer).items() if not k.startswith("_") and k != "training"}
    return {
        "observer": f"{type(observer).__module__}.{type(observer).__qualname__}",
        "config": digest_json(canon(config)),
        "statistics": digest_json({name: tensor_digest(b) for name, b in sorted(observer.named_buffers())}),
        "torchao": _torchao_version(),
    }


@functools.lru_cache(maxsize=None)
def _torchao_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torchao")


def _encode(tensors: tuple[torch.Tensor, ...]) -> Entry:
    meta = [{"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for t in tensors]
    return Entry(meta={"tensors": meta}, blobs={f"t{i}": tensor_bytes(t) for i, t in enumerate(tensors)})


def _decode(entry: Entry) -> tuple[torch.Tensor, ...]:
    return tuple(tensor_from_bytes(entry.blobs[f"t{i}"], s["dtype"], s["shape"]) for i, s in enumerate(entry.meta["tensors"]))


def _wrap(original: Any) -> Any:
    def calculate_qparams(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        session = current_session()
        if session is None or args or kwargs or type(self) not in _served_types():
            return original(self, *args, **kwargs)
        try:
            parts = observer_parts(self)
        except Unhashable:
            parts = None

        def compute() -> Entry:
            result = original(self)
            if not isinstance(result, tuple) or not all(isinstance(t, torch.Tensor) for t in result):
                raise TypeError("unexpected calculate_qparams result")
            return _encode(result)

        return _decode(session.run("qparams", type(self).__name__, parts, compute))

    calculate_qparams.__wrapped__ = original  # type: ignore[attr-defined]
    return calculate_qparams


def _apply() -> None:
    for cls in _observer_classes():
        _originals[cls] = cls.__dict__["calculate_qparams"]
        cls.calculate_qparams = _wrap(_originals[cls])


def _undo() -> None:
    for cls, original in _originals.items():
        cls.calculate_qparams = original
    _originals.clear()


_patch = Patch(_apply, _undo)
enable = _patch.enable  # serve observer qparams through the active session
disable = _patch.disable
