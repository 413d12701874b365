"""The quantization stage as a cached step: a hit rebuilds a program that lowers to stock's bytes."""

from __future__ import annotations

import logging

import pytest
import torch

import lowercache
from lowercache import flow, models, quantize
from lowercache.store import Entry, Store

from .conftest import reference, stock_pte


def counts(artifacts, kind):
    return artifacts.manifest["step_counts"].get(kind, {})


@pytest.fixture
def new_flow_version(monkeypatch):
    """Make the whole-flow step miss while the quantize step's key stays the same."""

    def bump():
        monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + "+test")

    return bump


@pytest.mark.parametrize(
    "model,target", [("tiny_cnn", "ethos-u55-128"), ("transformer_block", "tosa-int"), ("residual_cnn", "ethos-u85-256")]
)
def test_quantize_hit_lowers_to_stock_bytes(model, target, cache_dir, new_flow_version):
    module, example = models.MODELS[model]()
    cold = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    assert counts(cold, "quantize") == {"miss": 1}
    new_flow_version()
    again = lowercache.lower(module, example, target=target, cache_dir=cache_dir)
    assert counts(again, "flow") == {"miss": 1}
    assert counts(again, "quantize") == {"hit": 1}
    assert again.pte == cold.pte == reference(model, target)


def test_float_target_has_no_quantize_step(cache_dir):
    module, example = models.tiny_cnn()
    artifacts = lowercache.lower(module, example, target="tosa-fp", cache_dir=cache_dir)
    assert "quantize" not in artifacts.manifest["step_counts"]


def test_quantize_key_sees_calibration_and_per_channel(cache_dir, new_flow_version):
    module, example = models.tiny_cnn()
    lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir)
    new_flow_version()
    samples = models.calibration_samples(example, n=2, seed=5)
    calibrated = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir, calibration=samples)
    assert counts(calibrated, "quantize") == {"miss": 1}
    assert calibrated.pte == stock_pte(module, example, "tosa-int", calibration=samples)
    per_tensor = lowercache.lower(module, example, target="tosa-int", cache_dir=cache_dir, per_channel=False)
    assert counts(per_tensor, "quantize") == {"miss": 1}
    assert per_tensor.pte == stock_pte(module, example, "tosa-int", per_channel=False)


def test_stored_form_round_trips_without_pickle():
    from lowercache.targets import resolve

    module, example = models.tiny_cnn()
    target = resolve("tosa-int")
    program = quantize.run_stock(torch.export.export(module, example), target, target.compile_spec(), example, [example])
    entry = quantize.encode(program, "spec")
    assert all(b"\x80\x02" not in blob[:2] and not blob.startswith(b"PK") for blob in entry.blobs.values())
    rebuilt = quantize.decode(entry)
    assert [n.name for n in rebuilt.graph.nodes] == [n.name for n in program.graph.nodes]
    assert [str(n.target) for n in rebuilt.graph.nodes] == [str(n.target) for n in program.graph.nodes]
    for name, tensor in program.state_dict.items():
        assert torch.equal(rebuilt.state_dict[name], tensor)
        assert type(rebuilt.state_dict[name]) is type(tensor)
    # The Arm annotation info (which nodes are quantized) steers folding and partitioning.
    annotated = [(a.meta["custom"], b.meta.get("custom")) for a, b in zip(program.graph.nodes, rebuilt.graph.nodes) if "custom" in a.meta]
    assert annotated and all(dict(a) == b for a, b in annotated)


@pytest.mark.parametrize("key", [b'"as_expr"', b'"as_custom_obj"'])
def test_programs_with_expressions_or_objects_are_refused(key):
    entry = Entry(meta={"format": quantize.QUANTIZE_VERSION, "tensors": {}}, blobs={"program.json": b'{"x": {' + key + b": 1}}"})
    with pytest.raises(quantize.FormatError):
        quantize.decode(entry)


def test_unusable_entry_recomputes_with_a_warning(cache_dir, new_flow_version, caplog):
    module, example = models.tiny_cnn()
    cold = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    store = Store(cache_dir)
    (key,) = [key for kind, key in store.actions() if kind == "quantize"]
    entry = store.get("quantize", key)
    entry.blobs["program.json"] = entry.blobs["program.json"].replace(b'"graph_module"', b'"graph_modulo"', 1)
    store.put("quantize", key, entry)
    store.close()
    new_flow_version()
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        again = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert counts(again, "quantize") == {"hit": 1}
    assert again.pte == cold.pte
    assert any("cached quantized program unusable" in r.getMessage() for r in caplog.records)


def test_schema_conversion_equals_torch():
    """quantize.schema_program builds the same schema objects as torch's own JSON conversion."""
    import json

    from torch._export.serde import schema
    from torch._export.serde import serialize as serde

    from lowercache.targets import resolve

    module, example = models.transformer_block()
    target = resolve("tosa-int")
    program = quantize.run_stock(torch.export.export(module, example), target, target.compile_spec(), example, [example])
    graph = quantize.encode(program, "spec").blobs["program.json"]
    assert quantize.schema_program(graph) == serde._dict_to_dataclass(schema.ExportedProgram, json.loads(graph))
    with pytest.raises(quantize.FormatError):
        quantize.schema_program(b'{"graph_module": 3}')
