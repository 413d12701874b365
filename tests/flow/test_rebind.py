"""The ``rebind`` speed-up: after a weights-only change the edge program is served from its structure, and every
.pte is stock's (issue 54; docs/rebind.md)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import lowercache
from lowercache.bench import models, weights
from lowercache.cache import history
from lowercache.cache.hashing import without_process_marks
from lowercache.cache.store import Entry, Store
from lowercache.lowering import arm, quantize, rebind
from lowercache.targets import resolve
from lowercache.speedups import registry

from tests.helpers.oracle import stock_pte

TARGETS = ("tosa-int", "ethos-u55-128", "ethos-u85-256")


@pytest.fixture(autouse=True)
def _rebind_on(monkeypatch):
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "all,rebind")
    yield
    registry.select("all")


def _edge(artifacts) -> list[dict]:
    return [r for r in artifacts.records if r["kind"] == "edge"]


def _edit_cases() -> list[tuple[str, str, tuple[str, ...]]]:
    """Every kind of edit on every target for the tiny CNN; for the larger small models one kind per target, in
    rotation, so that each model meets each kind and each target (the census, docs/rebind.md, lowers the whole product).
    A stock lowering of those is 17-20 s of CPU: the whole product here would be four more worker-minutes."""
    kinds = weights.KINDS
    return [(model, target, kinds if model == "tiny_cnn" else (kinds[(i + j) % len(kinds)],))
            for j, model in enumerate(models.SMALL) for i, target in enumerate(TARGETS)]


@pytest.mark.parametrize(("model", "target", "kinds"), [pytest.param(*case, id=f"{case[0]}-{case[1]}-{'+'.join(case[2])}")
                                                       for case in _edit_cases()])
def test_weights_edits_are_served_and_give_stocks_bytes(model, target, kinds, tmp_path):
    """A retrained checkpoint, one block's weights, a fine-tuned head: each served from the base's template, each
    .pte stock's."""
    module, example = models.MODELS[model]()
    base = lowercache.lower(module, example, target=target, cache_dir=tmp_path)
    assert [r["outcome"] for r in _edge(base)] == ["miss"]
    assert base.pte == stock_pte(module, example, target)
    for kind in kinds:
        edited, example = weights.edited(model, kind, seed=1)
        artifacts = lowercache.lower(edited, example, target=target, cache_dir=tmp_path)
        (record,) = _edge(artifacts)
        assert record["outcome"] == "hit" and record["note"].startswith("re-bound"), (kind, record)
        assert artifacts.manifest["step_counts"]["flow"] == {"miss": 1}
        assert artifacts.pte == stock_pte(edited, example, target), kind
        assert artifacts.pte != base.pte


def _quantized(module, example, target: str):
    resolved = resolve(target)
    spec = resolved.compile_spec()
    return quantize.run_stock(torch.export.export(module, example), resolved, spec, example, [example]), resolved, spec


