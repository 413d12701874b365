"""The stored form of a region's state at the split (``lowering/replay/regionstore.py``): a round trip keeps every node,
argument and piece of metadata a later pass or the TOSA graph reads, and a tampered entry is refused, not run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import pass_census as census
from lowercache.bench.models import MODELS
from lowercache.cache.store import Entry
from lowercache.lowering.replay import regionsplice, regionstore
from lowercache.lowering.stored.programstore import FormatError
from lowercache.targets import resolve

from tests.helpers.graphs import describe


def _pipeline_input(name: str) -> tuple:
    module, example = MODELS[name]()
    return census.pipeline_input(torch.export.export(module, example), resolve("ethos-u55-128"), example, [example])


def _states(name: str) -> list[regionsplice.RegionState]:
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    edge, spec = _pipeline_input(name)
    with ArmPassManager(spec)._tosa_context(edge.graph_module):
        states, _split, _whole = regionsplice.run_prefix(edge, spec, regionsplice.choose_depth(edge))
    return states


@pytest.mark.parametrize("name", ["tiny_cnn", "residual_cnn", "mobilenet_v2"])
def test_a_plan_without_programs_has_the_extracted_states_boundaries(name):
    """``transform`` plans without extracting each region's program (it never runs one): the inputs and outputs it
    serves and wires by are those the extracted programs have."""
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    edge, spec = _pipeline_input(name)
    with ArmPassManager(spec)._tosa_context(edge.graph_module):
        depth = regionsplice.choose_depth(edge)
        whole = regionsplice.plan(edge, spec, depth)
        light = regionsplice.plan(edge, spec, depth, extract=False)
    assert len(whole.states) > 1
    assert [(s.name, s.inputs, s.outputs) for s in light.states] == [(s.name, s.inputs, s.outputs) for s in whole.states]
    assert light.wiring == whole.wiring and light.split == whole.split
    assert all(s.program is None for s in light.states)


def _kept(program) -> list:
    return [(*d[:5], {k: v for k, v in d[5].items() if k not in regionstore.DROPPED_META}) for d in describe(program)]


@pytest.fixture(scope="module")
def states() -> list[regionsplice.RegionState]:
    return _states("residual_cnn")


def test_a_region_state_round_trips(states):
    for state in states:
        entry = regionstore.encode(state.program, {"outputs": state.outputs})
        back, extra = regionstore.decode(entry, state.program)
        assert _kept(back) == _kept(state.program), state.name
        assert back.graph_signature == state.program.graph_signature
        assert extra == {"outputs": state.outputs}
        for name, value in {**state.program.state_dict, **state.program.constants}.items():
            stored = back.state_dict.get(name, back.constants.get(name))
            assert stored.dtype == value.dtype and torch.equal(stored, value), name
        assert regionstore.fake_mode(back) is regionstore.fake_mode(state.program)


def test_metadata_round_trips_alone(states):
    node = next(n for n in states[0].program.graph_module.graph.nodes if n.meta.get("output_qparams"))
    form = regionstore.encode_meta(node.meta)
    back = regionstore.decode_meta(json.loads(json.dumps(form)), regionstore.fake_mode(states[0].program))
    assert back["output_qparams"] == node.meta["output_qparams"]
    assert back["val"].shape == node.meta["val"].shape and back["val"].dtype == node.meta["val"].dtype


@pytest.mark.parametrize(
    "tamper",
    [
        lambda doc: doc["nodes"][-2].update(target=["python", "system", ""]),
        lambda doc: doc["nodes"][-2].update(target=["torch", "os::system", "default"]),
        lambda doc: doc["nodes"][-2].update(target=["edge", "aten::__class__", "default"]),
        lambda doc: doc["nodes"][-2]["meta"].update(val={"pickle": "cos\nsystem\n"}),
        lambda doc: doc["nodes"][-1].update(args={"tuple": [{"node": 10_000}]}),
        lambda doc: doc.update(nodes=doc["nodes"][:-1]),
    ],
)
def test_a_tampered_state_is_refused(states, tamper):
    entry = regionstore.encode(states[0].program)
    doc = json.loads(entry.blobs["program.json"])
    tamper(doc)
    bad = Entry(meta=entry.meta, blobs={**entry.blobs, "program.json": json.dumps(doc).encode()})
    with pytest.raises(FormatError):
        regionstore.decode(bad, states[0].program)


def test_garbage_is_refused(states):
    entry = regionstore.encode(states[0].program)
    for blobs in ({**entry.blobs, "program.json": b"{not json"}, {**entry.blobs, "tensors": b""}, {}):
        with pytest.raises(FormatError):
            regionstore.decode(Entry(meta=entry.meta, blobs=blobs), states[0].program)
