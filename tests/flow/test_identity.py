"""Byte identity: lowercache, cold and warm, produces exactly the stock .pte."""

from __future__ import annotations

import pytest

import lowercache
from lowercache.bench import models

from tests.helpers.graphs import SMALL_TARGETS, outcomes
from tests.helpers.oracle import reference, stock_pte
from tests.helpers.seeded import cold_cache


@pytest.mark.parametrize("target", SMALL_TARGETS)
@pytest.mark.parametrize("model", models.SMALL)
def test_cold_and_warm_match_stock(model, target, cache_dir, tmp_path_factory):
    expected = reference(model, target)
    cold = cold_cache(model, target, tmp_path_factory, cache_dir)
    assert outcomes(cold, "flow") == ["miss"]
    assert cold.pte == expected

    module, example = models.MODELS[model]()  # a fresh, equal model object
    warm = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    assert outcomes(warm, "flow") == ["hit"]
    assert warm.pte == expected
    assert warm.files == cold.files


@pytest.mark.parametrize("target", ["tosa-int", "ethos-u55-128"])
def test_partition_artifacts_are_the_delegate_payloads(target, cache_dir):
    module, example = models.tiny_cnn()
    artifacts = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    payload = artifacts.files["partition_0.vela.bin" if target.startswith("ethos") else "partition_0.tosa"]
    assert payload in artifacts.pte
    assert artifacts.files["partition_0.tosa"][4:8] == b"TOSA"  # flatbuffer file identifier
    if target.startswith("ethos"):
        assert b"Network summary" in artifacts.files["partition_0.vela_summary.txt"]


@pytest.mark.quick
def test_no_cache_matches_stock(cache_dir):
    module, example = models.tiny_cnn()
    artifacts = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir, use_cache=False)
    assert artifacts.pte == reference("tiny_cnn", "ethos-u55-128")
    assert not cache_dir.exists()


@pytest.mark.parametrize("edit", ["structure", "weights"])
def test_edits_miss_and_match_stock(edit, cache_dir, tmp_path_factory):
    cold_cache("residual_cnn", "ethos-u55-128", tmp_path_factory, cache_dir)
    module, example = models.residual_cnn(edit=edit)
    edited = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert outcomes(edited, "flow") == ["miss"]
    assert edited.pte == reference("residual_cnn", "ethos-u55-128", edit)


def test_calibration_and_per_tensor_match_stock(cache_dir):
    module, example = models.tiny_cnn()
    samples = models.calibration_samples(example)
    got = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir, calibration=samples, per_channel=False)
    assert got.pte == stock_pte(module, example, "tosa-int", calibration=samples, per_channel=False)
    assert got.pte != reference("tiny_cnn", "tosa-int")
