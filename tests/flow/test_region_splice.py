"""The ``regions`` speed-up: the TOSA pipeline run region by region up to the first layout pass, then spliced.

For Ethos-U targets only; the ``.pte`` must be stock's byte for byte and each
``partition_N.tosa`` equal to stock's up to names and constant order
(``lowering/replay/tosacanon.py``). Cold, then one block edited into the same cache,
as a user edits; an unprovable case falls back and says why.
"""

from __future__ import annotations

import pytest

import lowercache
from lowercache.bench import models
from lowercache.cache.history import explain
from lowercache.cache.store import Store
from lowercache.lowering.replay.tosacanon import equal_up_to_names

from tests.helpers.oracle import stock_pte

TARGET = "ethos-u55-128"


def _lower(name: str, edit: str | None, cache, monkeypatch, speedups: str, target: str = TARGET) -> lowercache.Artifacts:
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", speedups)
    module, example = models.MODELS[name](edit=edit)
    return lowercache.lower(module, example, target=target, cache_dir=cache)


def _regions(artifacts: lowercache.Artifacts) -> list[dict]:
    return [s for s in artifacts.manifest["steps"] if s["kind"] == "regions"]


def _verdicts(step: dict) -> dict[str, str]:
    return dict(item.split(": ", 1) for item in step["note"].split(" | "))


def _same_as_stock(name: str, edit: str | None, spliced: lowercache.Artifacts, reference: lowercache.Artifacts,
                   target: str = TARGET) -> None:
    module, example = models.MODELS[name](edit=edit)
    assert spliced.pte == reference.pte == stock_pte(module, example, target), (name, edit, target)
    tosa = [k for k in spliced.files if k.endswith(".tosa")]
    assert tosa and all(equal_up_to_names(spliced.files[k], reference.files[k]) for k in tosa), (name, edit)


@pytest.mark.parametrize("name", ["tiny_cnn", "residual_cnn"])
def test_spliced_lowering_is_stock_cold_and_after_an_edit(name, tmp_path, monkeypatch):
    """Cold, the whole pipeline runs and each region's state at the split is stored; after an edit, the regions
    before the edited block are served and the rest runs as one program."""
    edited = models.EDITED_BLOCKS[name]
    for edit in (None, "structure"):
        spliced = _lower(name, edit, tmp_path / "cache", monkeypatch, "all,regions")
        reference = _lower(name, edit, tmp_path / "reference", monkeypatch, "all")
        (step,) = _regions(spliced)
        assert not _regions(reference)
        verdicts = _verdicts(step)
        assert edited in verdicts, step
        order = list(verdicts)
        if edit is None:
            assert step["outcome"] == "recorded" and "none served from the cache" in step["name"], step
            assert all(v.startswith("re-ran") and v.endswith("; stored") for v in verdicts.values()), verdicts
        else:
            assert step["outcome"] == "spliced", step
            upstream = order[: order.index(edited)]
            assert upstream and all(verdicts[r] == "served" for r in upstream), verdicts
            assert verdicts[edited].startswith("re-ran: no stored state"), verdicts
            assert all("dirty tail" in verdicts[r] for r in order[order.index(edited) + 1:]), verdicts
            assert all(verdicts[r].endswith("; stored") for r in order[order.index(edited):]), verdicts
            served = [r for r in spliced.records if r["kind"] == "region" and r["outcome"] == "hit"]
            assert [r["name"] for r in served] == upstream
        _same_as_stock(name, edit, spliced, reference)
    lines = explain(Store(tmp_path / "cache"), type(models.MODELS[name]()[0]).__name__, TARGET)
    assert f"  region {edited}: re-ran: no stored state; stored" in lines, lines
    assert any(line.startswith(f"region {edited}: missed; changed: ") and "region.nodes" in line for line in lines), lines


def test_the_dirty_tail_is_stored_so_every_region_can_be_served(tmp_path, monkeypatch):
    """After an edit, the regions of the dirty tail are stored too: lowering the edited model again with its flow and
    TOSA steps missing (their keys salted) serves every region, and the bytes are still stock's."""
    from lowercache.lowering import arm, flow

    cache = tmp_path / "cache"
    _lower("residual_cnn", None, cache, monkeypatch, "all,regions")
    edited = _lower("residual_cnn", "structure", cache, monkeypatch, "all,regions")
    (step,) = _regions(edited)
    assert all(v == "served" or v.endswith("; stored") for v in _verdicts(step).values()), step
    original = arm.tosa_parts
    monkeypatch.setattr(arm, "tosa_parts", lambda *args: {**original(*args), "salt": "again"})
    monkeypatch.setattr(flow, "FLOW_VERSION", flow.FLOW_VERSION + ":salted")
    again = _lower("residual_cnn", "structure", cache, monkeypatch, "all,regions")
    (step,) = _regions(again)
    assert step["outcome"] == "spliced" and set(_verdicts(step).values()) == {"served"}, step
    module, example = models.MODELS["residual_cnn"](edit="structure")
    assert again.pte == edited.pte == stock_pte(module, example, TARGET)
    assert all(equal_up_to_names(again.files[k], edited.files[k]) for k in again.files if k.endswith(".tosa"))


