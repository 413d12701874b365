"""An exact, faster ``HistogramObserver._non_linear_param_search``: the same loop and float32 arithmetic, with monotone scans done by bisection.

Why it is exact, and figures: docs/speedups.md#paramsearch.
"""

from __future__ import annotations

import bisect
import math
import struct
from typing import Any

import torch

from .patching import Patch

_FLOAT32 = struct.Struct("f")


def fast_non_linear_param_search(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``HistogramObserver._non_linear_param_search``, exactly, without per-bin tensor ops.

    The stock loop compares float32 elements of ``cumsum(histogram)`` with
    Python floats; torch makes such comparisons in float32, so each threshold
    is rounded to float32 here before comparing. The cumulative sum of a
    non-negative histogram never decreases, so the stock linear scans
    ("first bin from ``start_bin`` not below the threshold", "last bin down to
    ``end_bin`` not above it") are bisections. Any histogram outside those
    assumptions goes to the original.
    """
    hist = self.histogram
    if hist.dtype != torch.float32 or hist.dim() != 1 or hist.size(0) != self.bins or hist.device.type != "cpu":
        return _stock_search(self)
    csum = torch.cumsum(hist, dim=0).tolist()
    if not all(math.isfinite(v) for v in csum) or csum[0] < 0 or any(b < a for a, b in zip(csum, csum[1:])):
        return _stock_search(self)
    bin_width = (self.max_val - self.min_val) / self.bins
    total = torch.sum(hist).item()
    pack, unpack = _FLOAT32.pack, _FLOAT32.unpack
    stepsize = 1e-5
    alpha, beta = 0.0, 1.0
    start_bin, end_bin = 0, self.bins - 1
    norm_min = float("inf")
    while alpha < beta:
        next_alpha = alpha + stepsize
        next_beta = beta - stepsize
        low = unpack(pack(next_alpha * total))[0]
        high = unpack(pack(next_beta * total))[0]
        left = bisect.bisect_left(csum, low, start_bin, end_bin)
        right = bisect.bisect_right(csum, high, start_bin + 1, end_bin + 1) - 1
        next_start_bin, next_end_bin = start_bin, end_bin
        if (left - start_bin) > (end_bin - right):
            next_start_bin = left
            alpha = next_alpha
        else:
            next_end_bin = right
            beta = next_beta
        if next_start_bin == start_bin and next_end_bin == end_bin:
            continue
        norm = self._compute_quantization_error(next_start_bin, next_end_bin)
        if norm > norm_min:
            break
        norm_min = norm
        start_bin, end_bin = next_start_bin, next_end_bin
    return self.min_val + bin_width * start_bin, self.min_val + bin_width * (end_bin + 1)


_search_originals: list[Any] = []


def _stock_search(observer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's own search, whether or not lowercache has replaced it."""
    from torchao.quantization.pt2e.observer import HistogramObserver

    original = _search_originals[0] if _search_originals else HistogramObserver._non_linear_param_search
    return original(observer)


def _apply() -> None:
    from torchao.quantization.pt2e.observer import HistogramObserver

    _search_originals[:] = [HistogramObserver.__dict__["_non_linear_param_search"]]
    HistogramObserver._non_linear_param_search = fast_non_linear_param_search


def _undo() -> None:
    from torchao.quantization.pt2e.observer import HistogramObserver

    HistogramObserver._non_linear_param_search = _search_originals.pop()


_patch = Patch(_apply, _undo)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