def _stock_edge(program, resolved, spec):
    """``_gen_edge_manager_for_partitioners`` as the flow runs it without ``rebind`` (the other speed-ups on)."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program import _program

    registry.select("all")
    config = EdgeCompileConfig()
    with arm.hooks():
        manager = _program._gen_edge_manager_for_partitioners({"forward": [resolved.partitioner(spec)]}, {"forward": program}, config,
                                                              None, False)
    return manager, config


def _form(program) -> list:
    """``rebind``'s comparison form, without the marks torch's dynamo-disable wrapper leaves in ``custom`` on the
    first export of a process (``hashing.without_process_marks``: no byte reads them, and every key leaves them out)."""
    for node in program.graph.nodes:
        if "custom" in node.meta:
            node.meta["custom"] = without_process_marks(node.meta["custom"])
    return rebind._program_form(program)


def test_the_served_edge_program_is_stocks_node_for_node():
    """The base's template filled with a retrained checkpoint's values is the edge program stock makes from it:
    every node, name, argument and metadata key (provenance aside), the name table, signature, constants (the very
    tensors), verifier and codegen."""
    base_module, example = models.MODELS["transformer_block"]()
    base, resolved, spec = _quantized(base_module, example, "tosa-int")
    edited, _, _ = _quantized(weights.edited("transformer_block", "retrained", 1)[0], example, "tosa-int")
    manager, config = _stock_edge(base, resolved, spec)
    before = copy.copy(config)
    before._core_aten_ops_exception_list = []
    template = rebind.make_template(manager.exported_program(), base, before, list(manager.exported_program().verifiers[0]()._preserve_ops))
    assert template.meta.get("format") == rebind.VERSION, template.meta
    served, kept = rebind.fill(template, edited, copy.copy(before))
    stock, _ = _stock_edge(edited, resolved, spec)
    assert _form(served) == _form(stock.exported_program())
    assert rebind._pairs(served.graph_module) != rebind._pairs(base.graph_module)  # the values did change


def test_the_key_leaves_out_values_and_nothing_else():
    module, example = models.MODELS["tiny_cnn"]()
    base, resolved, spec = _quantized(module, example, "ethos-u55-128")
    partitioners = [resolved.partitioner(spec)]
    from executorch.exir import EdgeCompileConfig

    parts = rebind.edge_parts(base, partitioners, EdgeCompileConfig())
    for kind in weights.KINDS:
        edited, _, _ = _quantized(weights.edited("tiny_cnn", kind, 1)[0], example, "ethos-u55-128")
        assert rebind.edge_parts(edited, partitioners, EdgeCompileConfig()) == parts, kind
    structure, _, _ = _quantized(models.tiny_cnn(edit="structure")[0], example, "ethos-u55-128")
    changed = rebind.edge_parts(structure, partitioners, EdgeCompileConfig())
    assert changed["graph"] != parts["graph"]
    other = resolve("ethos-u85-256")
    assert rebind.edge_parts(base, [other.partitioner(other.compile_spec())], EdgeCompileConfig())["partitioner"] != parts["partitioner"]
    filled = next(n for n in base.graph.nodes if rebind._filled(n))
    filled.args = (*filled.args[:3], filled.args[3] + 1, *filled.args[4:])  # quant_min is structure, not filled
    assert rebind.edge_parts(base, partitioners, EdgeCompileConfig())["graph"] != parts["graph"]


def test_a_template_that_does_not_fit_is_a_warning_a_stock_run_and_replaced(tmp_path, caplog):
    module, example = models.MODELS["tiny_cnn"]()
    base = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path)
    (record,) = _edge(base)
    store = Store(tmp_path)
    try:
        entry = store.get("edge", record["key"])
        broken = Entry(meta={**entry.meta, "literals": entry.meta["literals"][:-1]}, blobs=dict(entry.blobs))
        store.put("edge", record["key"], broken)
    finally:
        store.close()
    edited, example = weights.edited("tiny_cnn", "retrained", 1)
    with caplog.at_level(logging.WARNING, logger="lowercache"):
        artifacts = lowercache.lower(edited, example, target="ethos-u55-128", cache_dir=tmp_path)
    assert "cached edge template unusable" in caplog.text
    assert artifacts.pte == stock_pte(edited, example, "ethos-u55-128")
    again, example = weights.edited("tiny_cnn", "retrained", 2)
    served = lowercache.lower(again, example, target="ethos-u55-128", cache_dir=tmp_path)
    assert _edge(served)[0]["note"].startswith("re-bound")  # the replaced template serves
    assert served.pte == stock_pte(again, example, "ethos-u55-128")


class _Twins(nn.Module):
    """Two convolutions of one input: while their weights are equal, the TOSA pipeline's
    ``FuseEqualPlaceholdersPass`` keeps one copy of their constants, a decision on values (docs/rebind.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def _twins(equal: bool) -> nn.Module:
    model = _Twins().eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for conv in (model.a, model.b):
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator))
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator))
        if equal:
            model.b.weight.copy_(model.a.weight)
            model.b.bias.copy_(model.a.bias)
    return model


