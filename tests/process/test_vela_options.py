"""Vela's system config and memory mode (``--system-config``, ``--memory-mode``): output as stock's, each setting its own entry."""

from __future__ import annotations

import json
import textwrap

import pytest

from lowercache import direct
from lowercache.zoo import buildfile
from lowercache.errors import LowercacheError
from lowercache.targets import resolve
from lowercache.targets.arm_ethosu import vela_sections

from tests.helpers.cli import TINY, cli, error_lines, stock_tiny_with

pytestmark = pytest.mark.usefixtures("through_server")


MODES = ("Shared_Sram", "Sram_Only")


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "manifest.json"}


def _outcomes(out, kind):
    manifest = json.loads((out / "manifest.json").read_text())
    return [s["outcome"] for s in manifest["steps"] if s["kind"] == kind]


def test_memory_modes_are_served_each_its_own_bytes(tmp_path, cache_dir):
    """Fresh runs under two memory modes differ in Vela's bytes; the cache (flow, Vela step, direct mode) serves each its own."""
    fresh = {}
    for mode in MODES:
        run = cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / f"fresh-{mode}", "--memory-mode", mode,
                  "--no-cache", "--no-server", cache_dir=cache_dir)
        assert run.returncode == 0, run.stderr
        fresh[mode] = _files(tmp_path / f"fresh-{mode}")
        assert fresh[mode]["model.pte"] == stock_tiny_with("ethos-u55-128", memory_mode=mode)
    assert fresh[MODES[0]]["partition_0.vela.bin"] != fresh[MODES[1]]["partition_0.vela.bin"]
    assert fresh[MODES[0]]["partition_0.tosa"] == fresh[MODES[1]]["partition_0.tosa"]

    # Cold under one mode, then the other: a flow and Vela miss, the TOSA step (which never sees Vela's flags) a hit.
    for i, mode in enumerate(MODES):
        out = tmp_path / mode
        run = cli("lower", TINY, "-t", "ethos-u55-128", "-o", out, "--memory-mode", mode, cache_dir=cache_dir)
        assert run.returncode == 0, run.stderr
        assert _files(out) == fresh[mode]
        assert _outcomes(out, "flow") == ["miss"] and _outcomes(out, "vela") == ["miss"]
        assert _outcomes(out, "tosa") == (["hit"] if i else ["miss"])
    # Warm, alternating: flow hits (confirming each record), then direct-mode hits; each mode gets its own bytes.
    for round_ in range(2):
        for mode in MODES:
            out = tmp_path / f"{mode}-{round_}"
            run = cli("lower", TINY, "-t", "ethos-u55-128", "-o", out, "--memory-mode", mode, cache_dir=cache_dir)
            assert run.returncode == 0, run.stderr
            assert _files(out) == fresh[mode], (round_, mode)
            assert _outcomes(out, "flow") == ["hit"]
            assert ("direct mode: served from the record" in run.stderr) == (round_ == 1), (round_, mode, run.stderr)


def test_the_default_is_executorchs_and_an_explicit_default_matches_it(tmp_path, cache_dir):
    run = cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / "given", "--system-config", "Ethos_U55_High_End_Embedded",
              "--memory-mode", "Shared_Sram", cache_dir=cache_dir)
    assert run.returncode == 0, run.stderr
    assert _files(tmp_path / "given")["model.pte"] == stock_tiny_with("ethos-u55-128")


@pytest.mark.parametrize(
    "args, words",
    [
        (["-t", "ethos-u55-128", "--memory-mode", "Lots_Of_Sram"], ["'Lots_Of_Sram'", "Shared_Sram", "Sram_Only"]),
        (["-t", "ethos-u55-128", "--system-config", "U55_Fast"], ["'U55_Fast'", "Ethos_U55_High_End_Embedded"]),
        (["-t", "tosa-int", "--memory-mode", "Sram_Only"], ["--memory-mode", "Ethos-U", "tosa-int"]),
    ],
    ids=["memory-mode", "system-config", "tosa-target"],
)
def test_a_bad_value_is_one_line_naming_it_and_the_valid_ones(args, words, tmp_path, cache_dir):
    out = tmp_path / "out"
    run = cli("lower", TINY, "-o", out, *args, cache_dir=cache_dir)
    assert run.returncode == 2
    lines = error_lines(run)
    assert len(lines) == 1 and all(w in lines[0] for w in words), run.stderr
    assert not out.exists()


