"""The exact upscaling of HistogramObserver: torchao's bits, on random and real histograms."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from lowercache.speedups import histogram
from lowercache.bench import models


def _observer():
    from torchao.quantization.pt2e.observer import HistogramObserver

    return HistogramObserver()


def _cases(n: int = 400):
    """(histogram, orig_min, orig_max, update_min, update_max): torchao's call shapes, over many scales."""
    gen = torch.Generator().manual_seed(0)
    rnd = random.Random(0)
    for i in range(n):
        hist = torch.rand(2048, generator=gen) * rnd.choice([1.0, 100.0, 1e6])
        if i % 5 == 1:
            hist[torch.rand(2048, generator=gen) < 0.7] = 0
        if i % 5 == 2:
            hist = torch.randint(0, 5, (2048,), generator=gen).float()
        low = rnd.uniform(-50, 50) * rnd.choice([1.0, 1e-3, 1e-6, 1e3])
        width = abs(rnd.gauss(0, 1)) * rnd.choice([1.0, 1e-4, 1e-7, 1e4]) + 1e-30
        orig_min = torch.tensor(low, dtype=torch.float32)
        orig_max = torch.tensor(low + width, dtype=torch.float32)
        if orig_min == orig_max:
            continue
        grow_low = 0.0 if i % 5 == 3 else abs(rnd.gauss(0, 1)) * width * rnd.choice([0, 1e-3, 1, 10, 1e3])
        grow_high = 0.0 if i % 5 == 4 else abs(rnd.gauss(0, 1)) * width * rnd.choice([0, 1e-3, 1, 10, 1e3])
        yield hist, orig_min, orig_max, (orig_min - grow_low).float(), (orig_max + grow_high).float()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_equals_torchao_on_random_histograms(monkeypatch):
    from torchao.quantization.pt2e.observer import HistogramObserver

    fallbacks = []
    stock = histogram._stock
    monkeypatch.setattr(histogram, "_stock", lambda *a: fallbacks.append(1) or stock(*a))
    observer = _observer()
    checked = 0
    for case in _cases():
        assert _same(histogram.fast_upscale_histogram(observer, *case), HistogramObserver._upscale_histogram(observer, *case))
        checked += 1
    assert checked > 300 and not fallbacks  # the fast path itself was compared


def test_unsorted_boundaries_go_to_torchao():
    from torchao.quantization.pt2e.observer import HistogramObserver

    observer = _observer()
    hist = torch.rand(2048)
    args = (hist, torch.tensor(0.0), torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(2.0))
    assert _same(histogram.fast_upscale_histogram(observer, *args), HistogramObserver._upscale_histogram(observer, *args))


@pytest.mark.parametrize("model", ["residual_cnn", "transformer_block"])
def test_calibrated_observers_are_bit_identical(model):
    """Every observer's state after calibrating a real model, with and without the exact upscaling."""
    from torchao.quantization.pt2e.observer import HistogramObserver
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from lowercache.targets import resolve

    module, example = models.MODELS[model]()
    target = resolve("ethos-u55-128")
    exported = torch.export.export(module, example)

    def calibrated(fast: bool):
        prepared = prepare_pt2e(exported.module(check_guards=False), target.quantizer(target.compile_spec()))
        calls = []
        served = histogram.fast_upscale_histogram
        with histogram.exact_upscale() if fast else contextlib.nullcontext():
            if fast:  # count the calls the patch serves
                assert HistogramObserver._upscale_histogram is served
                HistogramObserver._upscale_histogram = lambda *a: calls.append(1) or served(*a)
            try:
                for sample in models.calibration_samples(example):
                    prepared(*sample)
            finally:
                if fast:
                    HistogramObserver._upscale_histogram = served
        states = [
            (name, [(b_name, b.clone()) for b_name, b in m.named_buffers()])
            for name, m in prepared.named_modules()
            if isinstance(m, HistogramObserver)
        ]
        return states, len(calls)

    before = HistogramObserver.__dict__["_upscale_histogram"]
    stock, _ = calibrated(False)
    fast, calls = calibrated(True)
    assert HistogramObserver.__dict__["_upscale_histogram"] is before  # undone on exit
    assert calls > 0
    assert [name for name, _ in fast] == [name for name, _ in stock] and len(stock) > 10
    for (name, s_bufs), (_, f_bufs) in zip(stock, fast):
        for (b_name, s), (_, f) in zip(s_bufs, f_bufs):
            assert _same(s, f), f"{name}.{b_name}"


def test_another_torchao_source_is_left_alone(monkeypatch):
    from torchao.quantization.pt2e.observer import HistogramObserver

    original = HistogramObserver.__dict__["_upscale_histogram"]
    monkeypatch.setattr(histogram, "_UPSCALE_DIGEST", "0" * 64)
    with histogram.exact_upscale():
        assert HistogramObserver.__dict__["_upscale_histogram"] is original
    assert HistogramObserver.__dict__["_upscale_histogram"] is original
