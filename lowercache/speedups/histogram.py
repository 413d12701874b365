"""An exact, faster ``HistogramObserver._upscale_histogram``: one search per sorted boundary gives the same bin counts as one per sorted midpoint.

Why it is exact, and figures: docs/speedups.md#histogram.
"""

from __future__ import annotations

from typing import Any

import torch

from .patching import Patch

# sha256 of ``HistogramObserver._upscale_histogram``'s source in torchao 0.18.0, the one read.
_UPSCALE_DIGEST = "cad59b3e62afee798a5ae4d8240d5f6f26f3bd9c1194e4afe721558298aa6db4"

_originals: list[Any] = []


def _sorted(x: torch.Tensor) -> bool:
    """Non-decreasing (False with any NaN, whose comparisons all fail)."""
    return bool(torch.all(x[1:] >= x[:-1]))


def fast_upscale_histogram(
    self: Any,
    histogram: torch.Tensor,
    orig_min: torch.Tensor,
    orig_max: torch.Tensor,
    update_min: torch.Tensor,
    update_max: torch.Tensor,
) -> torch.Tensor:
    """``HistogramObserver._upscale_histogram``, with the bucketize done by boundary search."""
    if not all(t.device.type == "cpu" for t in (histogram, orig_min, orig_max, update_min, update_max)):
        return _stock(self, histogram, orig_min, orig_max, update_min, update_max)
    bins = self.bins
    weights = histogram.repeat_interleave(self.upsample_rate) / self.upsample_rate
    bin_size = (orig_max - orig_min) / (bins * self.upsample_rate)
    mid_points = torch.linspace(orig_min, orig_max, bins * self.upsample_rate + 1, device=orig_min.device)[:-1].to(
        weights.device
    ) + 0.5 * bin_size
    boundaries = torch.linspace(update_min, update_max, bins + 1, device=update_min.device).to(weights.device)
    if not (_sorted(mid_points) and _sorted(boundaries)):
        return _stock(self, histogram, orig_min, orig_max, update_min, update_max)
    # bucketize(v, b, right=True) counts the boundaries <= v. For sorted v, boundary i is <= v[j]
    # exactly when j is at least the number of midpoints below boundary i.
    below = torch.searchsorted(mid_points, boundaries)
    edges = torch.cat([below.new_zeros(1), below, below.new_tensor([mid_points.numel()])])
    per_index = edges[1:] - edges[:-1]  # midpoints with bucketize index 0 .. bins + 1
    # torchao subtracts one and clamps to [0, bins - 1]: indices 0 and 1 land in bin 0, bins and bins + 1 in the last.
    counts = per_index[1:-1].clone()
    counts[0] += per_index[0]
    counts[-1] += per_index[-1]
    assignments = torch.repeat_interleave(torch.arange(bins, device=weights.device), counts)
    return torch.bincount(assignments, weights=weights, minlength=bins)


def _stock(self: Any, *args: Any) -> torch.Tensor:
    """torchao's own method, whether or not it is replaced right now."""
    from torchao.quantization.pt2e.observer import HistogramObserver

    original = _originals[0] if _originals else HistogramObserver._upscale_histogram
    return original(self, *args)


def _apply() -> None:
    from torchao.quantization.pt2e.observer import HistogramObserver

    from .sourcepin import source_digest

    original = HistogramObserver.__dict__["_upscale_histogram"]
    _originals[:] = [original]
    if source_digest(original) == _UPSCALE_DIGEST:
        HistogramObserver._upscale_histogram = fast_upscale_histogram


def _undo() -> None:
    from torchao.quantization.pt2e.observer import HistogramObserver

    HistogramObserver._upscale_histogram = _originals.pop()


_patch = Patch(_apply, _undo)
enable = _patch.enable
"""Serve ``_upscale_histogram`` with :func:`fast_upscale_histogram` (reference counted, thread-safe)."""
disable = _patch.disable
exact_upscale = _patch.active
"""Context manager form of :func:`enable` / :func:`disable`."""