def test_direct_mode_records_one_setting_apart_from_another():
    base = ["lower", "m.py:model", "-t", "ethos-u55-128", "-o", "out"]
    keys = {
        direct.parse_lower(base).key(),
        direct.parse_lower([*base, "--memory-mode", "Sram_Only"]).key(),
        direct.parse_lower([*base, "--memory-mode=Shared_Sram"]).key(),
        direct.parse_lower([*base, "--system-config", "Ethos_U55_Deep_Embedded"]).key(),
    }
    assert len(keys) == 4
    assert direct.parse_lower([*base, "--memory-mode", "a", "--memory-mode", "b"]) is None  # given twice: the full CLI decides


def test_vela_sections_come_from_velas_config_file():
    assert {"Shared_Sram", "Sram_Only", "Dedicated_Sram"} <= set(vela_sections("Memory_Mode"))
    assert resolve("ethos-u85-256", system_config="Ethos_U85_SYS_DRAM_High").system_config == "Ethos_U85_SYS_DRAM_High"
    with pytest.raises(LowercacheError, match="Dedicated_Sram_384KB"):
        resolve("ethos-u65-256", memory_mode="Dedicated_SRAM")


def test_build_file_takes_them_per_model_and_checks_them(tmp_path):
    (tmp_path / "m.py").write_text("")
    (tmp_path / "lowercache.toml").write_text(textwrap.dedent("""
        targets = ["ethos-u55-128"]
        [models.kws]
        model = "m.py:model"
        memory-mode = "Sram_Only"
        system-config = "Ethos_U55_Deep_Embedded"
    """))
    (pair,) = buildfile.load(tmp_path / "lowercache.toml").pairs
    args = pair.lower_args([])
    assert args[args.index("--memory-mode") + 1] == "Sram_Only"
    assert args[args.index("--system-config") + 1] == "Ethos_U55_Deep_Embedded"
    (tmp_path / "lowercache.toml").write_text(textwrap.dedent("""
        targets = ["tosa-int"]
        [models.kws]
        model = "m.py:model"
        memory-mode = "Sram_Only"
    """))
    with pytest.raises(LowercacheError, match="models.kws: --memory-mode applies to Ethos-U targets only"):
        buildfile.load(tmp_path / "lowercache.toml")


def test_verify_checks_the_record_of_its_own_setting(tmp_path, cache_dir):
    """A confirmed record of the default setting must not answer verify --memory-mode Sram_Only (it would mismatch)."""
    for _ in range(2):
        assert cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / "out", cache_dir=cache_dir).returncode == 0
    run = cli("verify", TINY, "-t", "ethos-u55-128", "--memory-mode", "Sram_Only", "--no-server", cache_dir=cache_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "direct record: none answers (no record)" in run.stdout, run.stdout


def test_system_configs_are_served_each_their_own_files(tmp_path, cache_dir):
    fresh = {}
    for config in ("Ethos_U55_High_End_Embedded", "Ethos_U55_Deep_Embedded"):
        out = tmp_path / f"fresh-{config}"
        run = cli("lower", TINY, "-t", "ethos-u55-128", "-o", out, "--system-config", config, "--no-cache", "--no-server",
                  cache_dir=cache_dir)
        assert run.returncode == 0, run.stderr
        fresh[config] = _files(out)
        served = tmp_path / config
        assert cli("lower", TINY, "-t", "ethos-u55-128", "-o", served, "--system-config", config, cache_dir=cache_dir).returncode == 0
        assert _files(served) == fresh[config]
    assert fresh["Ethos_U55_High_End_Embedded"] != fresh["Ethos_U55_Deep_Embedded"]
    assert "partition_0.vela_out_summary_Ethos_U55_Deep_Embedded.csv" in fresh["Ethos_U55_Deep_Embedded"]
    assert _outcomes(tmp_path / "Ethos_U55_Deep_Embedded", "flow") == ["miss"]
