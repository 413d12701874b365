"""The stage's re-export as a template: a weights edit fills it, and the result is a fresh export's."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import lowercache
from lowercache.lowering import flow, quantize, reexport
from lowercache.lowering.stored import programstore
from lowercache.bench import models
from lowercache.cache.store import Store
from lowercache.cache.hashing import canon, node_form
from lowercache.targets import resolve

from tests.helpers.graphs import without_varying_meta
from tests.helpers.oracle import reference
from tests.helpers.seeded import cold_cache


def counts(artifacts, kind):
    return artifacts.manifest["step_counts"].get(kind, {})


def _converted(model: str, edit: str | None, target: str = "ethos-u55-128"):
    module, example = models.MODELS[model](edit=edit)
    resolved = resolve(target)
    program = torch.export.export(module, example)
    return quantize.convert(program, resolved, resolved.compile_spec(), [example]), example


def _template(converted, example):
    program = torch.export.export(converted, tuple(example))
    template = reexport.make_template(converted, program, programstore.encode(program, "spec"))
    assert template is not None
    return template


@pytest.mark.parametrize("model", ["residual_cnn", "transformer_block"])
def test_filled_template_is_the_stored_form_of_a_fresh_export(model):
    base, example = _converted(model, None)
    edited, _ = _converted(model, "weights")
    assert reexport.template_parts(edited, example) == reexport.template_parts(base, example)
    filled, doc = reexport.fill(_template(base, example), edited, example, "spec")
    assert doc == json.loads(filled.blobs["program.json"])
    fresh = programstore.encode(torch.export.export(edited, tuple(example)), "spec")
    assert filled.meta == fresh.meta  # tensor names, order, records and offsets
    assert filled.blobs["tensors"] == fresh.blobs["tensors"]
    assert without_varying_meta(filled.blobs["program.json"]) == without_varying_meta(fresh.blobs["program.json"])
    base_literals = reexport.graph_literals(base)
    edited_literals = reexport.graph_literals(edited)
    assert base_literals != edited_literals  # the edit did change what is filled


def test_key_leaves_out_only_the_filled_literals_and_tensor_values():
    converted, example = _converted("tiny_cnn", None)
    parts = reexport.template_parts(converted, example)
    filled = next(n for n in converted.graph.nodes if reexport.is_filled(n))
    attr = next(n for n in converted.graph.nodes if n.op == "get_attr")
    tensor = reexport._attribute(converted, attr.target)

    filled.args = (filled.args[0], filled.args[1] * 2, filled.args[2] + 1, *filled.args[3:])
    with torch.no_grad():
        tensor.add_(1)
    assert reexport.template_parts(converted, example) == parts

    filled.args = (*filled.args[:3], filled.args[3] + 1, *filled.args[4:])  # quant_min is not filled
    assert reexport.template_parts(converted, example)["graph"] != parts["graph"]
    filled.args = (*filled.args[:3], filled.args[3] - 1, *filled.args[4:])
    assert reexport.template_parts(converted, example) == parts

    setattr(converted, attr.target, tensor.to(torch.int16))  # a dtype is part of the key
    assert reexport.template_parts(converted, example)["graph"] != parts["graph"]
    other_inputs = tuple(torch.zeros_like(t) for t in example)
    assert reexport.template_parts(converted, other_inputs)["example_inputs"] != parts["example_inputs"]


def test_tensor_scales_are_not_filled_and_refuse_a_key():
    converted, example = _converted("tiny_cnn", None)
    filled = next(n for n in converted.graph.nodes if reexport.is_filled(n))
    filled.args = (filled.args[0], 0.5, 1.0, *filled.args[3:])  # a float zero point: not this format
    assert reexport.template_parts(converted, example) is None


def test_no_template_unless_the_export_maps_node_for_node():
    converted, example = _converted("tiny_cnn", None)
    program = torch.export.export(converted, tuple(example))
    stored = programstore.encode(program, "spec")
    assert reexport.make_template(converted, program, stored) is not None
    node = next(n for n in program.graph.nodes if n.target is torch.ops.aten.relu.default)
    node.target = torch.ops.aten.sigmoid.default
    assert reexport.make_template(converted, program, stored) is None
    node.target = torch.ops.aten.relu.default
    name = next(iter(program.state_dict))
    program.state_dict[name] = program.state_dict[name] + 1  # a lifted tensor that is not the attribute
    assert reexport.make_template(converted, program, stored) is None


def test_template_with_wrong_literal_count_does_not_fill():
    converted, example = _converted("tiny_cnn", None)
    template = _template(converted, example)
    doc = json.loads(template.blobs["program.json"])
    nodes = doc["graph_module"]["graph"]["nodes"]
    nodes.remove(next(n for n in nodes if n["target"].endswith("quantize_per_tensor.default")))
    template.blobs["program.json"] = json.dumps(doc).encode()
    with pytest.raises(programstore.FormatError, match="do not match"):
        reexport.fill(template, converted, example, "spec")


@pytest.mark.parametrize("model,target", [("residual_cnn", "ethos-u55-128"), ("transformer_block", "tosa-int")])
def test_weights_edit_fills_the_template_and_lowers_to_stock_bytes(model, target, cache_dir, tmp_path_factory):
    cold = cold_cache(model, target, tmp_path_factory, cache_dir)
    assert counts(cold, "reexport") == {"miss": 1}
    edited, example = models.MODELS[model](edit="weights")
    weights = lowercache.lower(edited, example, target=target, cache_dir=cache_dir)
    assert counts(weights, "quantize") == {"miss": 1}
    assert counts(weights, "reexport") == {"hit": 1}
    assert weights.pte == reference(model, target, "weights")
    structure, example = models.MODELS[model](edit="structure")
    changed = lowercache.lower(structure, example, target=target, cache_dir=cache_dir)
    assert counts(changed, "reexport") == {"miss": 1}
    assert changed.pte == reference(model, target, "structure")


def test_unusable_template_exports_with_a_warning_and_is_replaced(cache_dir, caplog, monkeypatch, tmp_path_factory):
    cold_cache("residual_cnn", "ethos-u55-128", tmp_path_factory, cache_dir)
    store = Store(cache_dir)
    (key,) = [key for kind, key in store.actions() if kind == "reexport"]
    template = store.get("reexport", key)
    template.meta["tensors"][0][0] = "state_dict/no_such_tensor"
    store.put("reexport", key, template)
    store.close()
    edited, example = models.residual_cnn(edit="weights")
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        again = lowercache.lower(edited, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert counts(again, "reexport") == {"hit": 1}
    assert again.pte == reference("residual_cnn", "ethos-u55-128", "weights")
    assert any("re-export template unusable" in r.getMessage() for r in caplog.records)
    # The fresh template replaced the bad one: a run that misses the flow and the stage fills it.
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + "+test")
    monkeypatch.setattr(quantize, "QUANTIZE_VERSION", quantize.QUANTIZE_VERSION + "+test")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        third = lowercache.lower(edited, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert counts(third, "quantize") == {"miss": 1}
    assert counts(third, "reexport") == {"hit": 1}
    assert third.pte == again.pte
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_same_argument_rules():
    graph = torch.fx.Graph()
    a, b, c = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("c")
    mapped = {a: b}
    same = reexport._same_argument
    assert same((a, [1, 2]), (b, (1, 2)), mapped)  # lists and tuples alike
    assert not same((a,), (c,), mapped)  # a node must map to its counterpart
    assert same({"x": 1, "y": torch.float32}, {"y": torch.float32, "x": 1}, mapped)  # keyword order
    assert not same({"x": 1}, {"x": 1, "y": 2}, mapped)
    assert not same(1, 1.0, mapped) and not same(True, 1, mapped)  # types count
    assert not same(0.0, -0.0, mapped) and same(float("nan"), float("nan"), mapped)  # bits count
    assert not same(torch.ones(1), torch.ones(1), mapped)  # tensors are never inline arguments here


def test_graphs_that_could_read_tensor_values_are_not_keyed():
    converted, example = _converted("tiny_cnn", None)
    assert reexport.template_parts(converted, example) is not None
    attr = next(n for n in converted.graph.nodes if n.op == "get_attr")
    output = next(n for n in converted.graph.nodes if n.op == "output")
    with converted.graph.inserting_before(output):
        converted.graph.call_function(torch.ops.aten._local_scalar_dense.default, (attr,))
    assert reexport.template_parts(converted, example) is None  # item() of a constant: a value the key leaves out


def _key_forms(program) -> list:
    return [node_form(n) for n in program.graph.nodes]


@pytest.mark.parametrize("model", ["tiny_cnn", "transformer_block"])
def test_strict_template_restores_dynamos_metadata_on_a_weights_edit(model):
    """A strict export (aot_arm_compiler's default) is keyed apart, and a served one gets back what a fresh strict
    export carries that the stored form drops: ``tensor_meta``, ``example_value`` and ``eager_input_vals`` on nodes,
    dynamo's entries in the module's ``meta``."""
    base, example = _converted(model, None)
    edited, _ = _converted(model, "weights")
    strict_parts = reexport.template_parts(base, example, strict=True)
    assert strict_parts != reexport.template_parts(base, example)
    assert "strict" not in reexport.template_parts(base, example)  # lower's non-strict key is unchanged
    program = torch.export.export(base, tuple(example), strict=True)
    template = reexport.make_template(base, program, programstore.encode(program, "spec"), strict=True)
    assert template is not None and "derived" in template.meta
    fresh = torch.export.export(edited, tuple(example), strict=True)
    entry, doc = reexport.fill(template, edited, example, "spec")
    served = programstore.decode(entry, doc)
    assert _key_forms(served) != _key_forms(fresh)  # without restoring, the partitions' keys would differ
    reexport.restore(served, template.meta["derived"], edited)
    assert _key_forms(served) == _key_forms(fresh)
    assert canon(served.graph_module.meta) == canon(fresh.graph_module.meta)
    assert any("example_value" in n.meta for n in served.graph.nodes)
    assert all(n.meta["example_value"] is n.meta["val"] for n in served.graph.nodes if "example_value" in n.meta)


def _meta_forms(program) -> list:
    """Each node's metadata keys but those no exact rebuild gives (``seq_nr``, an autograd counter; ``original_aten``, an
    operator object of export's own), and its key form."""
    return [[n.name, sorted(set(n.meta) - {"seq_nr", "original_aten"}), node_form(n)] for n in program.graph.nodes]


@pytest.mark.parametrize("model", ["tiny_cnn", "transformer_block"])
def test_non_strict_template_restores_what_the_stored_form_drops(model):
    """A script's non-strict re-export under ``lowercache run`` is ``lower``'s step: served, it has a fresh export's
    ``tensor_meta`` and ``eager_input_vals`` on nodes and the converted module's entries in its module's ``meta``, as
    the same objects."""
    base, example = _converted(model, None)
    edited, _ = _converted(model, "weights")
    program = torch.export.export(base, tuple(example))
    template = reexport.make_template(base, program, programstore.encode(program, "spec"))
    assert template is not None and template.meta["strict"] is False and "derived" in template.meta
    fresh = torch.export.export(edited, tuple(example))
    entry, doc = reexport.fill(template, edited, example, "spec")
    served = programstore.decode(entry, doc)
    assert _meta_forms(served) != _meta_forms(fresh)  # the stored form alone lacks them
    reexport.restore(served, template.meta["derived"], edited)
    assert _meta_forms(served) == _meta_forms(fresh)
    assert any("eager_input_vals" in n.meta for n in served.graph.nodes)
    assert served.graph_module.meta.keys() == fresh.graph_module.meta.keys()
    assert all(served.graph_module.meta[k] is edited.meta[k] for k in edited.meta if fresh.graph_module.meta.get(k) is edited.meta[k])
    assert canon(served.graph_module.meta) == canon(fresh.graph_module.meta)


def test_non_strict_template_that_cannot_be_restored_is_kept_without_the_record():
    converted, example = _converted("tiny_cnn", None)
    program = torch.export.export(converted, tuple(example))
    stored = programstore.encode(program, "spec")
    node = next(n for n in program.graph.nodes if "tensor_meta" in n.meta)
    flipped = not node.meta["tensor_meta"].requires_grad
    node.meta["tensor_meta"] = node.meta["tensor_meta"]._replace(requires_grad=flipped)  # not what ``val`` gives
    template = reexport.make_template(converted, program, stored)
    assert template is not None and "derived" not in template.meta  # lower reads none of it: served as stored
    del node.meta["tensor_meta"]
    assert "derived" in reexport.make_template(converted, program, stored).meta
    program.graph_module.meta["unstorable"] = object()
    assert "derived" not in reexport.make_template(converted, program, stored).meta


def test_strict_template_is_not_kept_unless_restoring_is_exact():
    converted, example = _converted("tiny_cnn", None)
    program = torch.export.export(converted, tuple(example), strict=True)
    stored = programstore.encode(program, "spec")
    node = next(n for n in program.graph.nodes if "tensor_meta" in n.meta)
    node.meta["tensor_meta"] = node.meta["tensor_meta"]._replace(requires_grad=True)  # not what ``val`` gives
    assert reexport.make_template(converted, program, stored, strict=True) is None
    del node.meta["tensor_meta"]
    program.graph_module.meta["unstorable"] = object()
    assert reexport.make_template(converted, program, stored, strict=True) is None


def test_restore_refuses_a_record_that_does_not_fit():
    converted, example = _converted("tiny_cnn", None)
    program = torch.export.export(converted, tuple(example), strict=True)
    template = reexport.make_template(converted, program, programstore.encode(program, "spec"), strict=True)
    record = template.meta["derived"]
    entry, doc = reexport.fill(template, converted, example, "spec")
    with pytest.raises(programstore.FormatError, match="nodes"):
        reexport.restore(programstore.decode(entry, doc), {**record, "nodes": record["nodes"][:-1]}, converted)
    entry, doc = reexport.fill(template, converted, example, "spec")
    with pytest.raises(programstore.FormatError, match="unknown metadata"):
        reexport.restore(programstore.decode(entry, doc), {**record, "nodes": [["code"]] * len(record["nodes"])}, converted)
    entry, doc = reexport.fill(template, converted, example, "spec")
    with pytest.raises(programstore.FormatError, match="module metadata"):
        reexport.restore(programstore.decode(entry, doc), {**record, "module": {"dynamo_compile_id": {"compile_id": [0]}}}, converted)


def _stock_converted(model: str):
    """Quantized as a script does it with pt2e's own calls: the model's float weights stay, unread, beside the folded ones."""
    from executorch.backends.arm.ethosu import EthosUCompileSpec
    from executorch.backends.arm.quantizer import EthosUQuantizer, get_symmetric_quantization_config
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    module, example = models.MODELS[model]()
    quantizer = EthosUQuantizer(EthosUCompileSpec("ethos-u55-128"))
    quantizer.set_global(get_symmetric_quantization_config())
    prepared = prepare_pt2e(torch.export.export(module, example).module(check_guards=False), quantizer)
    prepared(*example)
    return convert_pt2e(prepared), example


@pytest.mark.parametrize("model", ["residual_cnn", "transformer_block", "tiny_cnn, stock"])
def test_non_strict_re_export_laid_out_as_strict_has_the_strict_key_forms(model):
    """The runner's re-export (``run/ahead.py``): the steps after it read what they would read after the strict one."""
    if model.endswith(", stock"):
        converted, example = _stock_converted(model.split(",")[0])
    else:
        converted, example = _converted(model, "structure")
    strict = torch.export.export(converted, tuple(example), strict=True)
    plain = torch.export.export(converted, tuple(example))
    assert _key_forms(plain) != _key_forms(strict)  # the layout is what differs
    laid_out = reexport.laid_out_as_strict(plain, converted)
    assert laid_out is not None
    assert _key_forms(laid_out) == _key_forms(strict)
    assert str(laid_out.graph_signature) == str(strict.graph_signature)
    assert laid_out.graph_module.code == strict.graph_module.code
    assert list(laid_out.state_dict) == list(strict.state_dict)


def test_no_strict_layout_for_a_tensor_the_graph_does_not_read():
    converted, example = _converted("tiny_cnn", None)
    plain = torch.export.export(converted, tuple(example))
    first = next(n for n in converted.graph.nodes if n.op == "get_attr")
    first.target = "_not_lifted"  # the program's lifted tensor is now read by no get_attr, yet used
    assert reexport.laid_out_as_strict(plain, converted) is None
