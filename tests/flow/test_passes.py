"""Per-pass records: every Arm pass is seen, with skip / noop / ran and seconds."""

from __future__ import annotations

import lowercache
from lowercache.bench import models


def test_manifest_lists_every_arm_pass(cache_dir):
    from executorch.backends.arm._passes.arm_pass import ArmPass

    original = ArmPass.__call__
    module, example = models.tiny_cnn()
    artifacts = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    passes = artifacts.manifest["passes"]
    outcomes = {p["outcome"] for p in passes}
    assert outcomes == {"skip", "noop", "ran"}
    by_name = {p["pass"]: p["outcome"] for p in passes}
    assert by_name["FoldAndAnnotateQParamsPass"] == "ran"
    assert len(passes) > 150  # both pipelines: transform-for-annotation and TOSA backend
    assert sum(p["seconds"] for p in passes) < artifacts.stages["to_edge"] + artifacts.stages["quantize"]
    assert ArmPass.__call__ is original  # unpatched after the run
    nodes = artifacts.manifest["nodes"]
    assert nodes["copied"] > 0 and nodes["retraced"] > 0  # unchanged nodes reuse their fake values
    assert nodes["copied_fast"] > 0  # and the nodes a pass leaves alone are built without interpreting them
    # Per pass: skipped passes touch no node; the per-pass counts add up to the flow's.
    assert all(not p["nodes"] for p in passes if p["outcome"] == "skip")
    for key in ("retraced", "copied", "copied_fast"):
        assert 0 < sum(p["nodes"].get(key, 0) for p in passes) <= nodes[key]
    warm = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=cache_dir)
    assert warm.manifest["passes"] == []  # a flow hit runs no pass
