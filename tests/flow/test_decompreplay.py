"""Localized decompositions replayed from stored templates: the program a trace gives, and stock bytes."""

from __future__ import annotations

import logging

import pytest
import torch

from lowercache.speedups import decompositions, decompreplay
from lowercache.bench import models
from lowercache.api import lower
from lowercache.cache.steps import Session, activate
from lowercache.cache.store import Entry, Store

from tests.helpers.graphs import ConvertsAndReshapes, same_program
from tests.helpers.oracle import reference


RUN_DECOMPOSITIONS = torch.export.ExportedProgram.run_decompositions


def _chains(program: torch.export.ExportedProgram) -> list:
    """Every node's ``from_node`` chain by name, target, pass and action (graph ids differ between traces)."""
    return [decompreplay._chain_shape(n.meta.get("from_node")) for n in program.graph.nodes]


def _functionalize_twice(program, store):
    """The functionalizing call traced (templates stored), then replayed; with the replay count."""
    with activate(Session(store)):
        traced = decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    decompositions.reset_stats()
    with activate(Session(store)) as session:
        replayed = decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    hits = [r for r in session.records if r.kind == decompreplay.KIND and r.outcome == "hit"]
    return traced, replayed, decompositions.stats()["replayed"], hits


@pytest.mark.parametrize(
    "build",
    [models.residual_cnn, models.transformer_block, lambda: (ConvertsAndReshapes(), (torch.randn(6),))],
    ids=["residual_cnn", "transformer_block", "converts_and_reshapes"],
)
def test_a_replay_gives_the_program_the_trace_gives(build, cache_dir):
    module, example = build()
    program = torch.export.export(module, example)
    traced, replayed, count, hits = _functionalize_twice(program, Store(cache_dir))
    assert count == 1 and hits
    same_program(replayed, traced)
    assert _chains(replayed) == _chains(traced)
    assert [list(n.meta) for n in replayed.graph.nodes] == [list(n.meta) for n in traced.graph.nodes]  # key order
    same_program(replayed, RUN_DECOMPOSITIONS(program, {}))  # and the real call's


def test_a_replayed_table_call_with_chained_candidates_is_the_traced_one(cache_dir):
    """Candidates that read other candidates (``transpose`` of a ``view``, ``matmul``...) replay too."""
    module, example = models.transformer_block()
    functional = RUN_DECOMPOSITIONS(torch.export.export(module, example), {})
    table = torch.export.default_decompositions()
    candidates, _ = decompositions._candidates(functional, table)
    assert any(set(c.all_input_nodes) & set(candidates) for c in candidates)  # a chain
    store = Store(cache_dir)
    programs = []
    for _ in range(2):
        program = decompositions._copied(functional)
        decompositions.reset_stats()
        with activate(Session(store)):
            decompositions.localize(program, table, RUN_DECOMPOSITIONS)
        programs.append((program, decompositions.stats()["replayed"]))
    (traced, first), (replayed, second) = programs
    assert (first, second) == (0, 1)
    same_program(replayed, traced)
    assert _chains(replayed) == _chains(traced)
    assert [list(n.meta) for n in replayed.graph.nodes] == [list(n.meta) for n in traced.graph.nodes]


def test_without_a_session_nothing_is_stored_or_replayed(cache_dir):
    module, example = models.residual_cnn()
    program = torch.export.export(module, example)
    decompositions.reset_stats()
    decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    assert decompositions.stats()["replayed"] == 0


def test_an_unusable_template_is_traced_again_with_a_warning(cache_dir, caplog):
    module, example = models.residual_cnn()
    program = torch.export.export(module, example)
    store = Store(cache_dir)
    with activate(Session(store)) as session:
        traced = decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    stored = [r for r in session.records if r.kind == decompreplay.KIND]
    assert stored and all(r.outcome == "miss" for r in stored)
    entry = store.get(decompreplay.KIND, stored[0].key)
    entry.meta["template"]["nodes"][0]["op"] = "os::system.default"  # never resolved, never run
    store.put(decompreplay.KIND, stored[0].key, Entry(meta=entry.meta))
    decompositions.reset_stats()
    with caplog.at_level(logging.WARNING, logger="lowercache"), activate(Session(store)):
        again = decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    assert decompositions.stats()["replayed"] == 0
    assert any("unusable" in r.getMessage() for r in caplog.records)
    same_program(again, traced)
    _, _, count, _ = _functionalize_twice(program, store)  # the trace wrote a good template back
    assert count == 1