@pytest.mark.parametrize("target", ["ethos-u65-256", "ethos-u85-256"])
def test_served_regions_give_stock_bytes_on_the_other_families(target, tmp_path, monkeypatch):
    for edit in (None, "weights"):
        spliced = _lower("tiny_cnn", edit, tmp_path / "cache", monkeypatch, "all,regions", target)
        reference = _lower("tiny_cnn", edit, tmp_path / "reference", monkeypatch, "all", target)
        (step,) = _regions(spliced)
        assert step["outcome"] == ("recorded" if edit is None else "spliced"), step
        _same_as_stock("tiny_cnn", edit, spliced, reference, target)


def test_a_corrupt_stored_state_means_a_recompute_and_a_warning(tmp_path, monkeypatch, caplog):
    """Every stored region state of the base is overwritten with one that cannot be rebuilt: the edit re-runs the
    regions, warns, and still gives stock's bytes."""
    from lowercache.cache.store import Entry

    base = _lower("tiny_cnn", None, tmp_path / "cache", monkeypatch, "all,regions")
    keys = [r["key"] for r in base.records if r["kind"] == "region"]
    store = Store(tmp_path / "cache")
    for key in keys:
        entry = store.get("region", key)
        assert entry is not None
        bad = entry.blobs["program.json"].replace(b'"edge"', b'"python"', 1)
        store.put("region", key, Entry(meta=entry.meta, blobs={**entry.blobs, "program.json": bad}))
    store.close()
    spliced = _lower("tiny_cnn", "structure", tmp_path / "cache", monkeypatch, "all,regions")
    reference = _lower("tiny_cnn", "structure", tmp_path / "reference", monkeypatch, "all")
    (step,) = _regions(spliced)
    first = next(iter(_verdicts(step).values()))
    assert first.startswith("re-ran: stored state unreadable"), step
    assert step["outcome"] == "recorded", step
    assert any("stored region state unreadable" in r.getMessage() for r in caplog.records)
    _same_as_stock("tiny_cnn", "structure", spliced, reference)


def test_interleaved_regions_fall_back_and_say_why(tmp_path, monkeypatch):
    """The transformer block's layer norms interleave with the residual adds in graph order: not spliced."""
    artifacts = _lower("transformer_block", "structure", tmp_path / "cache", monkeypatch, "all,regions")
    (step,) = _regions(artifacts)
    assert step["outcome"] == "fallback" and "interleave" in step["name"], step
    module, example = models.transformer_block(edit="structure")
    assert artifacts.pte == stock_pte(module, example, TARGET)
    lines = explain(Store(tmp_path / "cache"), "TransformerBlock", TARGET)
    assert any(line.startswith("TOSA pipeline by region: fallback: full pipeline: regions interleave") for line in lines), lines


def test_tosa_targets_keep_the_full_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "all,regions")
    module, example = models.tiny_cnn()
    artifacts = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "cache")
    assert not _regions(artifacts)
    assert artifacts.manifest["speedups"]["regions"] == "off: not for arm-tosa"


def test_verify_accepts_a_tosa_equal_up_to_names_only_for_ethos_u_with_regions_on():
    from lowercache.speedups import registry
    from lowercache.verify import Mismatch, expected

    names = Mismatch("cache", "partition_0.tosa", 40, "tosa partition 0 (miss, key 0)", up_to_names=True)
    other = Mismatch("cache", "partition_0.tosa", 40, "tosa partition 0 (miss, key 0)")
    pte = Mismatch("cache", "model.pte", 40, "flow")
    try:
        registry.select("all,regions")
        assert expected([names, other, pte], TARGET) == ([other, pte], [names])
        assert expected([names], "tosa-int") == ([names], [])
        registry.select("all")
        assert expected([names], TARGET) == ([names], [])
    finally:
        registry.select("all")
