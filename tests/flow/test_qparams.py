"""Observer qparams steps: repeated work within a run hits; edits miss only where they should."""

from __future__ import annotations

import torch

import lowercache
from lowercache.bench import models
from lowercache.lowering.qparams import observer_parts

from tests.helpers.oracle import reference, stock_pte
from tests.helpers.seeded import cold_cache


def qparams_outcomes(artifacts):
    return artifacts.manifest["step_counts"].get("qparams", {})


def test_cold_run_reuses_observer_results_and_matches_stock(cache_dir, tmp_path_factory):
    cold = cold_cache("residual_cnn", "ethos-u55-128", tmp_path_factory, cache_dir)
    assert cold.pte == reference("residual_cnn", "ethos-u55-128")
    counts = qparams_outcomes(cold)
    assert counts.get("miss", 0) > 0 and counts.get("hit", 0) > 0  # bias qspecs ask again


def test_weights_edit_misses_only_changed_observers(cache_dir, tmp_path_factory):
    cold_cache("residual_cnn", "ethos-u55-128", tmp_path_factory, cache_dir)
    module, example = models.residual_cnn(edit="weights")
    edited = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert edited.pte == reference("residual_cnn", "ethos-u55-128", "weights")
    counts = qparams_outcomes(edited)
    assert counts.get("hit", 0) > counts.get("miss", 0) > 0


def test_observer_key_sees_statistics_and_config():
    from torchao.quantization.pt2e.observer import HistogramObserver

    def observer(eps=2**-16):
        return HistogramObserver(dtype=torch.int8, qscheme=torch.per_tensor_affine, quant_min=-128, quant_max=127, eps=eps)

    a, b, c = observer(), observer(), observer(eps=2**-12)
    for o in (a, b, c):
        o(torch.linspace(-1, 1, 100))
    assert observer_parts(a) == observer_parts(b)
    assert observer_parts(a)["statistics"] != observer_parts(c)["statistics"]  # eps is a buffer
    b(torch.linspace(-2, 2, 100))
    assert observer_parts(a)["statistics"] != observer_parts(b)["statistics"]
    assert observer_parts(a)["config"] == observer_parts(b)["config"]


def test_calibration_change_misses_activation_observers_only(cache_dir):
    module, example = models.tiny_cnn()
    cold = qparams_outcomes(lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir))
    samples = models.calibration_samples(example)
    changed = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir, calibration=samples)
    flow = [r for r in changed.records if r["kind"] == "flow"][0]
    assert flow["outcome"] == "miss"
    counts = qparams_outcomes(changed)
    # Weight observers saw the same weights: hits. Activation observers saw new data: misses.
    assert 0 < counts.get("miss", 0) < cold["miss"]
    assert counts.get("hit", 0) > cold.get("hit", 0)


def _histogram_observers():
    """Observers with varied, realistic histograms: several batches, outliers, one-sided and heavy tails."""
    from torchao.quantization.pt2e.observer import HistogramObserver

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(24):
        observer = HistogramObserver(dtype=torch.int8, qscheme=torch.per_tensor_affine, quant_min=-128, quant_max=127)
        for _ in range(1 + i % 3):
            x = torch.randn(3000, generator=gen) * (1 + i)
            shape = i % 4
            if shape == 1:
                x = x.abs()
            elif shape == 2:
                x = torch.cat([x, torch.tensor([40.0 * (i + 1)])])
            elif shape == 3:
                x = torch.relu(x) ** 3
            observer(x)
        out.append(observer)
    constant = HistogramObserver()
    constant(torch.full((100,), 0.5))
    out.append(constant)
    return out


def _searched(search, observer):
    """The search's result and the bin pairs it evaluated, in order (``_compute_quantization_error``'s calls)."""
    calls = []
    evaluate = observer._compute_quantization_error

    def recorded(start_bin, end_bin):
        calls.append((start_bin, end_bin))
        return evaluate(start_bin, end_bin)

    observer._compute_quantization_error = recorded
    try:
        return search(observer), calls
    finally:
        del observer._compute_quantization_error


def test_fast_histogram_search_equals_torchao():
    """The same result after the same evaluations, step for step, on histograms with long idle runs too."""
    from torchao.quantization.pt2e.observer import HistogramObserver

    from lowercache.speedups.paramsearch import fast_non_linear_param_search

    sparse = HistogramObserver()
    sparse(torch.tensor([0.0] * 50 + [1.0] * 3 + [9.0]))  # a few occupied bins: the end bin waits for many steps
    zero = HistogramObserver()
    zero.histogram = torch.zeros(zero.bins)  # no mass at all: the loop runs until the bounds meet
    zero.min_val, zero.max_val = torch.tensor(-1.0), torch.tensor(1.0)
    for observer in [*_histogram_observers(), sparse, zero]:
        stock, stock_calls = _searched(HistogramObserver._non_linear_param_search, observer)
        fast, fast_calls = _searched(fast_non_linear_param_search, observer)
        assert torch.equal(stock[0], fast[0]) and torch.equal(stock[1], fast[1])
        assert fast_calls == stock_calls


def test_fast_histogram_search_equals_torchao_on_a_real_model():
    """Every activation observer of a calibrated model, searched both ways."""
    from torchao.quantization.pt2e.observer import HistogramObserver
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from lowercache.speedups.paramsearch import fast_non_linear_param_search
    from lowercache.targets import resolve

    module, example = models.residual_cnn()
    target = resolve("ethos-u55-128")
    prepared = prepare_pt2e(torch.export.export(module, example).module(check_guards=False), target.quantizer(target.compile_spec()))
    for sample in models.calibration_samples(example):
        prepared(*sample)
    observers = [m for m in prepared.modules() if isinstance(m, HistogramObserver)]
    assert len(observers) > 10
    for observer in observers:
        stock, stock_calls = _searched(HistogramObserver._non_linear_param_search, observer)
        fast, fast_calls = _searched(fast_non_linear_param_search, observer)
        assert torch.equal(stock[0], fast[0]) and torch.equal(stock[1], fast[1])
        assert fast_calls == stock_calls


def _qparams_records(artifacts):
    return [r for r in artifacts.records if r["kind"] == "qparams"]


def test_misses_are_exactly_the_observers_never_seen(cache_dir):
    """After a weights edit, an observer misses iff its (type, config, statistics) key is new."""
    module, example = models.residual_cnn()
    base = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir)
    seen = {r["key"] for r in _qparams_records(base)}
    module, example = models.residual_cnn(edit="weights")
    edited = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir)
    assert edited.pte == reference("residual_cnn", "tosa-int", "weights")
    for record in _qparams_records(edited):
        assert (record["outcome"] == "miss") == (record["key"] not in seen), record["name"]
        seen.add(record["key"])
    counts = qparams_outcomes(edited)
    assert counts["miss"] > 0 and counts["hit"] > 0


def test_observer_config_change_misses_only_those_observers(cache_dir):
    """Per-tensor instead of per-channel weights: weight observers change type and config,
    activation observers do not, so only weight observers miss."""

    module, example = models.residual_cnn()
    lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir)
    per_tensor = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir, per_channel=False)
    assert per_tensor.pte == stock_pte(module, example, "tosa-int", per_channel=False)
    records = _qparams_records(per_tensor)
    misses = {r["name"] for r in records if r["outcome"] == "miss"}
    hits = {r["name"] for r in records if r["outcome"] == "hit"}
    assert misses == {"MinMaxObserver"}  # the weights' per-tensor observers
    assert "HistogramObserver" in hits  # activations: same observers, same statistics
