"""The benchmark runs end to end and every output it reports is byte-identical to stock.

Speed is not asserted: the test machines are too noisy for that; identity is.
"""

from __future__ import annotations

import json
import os
import sys

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


def test_process_scenario_on_tiny_cnn_cold(tmp_path):
    """Whole commands in new processes (stock script, no server, warm server with and without regions, direct mode from
    a pipe and at a terminal), bytes checked."""
    out = tmp_path / "out"
    code = bench.main([
        "--models", "tiny_cnn", "--targets", "ethos-u55-128", "--scenarios", "process",
        "--process-phases", "cold", "--repeat", "1", "--out", str(out),
    ])
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and results["all_equal"] is True
    (row,) = results["rows"]
    assert row["scenario"] == "process" and row["phases"] == ["cold"] and row["equal"] is True
    assert set(row["bytes_equal"]["cold"]) == {"--no-server", "warm server", "warm server, regions", "direct mode", "at a terminal"}
    assert all(v == [True] for v in row["bytes_equal"]["cold"].values())
    served = dict(row["served"]["cold"])
    assert served.pop("warm server, regions") == "flow miss; regions recorded"  # region replay engaged: states stored
    assert set(served.values()) == {"flow miss"}
    assert row["median"]["cold"]["stock script"] > 0 and len(row["server_start_seconds"]) == 1
    assert "### tiny_cnn ethos-u55-128" in (out / "report.md").read_text()


def test_a_timed_command_passes_lowercaches_warnings_on(tmp_path, capsys):
    """A damaged or unwritable cache recomputes with one warning: the figure beside it must say so."""
    from lowercache.bench.process import timed

    say = "import sys; print('lowercache: warning: cache database x is damaged', file=sys.stderr); print('other', file=sys.stderr)"
    timed([sys.executable, "-c", say], dict(os.environ), tmp_path)
    timed([sys.executable, "-c", "print('fine')"], dict(os.environ), tmp_path)
    noted = capsys.readouterr().err.splitlines()
    assert len(noted) == 1 and noted[0].startswith("note: ") and noted[0].endswith("lowercache: warning: cache database x is damaged")


def test_the_regions_column_is_only_for_ethos_u_targets():
    from lowercache.bench.process import modes_for

    assert "warm server, regions" in [m.name for m in modes_for("ethos-u85-256")]
    assert "warm server, regions" not in [m.name for m in modes_for("tosa-int")]
    assert [m.name for m in modes_for("tosa-int")] == [m.name for m in modes_for("ethos-u55-128") if not m.family_speedup]
