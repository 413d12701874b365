"""An exact, faster ``HistogramObserver._non_linear_param_search``: the same loop and float32 arithmetic, with monotone scans and idle steps done by bisection.

Why it is exact, and figures: docs/speedups.md#paramsearch.
"""

from __future__ import annotations

import bisect
import functools
import math
import struct
from typing import Any

import torch

from .patching import Patch


def fast_non_linear_param_search(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``HistogramObserver._non_linear_param_search``, exactly, without per-bin tensor ops.

    The stock loop compares float32 elements of ``cumsum(histogram)`` with
    Python floats; torch makes such comparisons in float32, so each threshold
    is rounded to float32 here before comparing. The cumulative sum of a
    non-negative histogram never decreases, so the stock linear scans
    ("first bin from ``start_bin`` not below the threshold", "last bin down to
    ``end_bin`` not above it") are bisections, and a run of steps that move
    neither bin is skipped by bisection too (``_first_move``). Any histogram
    outside those assumptions goes to the original.
    """
    hist = self.histogram
    if hist.dtype != torch.float32 or hist.dim() != 1 or hist.size(0) != self.bins or hist.device.type != "cpu":
        return _stock_search(self)
    csum = torch.cumsum(hist, dim=0).tolist()
    if not all(math.isfinite(v) for v in csum) or csum[0] < 0 or any(b < a for a, b in zip(csum, csum[1:])):
        return _stock_search(self)
    bin_width = (self.max_val - self.min_val) / self.bins
    total = torch.sum(hist).item()
    alphas, betas = _bounds()
    i = j = 0  # alpha is alphas[i], beta is betas[j]
    start_bin, end_bin = 0, self.bins - 1
    norm_min = float("inf")
    while alphas[i] < betas[j]:
        low = _f32(alphas[i + 1] * total)
        high = _f32(betas[j + 1] * total)
        left = bisect.bisect_left(csum, low, start_bin, end_bin)
        right = bisect.bisect_right(csum, high, start_bin + 1, end_bin + 1) - 1
        next_start_bin, next_end_bin = start_bin, end_bin
        if (left - start_bin) > (end_bin - right):
            next_start_bin = left
            i += 1
        else:
            next_end_bin = right
            j += 1
        if next_start_bin == start_bin and next_end_bin == end_bin:
            j = _first_move(alphas[i], betas, j, csum[end_bin] if start_bin < end_bin else None, total)
            continue
        norm = self._compute_quantization_error(next_start_bin, next_end_bin)
        if norm > norm_min:
            break
        norm_min = norm
        start_bin, end_bin = next_start_bin, next_end_bin
    return self.min_val + bin_width * start_bin, self.min_val + bin_width * (end_bin + 1)


_STEPSIZE = 1e-5  # torchao's granularity
_FLOAT32 = struct.Struct("f")


def _f32(value: float) -> float:
    """``value`` rounded to float32, as torch rounds a Python float compared with a float32 tensor."""
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


@functools.lru_cache(maxsize=1)
def _bounds() -> tuple[list[float], list[float]]:
    """Every value stock's ``alpha`` and ``beta`` take, in order: each step adds (subtracts) the step size to the
    last value and rounds, so the k-th value is the k-th of these lists whatever the other bound did meanwhile."""
    alphas, betas = [0.0], [1.0]
    while alphas[-1] < 1.0:
        alphas.append(alphas[-1] + _STEPSIZE)
    while betas[-1] > 0.0:
        betas.append(betas[-1] - _STEPSIZE)
    return alphas, betas


def _first_move(alpha: float, betas: list[float], j: int, end_sum: float | None, total: float) -> int:
    """After a step that moved neither bin, the first beta index from ``j`` at which stock's loop ends or moves a bin.

    Such a step left ``start_bin`` where the alpha step found it and ``end_bin`` where the beta step found it; only
    beta moved. With alpha fixed the alpha step finds the same bin again, so the following steps move beta alone
    until the loop ends (``alpha >= beta``) or the beta step finds a lower end bin: ``cSum[end_bin]`` above
    ``float32(next_beta * total)`` (``end_sum`` is None when the bins have met, and only the end remains). Both
    conditions hold from some index on (beta falls), so it is found by bisection.
    """

    def stops(k: int) -> bool:
        return alpha >= betas[k] or (end_sum is not None and end_sum > _f32(betas[k + 1] * total))

    lo, hi = j, len(betas) - 1  # betas[-1] <= 0 <= alpha: the loop has ended by then
    while lo < hi:
        mid = (lo + hi) // 2
        if stops(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


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