def test_a_different_input_shape_is_another_key():
    module, _ = models.residual_cnn()
    small = torch.export.export(module, (torch.randn(1, 3, 16, 16),))
    large = torch.export.export(module, (torch.randn(1, 3, 24, 24),))

    def parts(program):
        candidates, _ = decompositions._candidates(program, {})
        return [decompreplay.key_parts(c, "none", "toolchain") for c in candidates]

    assert parts(small) == parts(torch.export.export(module, (torch.randn(1, 3, 16, 16),)))
    differ = [a["inputs"] != b["inputs"] for a, b in zip(parts(small), parts(large))]
    assert differ[0] and not all(differ)  # the first batch norm reads the image; the pooled tail does not


def _reordered(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy whose operator nodes hold the same metadata in another insertion order (traced fields reversed).

    A program served from a stored form (a re-export template) holds its nodes' fields in the order they were
    written, a fresh export in the order the tracer set them: the same values either way.
    """
    from torch.fx.proxy import _COPY_META_FIELDS

    copy = decompositions._copied(program)
    for node in copy.graph.nodes:
        traced = [k for k in node.meta if k in _COPY_META_FIELDS]
        if node.op == "call_function" and len(traced) > 1:
            node.meta = {**{k: node.meta[k] for k in reversed(traced)}, **node.meta}
    return copy


def test_a_candidates_key_is_the_same_whatever_order_its_metadata_was_set_in(cache_dir):
    """The trace copies a candidate's fields in torch's own order, so the key names them in that order too:
    a program whose fields were set in another order replays what the first one stored (a miss under
    ``lowercache run`` between a new process and a server child, ExecuTorch's test_max_pool2d_tosa_INT)."""
    module, example = models.residual_cnn()
    program = torch.export.export(module, example)
    reordered = _reordered(program)
    candidates = decompositions._candidates(reordered, {})[0]
    assert any(list(c.meta) != list(o.meta) for c, o in zip(candidates, decompositions._candidates(program, {})[0]))
    store = Store(cache_dir)
    with activate(Session(store)):
        decompositions.localize_functionalization(program, RUN_DECOMPOSITIONS)
    decompositions.reset_stats()
    with activate(Session(store)):
        replayed = decompositions.localize_functionalization(reordered, RUN_DECOMPOSITIONS)
    assert decompositions.stats()["replayed"] == 1
    traced = decompositions.localize_functionalization(_reordered(program), RUN_DECOMPOSITIONS)  # no session: a trace
    same_program(replayed, traced)
    assert [list(n.meta) for n in replayed.graph.nodes] == [list(n.meta) for n in traced.graph.nodes]


def test_tables_with_functions_from_elsewhere_are_not_keyed():
    def mine(x):
        return x

    assert decompreplay.table_digest({}) == "none"
    assert decompreplay.table_digest({torch.ops.aten.relu.default: torch._refs.nn.functional.relu}) is not None
    assert decompreplay.table_digest({torch.ops.aten.relu.default: mine}) is None


def test_decoding_refuses_what_it_cannot_check():
    good = {"nodes": [{"op": "aten::relu.default", "args": [["in", 0]], "kwargs": [], "meta": [["val", "val"]], "from_node": []}], "out": ["body", 0]}
    assert decompreplay.decode(good, 1)["nodes"][0][0] is torch.ops.aten.relu.default
    for bad in (
        {**good, "out": ["body", 1]},  # a node not made
        {**good, "nodes": [{**good["nodes"][0], "args": [["in", 1]]}]},  # an input the candidate lacks
        {**good, "nodes": [{**good["nodes"][0], "op": "builtins::eval.default"}]},
        {**good, "nodes": [{**good["nodes"][0], "meta": [["val", "tensor_meta"]]}]},
        {**good, "nodes": [{**good["nodes"][0], "args": [["lit", {"object": "x"}]]}]},
        "not a template",
    ):
        with pytest.raises(decompreplay.Refused):
            decompreplay.decode(bad, 1)


@pytest.mark.parametrize(
    "model, target", [("residual_cnn", "tosa-fp"), ("residual_cnn", "ethos-u55-128"), ("transformer_block", "tosa-fp")]
)
def test_an_edited_model_replays_its_decompositions_and_gives_stock_bytes(model, target, tmp_path):
    from lowercache.bench.harness import _settings

    base, example = models.MODELS[model]()
    lower(base, example, target=target, name="m", settings=_settings(tmp_path))
    edited, example = models.MODELS[model](edit="structure")
    decompositions.reset_stats()
    result = lower(edited, example, target=target, name="m", settings=_settings(tmp_path))
    assert decompositions.stats()["replayed"] >= 1
    assert result.pte == reference(model, target, "structure")
