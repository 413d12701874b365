"""Regions and the pass census on the benchmark's small models (real exports, real Arm pipeline)."""

from __future__ import annotations

import collections

import pytest
import torch

from benchmarks import pass_census as census
from lowercache.bench.models import EDITED_BLOCKS, MODELS
from lowercache.cache.steps import Session
from lowercache.cache.store import Store
from lowercache.lowering.replay import regions
from lowercache.targets import resolve

from tests.helpers import ROOT

SMALL = ("tiny_cnn", "residual_cnn", "transformer_block")


def _program(name: str, edit: str | None = None) -> torch.export.ExportedProgram:
    module, example_inputs = MODELS[name](edit=edit)
    return torch.export.export(module, tuple(example_inputs))


def _depth(name: str) -> int:
    return len(EDITED_BLOCKS[name].split("."))


@pytest.fixture(scope="module")
def programs() -> dict[tuple[str, str | None], torch.export.ExportedProgram]:
    return {(name, edit): _program(name, edit) for name in SMALL for edit in (None, "structure", "weights")}


@pytest.mark.parametrize("name", SMALL)
def test_cut_is_stable_and_covers_every_node_once(programs, name):
    ep = programs[(name, None)]
    cut = regions.cut(ep.graph_module, _depth(name))
    names = [n for region in cut for n in region.nodes]
    operators = [n.name for n in ep.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
    assert sorted(names) == sorted(operators)
    assert len(names) == len(set(names))
    assert EDITED_BLOCKS[name] in [r.name for r in cut]
    assert regions.cut(_program(name).graph_module, _depth(name)) == cut  # a fresh export cuts the same
    assert regions.region_keys(_program(name), _depth(name)) == regions.region_keys(ep, _depth(name))


@pytest.mark.parametrize("name", SMALL)
def test_a_one_block_edit_changes_that_regions_key_only(programs, name):
    base = regions.region_keys(programs[(name, None)], _depth(name))
    for edit in ("structure", "weights"):
        edited = regions.region_keys(programs[(name, edit)], _depth(name))
        assert edited.keys() == base.keys()
        assert [r for r in base if base[r] != edited[r]] == [EDITED_BLOCKS[name]], edit


@pytest.mark.parametrize("name", SMALL)
def test_a_weights_edit_changes_only_that_regions_constants(programs, name):
    base = regions.region_parts(programs[(name, None)], _depth(name))
    edited = regions.region_parts(programs[(name, "weights")], _depth(name))
    changed = {(r, part) for r in base for part in base[r] if base[r][part] != edited[r][part]}
    assert changed == {(EDITED_BLOCKS[name], "constants")}
    structure = regions.region_parts(programs[(name, "structure")], _depth(name))
    assert structure[EDITED_BLOCKS[name]]["nodes"] != base[EDITED_BLOCKS[name]]["nodes"]
    assert structure[EDITED_BLOCKS[name]]["constants"] == base[EDITED_BLOCKS[name]]["constants"]


def test_quantize_and_dequantize_nodes_join_the_block_they_serve():
    """The quantizer's q/dq nodes carry only the root's module stack; they go with the block they feed or follow."""
    module, example_inputs = MODELS["tiny_cnn"]()
    edge, _spec = census.pipeline_input(torch.export.export(module, example_inputs), resolve("ethos-u55-128"), example_inputs, [example_inputs])
    members = regions.membership(edge.graph_module, 1)
    conv = next(n for n in edge.graph_module.graph.nodes if "convolution" in n.name and members[n] == "block2")
    weight_dq = [a for a in conv.all_input_nodes if "dequantize_per_channel" in a.name]
    assert weight_dq and all(members[a] == "block2" for a in weight_dq)
    assert all(members[a] == "block2" for a in conv.all_input_nodes)


def test_quantized_region_keys_are_stable_and_an_edit_dirties_its_consumers():
    """On the quantized pipeline input the keys do not depend on what ran earlier in the process
    (torch's dynamo-disable marks in ``custom``), and a weights edit of ``mlp`` changes ``mlp``
    and the residual add that reads its output scale, nothing else."""

    def keys(edit: str | None) -> dict[str, dict[str, str]]:
        module, example_inputs = MODELS["transformer_block"](edit=edit)
        edge, _spec = census.pipeline_input(torch.export.export(module, example_inputs), resolve("ethos-u55-128"), example_inputs, [example_inputs])
        return regions.region_parts(edge, 1)

    first, again, edited = keys(None), keys(None), keys("weights")
    assert again == first
    changed = {r: sorted(k for k in first[r] if first[r][k] != edited[r][k]) for r in first if first[r] != edited[r]}
    assert changed == {"mlp": ["boundary", "constants", "nodes"], "(top)": ["boundary", "nodes"]}


def test_name_relation():
    assert regions.name_relation(["a_1", "b"], ["a_1", "b"]) == "same"
    assert regions.name_relation(["conv_3", "relu_2"], ["conv_1", "relu"]) == "offset"
    assert regions.name_relation(["conv_3", "conv_5"], ["conv", "conv_1"]) == "renumbered"


@pytest.fixture(scope="module")
def tiny_census(tmp_path_factory):
    """The census of tiny_cnn on TOSA-FP, twice through one store: (first, second, outcomes)."""
    store = Store(tmp_path_factory.mktemp("census-cache"))
    results, outcomes = [], []
    for _ in range(2):
        module, example_inputs = MODELS["tiny_cnn"]()
        session = Session(store)
        program = torch.export.export(module, example_inputs)
        results.append(census.census(program, resolve("tosa-fp"), example_inputs, None, session, 1, "tiny_cnn"))
        outcomes.append([r.outcome for r in session.records if r.kind == "census"])
    return results[0], results[1], outcomes


def _rows(result: dict, name: str) -> list[dict]:
    rows = [r for r in result["passes"] if r["pass"] == name]
    assert rows, name
    return rows


def test_census_follows_stock_and_covers_the_pipeline(tiny_census):
    result = tiny_census[0]
    assert result["faithful"]  # the pass-by-pass run ends where the stock pipeline does
    assert result["regions"] == ["block1", "block2", "(top)", "fc"]
    assert len(result["passes"]) > 100
    counts = collections.Counter(r["class"] for r in result["passes"])
    assert set(counts) <= set(census.CLASSES) and counts[census.GLOBAL] >= 1


def test_census_classifies_a_per_node_decomposition_as_local(tiny_census):
    """DecomposeLinearPass rewrites each linear node in place of itself; only the names it picks
    come from the whole graph's namespace (a counter at the region's start decides them)."""
    (row,) = _rows(tiny_census[0], "DecomposeLinearPass")
    assert row["outcome"] == "ran"
    assert row["class"] == census.GIVEN_FACTS
    assert row["facts"] == ["name counter (offset)"]
    assert row["regions"]["fc"]["class"] == census.GIVEN_FACTS
    assert all(v["class"] == census.LOCAL for r, v in row["regions"].items() if r != "fc")


def test_census_classifies_permute_propagation_as_global(tiny_census):
    """PropagateViewCopyPermuteDownPass moves permutes through the graph, across region boundaries."""
    (row,) = _rows(tiny_census[0], "PropagateViewCopyPermuteDownPass")
    assert row["class"] == census.GLOBAL
    assert any("boundary" in f or "layout" in f for f in row["facts"])


def test_census_is_a_cached_step(tiny_census):
    first, second, outcomes = tiny_census
    assert outcomes == [["miss"], ["hit"]]
    assert second == first


def test_the_upstream_naming_patch_makes_a_splices_names_not_matter():
    """docs/upstream's pass: stock's graph at the layout split, renamed as a splice would leave it, ends the same.

    Without the pass the ends differ (names minted from whole-graph counters);
    this is what holds exact region replay back (docs/regions.md).
    """
    import json
    import subprocess
    import sys

    script = ROOT / "benchmarks" / "canonical_names.py"
    done = subprocess.run(
        [sys.executable, str(script), "--models", "tiny_cnn", "--targets", "tosa-fp"], capture_output=True, text=True, timeout=900, check=True
    )
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["minted constants renamed"] > 0
    assert row["same as stock ends"] is False
    assert row["same with the pass"] is True, row["differs with the pass"]
    assert row["pte bytes with the pass"] > 0
