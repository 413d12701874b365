"""The benchmark runs end to end and every output it reports is byte-identical to stock.

Speed is not asserted: the test machines are too noisy for that; identity is.
"""

from __future__ import annotations

import json

from lowercache.bench import harness as bench

TARGETS = ("tosa-fp", "ethos-u55-128")
SCENARIOS = ("cold", "warm", "edit-structure")


def flow_outcomes(row):
    return [r["outcome"] for rep in row["lowercache_records"] for r in rep if r["kind"] == "flow"]


def test_quick_benchmark_on_tiny_cnn(tmp_path):
    out = tmp_path / "out"
    code = bench.main(["--quick", "--models", "tiny_cnn", "--targets", ",".join(TARGETS), "--out", str(out)])
    assert (out / "report.md").exists()
    results = json.loads((out / "results.json").read_text())

    assert results["all_equal"] is True
    assert code == 0
    rows = {(r["scenario"], r["target"]): r for r in results["rows"]}
    assert set(rows) == {(s, t) for s in SCENARIOS for t in TARGETS}
    for row in rows.values():
        assert row["status"] == "ok" and row["model"] == "tiny_cnn"
        assert row["bytes_equal"] == [True]
    for target in TARGETS:
        assert flow_outcomes(rows[("cold", target)]) == ["miss"]
        assert flow_outcomes(rows[("warm", target)]) == ["hit"]
        assert flow_outcomes(rows[("edit-structure", target)]) == ["miss"]
    assert "## edit-structure" in (out / "report.md").read_text()