def _tosa_operators(artifacts) -> int:
    from tosa.TosaGraph import TosaGraph

    graph = TosaGraph.GetRootAs(artifacts.files["partition_0.tosa"], 0)
    return graph.Regions(0).Blocks(0).OperatorsLength()


def test_a_value_decision_after_the_served_step_is_stocks(tmp_path):
    """Weights that move a decision the TOSA pipeline takes on values (equal constants kept once): the edge program
    is served for the second, the pipeline runs stock on both and decides each way as stock does."""
    example = (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)),)
    equal, different = _twins(True), _twins(False)
    first = lowercache.lower(equal, example, target="tosa-int", cache_dir=tmp_path)
    second = lowercache.lower(different, example, target="tosa-int", cache_dir=tmp_path)
    assert [r["outcome"] for r in _edge(second)] == ["hit"]
    assert _tosa_operators(first) < _tosa_operators(second)  # equal constants were kept once, different ones twice
    assert first.pte == stock_pte(equal, example, "tosa-int")
    assert second.pte == stock_pte(different, example, "tosa-int")


def test_explain_names_what_was_re_bound(tmp_path):
    module, example = models.MODELS["tiny_cnn"]()
    lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path, name="tiny")
    edited, example = weights.edited("tiny_cnn", "head", 1)
    lowercache.lower(edited, example, target="ethos-u55-128", cache_dir=tmp_path, name="tiny")
    store = Store(tmp_path)
    try:
        lines = history.explain(store, "tiny", "ethos-u55-128")
    finally:
        store.close()
    assert any(line.startswith("rebind: edge program: re-bound") for line in lines), lines


def test_off_unless_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "all")
    module, example = models.MODELS["tiny_cnn"]()
    artifacts = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path)
    assert _edge(artifacts) == []
    assert artifacts.manifest["speedups"]["rebind"] == "off: disabled by setting"


_LOWER_IN_A_NEW_PROCESS = """
import json, sys
import lowercache
from lowercache.bench import models, weights
kind, target, cache, out = sys.argv[1:]
module, example = models.MODELS["tiny_cnn"]() if kind == "base" else weights.edited("tiny_cnn", kind, seed=1)
artifacts = lowercache.lower(module, example, target=target, cache_dir=cache)
open(out, "wb").write(artifacts.pte)
print(json.dumps([r for r in artifacts.records if r["kind"] == "edge"]))
"""


@pytest.mark.parametrize("target", ["tosa-fp", "ethos-u55-128"])
def test_a_template_made_in_one_process_serves_in_another(target, tmp_path):
    """to_edge defines an operator of its own for each one the partitioner keeps (``EDGE_DO_NOT_DECOMP::linear``),
    and the edge program's metadata names it; a new process has not defined it yet. The served call defines it as
    stock's call would, so a retrained checkpoint lowered by the next command is served, with no warning."""
    import json
    import subprocess
    import sys

    def lower(kind: str) -> tuple[list[dict], bytes, str]:
        out = tmp_path / f"{kind}.pte"
        result = subprocess.run([sys.executable, "-c", _LOWER_IN_A_NEW_PROCESS, kind, target, str(tmp_path / "cache"), str(out)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1]), out.read_bytes(), result.stderr

    (made,), _, _ = lower("base")
    assert made["outcome"] == "miss" and made["note"] == "template recorded", made
    (served,), pte, stderr = lower("retrained")
    warnings = [line for line in stderr.splitlines() if line.startswith(("WARNING:lowercache", "lowercache: warning"))]
    assert warnings == [], stderr[-3000:]
    assert served["outcome"] == "hit" and served["note"].startswith("re-bound"), served
    edited, example = weights.edited("tiny_cnn", "retrained", seed=1)
    assert pte == stock_pte(edited, example, target)
