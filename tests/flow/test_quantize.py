"""The quantization stage as a cached step: a hit rebuilds a program that lowers to stock's bytes."""

from __future__ import annotations

import logging

import pytest
import torch

import lowercache
from lowercache.lowering import flow, quantize
from lowercache.lowering.stored import programstore
from lowercache.bench import models
from lowercache.cache.store import Entry, Store

from tests.helpers.oracle import reference, stock_pte


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
    entry = programstore.encode(program, "spec")
    assert all(b"\x80\x02" not in blob[:2] and not blob.startswith(b"PK") for blob in entry.blobs.values())
    rebuilt = programstore.decode(entry)
    assert [n.name for n in rebuilt.graph.nodes] == [n.name for n in program.graph.nodes]
    assert [str(n.target) for n in rebuilt.graph.nodes] == [str(n.target) for n in program.graph.nodes]
    for name, tensor in program.state_dict.items():
        assert torch.equal(rebuilt.state_dict[name], tensor)
        assert type(rebuilt.state_dict[name]) is type(tensor)
    # The Arm annotation info (which nodes are quantized) steers folding and partitioning.
    annotated = [(a.meta["custom"], b.meta.get("custom")) for a, b in zip(program.graph.nodes, rebuilt.graph.nodes) if "custom" in a.meta]
    assert annotated and all(dict(a) == b for a, b in annotated)


def test_decode_runs_without_cyclic_collections_and_restores_the_collector(monkeypatch):
    import contextlib
    import gc

    from lowercache.targets import resolve

    module, example = models.tiny_cnn()
    target = resolve("tosa-int")
    program = quantize.run_stock(torch.export.export(module, example), target, target.compile_spec(), example, [example])
    entry = programstore.encode(program, "spec")
    collections = []
    inside = [False]  # flipped without allocating, so only collections during decode count
    threshold = gc.get_threshold()

    def decode_counting() -> int:
        collections.clear()
        inside[0] = True
        programstore.decode(entry)
        inside[0] = False
        return len(collections)

    gc.callbacks.append(lambda phase, info: collections.append(info) if phase == "start" and inside[0] else None)
    gc.set_threshold(1)  # any allocation triggers a collection while the collector is on
    try:
        paused = decode_counting()
        assert gc.isenabled()
        with monkeypatch.context() as m:
            m.setattr(programstore, "_no_cyclic_gc", contextlib.nullcontext)
            unpaused = decode_counting()
        assert paused < 10 < 100 < unpaused  # only the few allocations outside the pause collect
        gc.disable()
        programstore.decode(entry)
        assert not gc.isenabled(), "a collector the caller turned off stays off"
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.pop()


@pytest.mark.parametrize("key", [b'"as_expr"', b'"as_custom_obj"', b'"as_graph"', b'"as_sym_float"', b'"as_sym_bool"'])
def test_programs_with_expressions_or_objects_are_refused(key):
    entry = Entry(meta={"format": programstore.FORMAT, "tensors": {}}, blobs={"program.json": b'{"x": {' + key + b": 1}}"})
    with pytest.raises(programstore.FormatError, match=f"holds {key.decode()} values"):
        programstore.decode(entry)


