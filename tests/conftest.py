"""Shared fixtures. ``stock_pte`` is the oracle: the stock ExecuTorch Arm flow,
written here straight from the README, independent of lowercache's own code."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from lowercache import models

SMALL_TARGETS = ("tosa-int", "tosa-fp", "ethos-u55-128", "ethos-u55-256", "ethos-u85-256")


def stock_pte(module, example_inputs, target: str, calibration=None, per_channel: bool = True) -> bytes:
    """The .pte stock ExecuTorch produces, with no lowercache code involved."""
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, TOSAQuantizer, get_symmetric_quantization_config
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ep = torch.export.export(module, example_inputs)
    ethos = target.startswith("ethos-u")
    spec = EthosUCompileSpec(target) if ethos else TosaCompileSpec({"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}[target])
    if target != "tosa-fp":
        # The quantizer may adjust the compile spec's pass pipeline config, so
        # the partitioner is made after quantization, as in the README's flow.
        quantizer = EthosUQuantizer(spec) if ethos else TOSAQuantizer(spec)
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=per_channel))
        prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
        for sample in calibration or [example_inputs]:
            prepared(*sample)
        ep = torch.export.export(convert_pt2e(prepared), example_inputs)
    partitioner = EthosUPartitioner(spec) if ethos else TOSAPartitioner(spec)
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner])
    return edge.to_executorch().buffer


@functools.lru_cache(maxsize=None)
def reference(model: str, target: str, edit: str | None = None) -> bytes:
    """Stock .pte of a small model, computed once per test session."""
    module, example = models.MODELS[model](edit=edit)
    return stock_pte(module, example, target)


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch):
    """No test reads the developer's own config file or cache."""
    for var in ("LOWERCACHE_DIR", "LOWERCACHE_MAX_SIZE", "LOWERCACHE_DISABLE", "LOWERCACHE_READ_ONLY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOWERCACHE_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    logging.getLogger("lowercache").propagate = True