def test_unusable_entry_recomputes_with_a_warning_and_is_replaced(cache_dir, new_flow_version, caplog, monkeypatch):
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
    # The recomputed program replaced the bad entry: the next run is served without a warning.
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + "+again")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        third = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert counts(third, "quantize") == {"hit": 1}
    assert third.pte == cold.pte
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _same_objects(a, b, path="program"):
    import dataclasses

    from torch._export.serde.union import _UnionTag

    assert type(a) is type(b), path
    if dataclasses.is_dataclass(a):
        assert list(vars(a)) == list(vars(b)), path
        for key in vars(a):
            _same_objects(vars(a)[key], vars(b)[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_objects(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            _same_objects(a[key], b[key], f"{path}[{key!r}]")
    else:
        assert a == b, path
        if isinstance(a, _UnionTag):
            assert a._cls is b._cls, path


def test_schema_conversion_equals_torch():
    """programstore.schema_program builds the same schema objects as torch's own JSON conversion."""
    import json

    from torch._export.serde import schema
    from torch._export.serde import serialize as serde

    from lowercache.targets import resolve

    module, example = models.transformer_block()
    target = resolve("tosa-int")
    program = quantize.run_stock(torch.export.export(module, example), target, target.compile_spec(), example, [example])
    graph = programstore.encode(program, "spec").blobs["program.json"]
    ours = programstore.schema_program(graph)
    theirs = serde._dict_to_dataclass(schema.ExportedProgram, json.loads(graph))
    assert ours == theirs
    _same_objects(ours, theirs)  # union __eq__ compares tag and value only: compare every attribute too
    with pytest.raises(programstore.FormatError):
        programstore.schema_program(b'{"graph_module": 3}')


def _graphbuild_unsupported(*args, **kwargs):
    from lowercache.lowering.stored import graphbuild

    raise graphbuild.Unsupported("test")


def _value_properties(v):
    if isinstance(v, torch.Tensor):
        keys = str(torch._C._dispatch_keys(v))
        return (type(v), v.shape, v.stride(), v.dtype, v.device, v.requires_grad, v.is_leaf, v.storage_offset(), keys)
    if isinstance(v, (tuple, list)):
        return tuple(_value_properties(x) for x in v)
    return v


def test_fast_tensor_meta_builds_the_values_torch_does(monkeypatch):
    """decode's direct FakeTensor construction gives what the deserializer's fake-mode dispatch gives."""
    import contextlib

    from lowercache.targets import resolve

    module, example = models.transformer_block()
    target = resolve("ethos-u55-128")
    program = quantize.run_stock(torch.export.export(module, example), target, target.compile_spec(), example, [example])
    entry = programstore.encode(program, "spec")
    monkeypatch.setattr(programstore, "_rebuild_fast", _graphbuild_unsupported)  # torch builds the graph
    fast = programstore.decode(entry)
    monkeypatch.setattr(programstore._fast_tensor_meta, "active", contextlib.nullcontext)
    stock = programstore.decode(entry)
    pairs = list(zip(fast.graph.nodes, stock.graph.nodes))
    assert len(pairs) == len(stock.graph.nodes)
    for a, b in pairs:
        assert a.name == b.name
        assert _value_properties(a.meta.get("val")) == _value_properties(b.meta.get("val")), a.name
        if isinstance(a.meta.get("val"), torch.Tensor):
            assert a.meta["val"].fake_mode is next(iter(fast.graph.nodes)).meta["val"].fake_mode


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize(("shape", "stride"), [((2, 3), (3, 1)), ((2, 3), (1, 2)), ((), ()), ((4, 1, 5), (5, 5, 1))])
def test_fast_tensor_meta_per_value(shape, stride, dtype, requires_grad):
    from torch._export.serde import serialize as serde
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    value = torch.empty_strided(shape, stride, dtype=dtype).requires_grad_(requires_grad and dtype.is_floating_point)
    tensor_meta = serde.serialize_tensor_meta(value)
    deserializer = serde.GraphModuleDeserializer()
    deserializer.fake_tensor_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    stock = deserializer.deserialize_tensor_meta(tensor_meta)
    with programstore._fast_tensor_meta.active():
        fast = deserializer.deserialize_tensor_meta(tensor_meta)
    assert fast is not stock and fast.fake_mode is stock.fake_mode
    assert _value_properties(fast) == _value_properties(stock)
    assert fast.requires_grad is value.requires_grad


def test_stored_json_equals_torchs_serializer_and_the_patches_are_undone():
    """encode's faster union construction and dict conversion write torch's exact JSON."""
    from torch._export.serde import schema
    from torch._export.serde import serialize as serde
    from torch._export.serde.union import _Union

    from lowercache.targets import resolve

    create, to_dict = vars(_Union)["create"], serde._dataclass_to_dict
    module, example = models.transformer_block()
    target = resolve("tosa-int")
    program = quantize.run_stock(torch.export.export(module, example), target, target.compile_spec(), example, [example])
    ours = programstore.encode(program, "spec").blobs["program.json"]
    assert vars(_Union)["create"] is create and serde._dataclass_to_dict is to_dict
    with programstore._no_canonical_form_check.active():
        theirs = serde.serialize(
            program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
        ).exported_program
    assert ours == theirs
    with programstore._fast_union_create.active():
        built = schema.Argument.create(as_int=3)
        assert vars(built) == vars(create.__func__(schema.Argument, as_int=3))  # same fields, same order, same tag
        assert list(vars(built)) == list(vars(create.__func__(schema.Argument, as_int=3)))
        with pytest.raises(AssertionError):
            schema.Argument.create(as_int=3, as_float=1.0)  # torch's own error
        with pytest.raises(TypeError):
            schema.Argument.create(not_a_field=1)
    with programstore._fast_to_dict.active():
        assert serde._dataclass_to_dict(schema.Argument.create(as_float=float("inf"))) == {"as_float": "Infinity"}
