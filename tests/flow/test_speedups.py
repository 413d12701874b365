"""The speed-up registry: pins match the installed sources, every patch is listed, and with
any one speed-up off, or all of them, the bytes are stock's."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

import lowercache
from lowercache.bench import models
from lowercache.errors import LowercacheError
from lowercache.lowering import arm, switches
from lowercache.speedups import registry, retrace
from lowercache.targets import FAMILIES, family_of

from tests.helpers.oracle import reference
from tests.helpers import ROOT


AUDITED_ON = {"torch": "2.13.0", "executorch": "1.5.1"}
# Modules of lowercache/speedups/ that are parts of a registered speed-up or tools for them, not switches.
PARTS = {"oppolicy", "delegatecall", "decompreplay", "passregistry", "sourcepin", "patching", "registry"}


def _on_audited_toolchain() -> bool:
    return all(version(d).split("+")[0] == v for d, v in AUDITED_ON.items())


@pytest.fixture(autouse=True)
def _all_selected():
    yield
    registry.select("all")


@pytest.mark.quick
def test_pins_match_the_installed_sources():
    if not _on_audited_toolchain():
        pytest.skip(f"pins were taken on {AUDITED_ON}; here the check is that they switch off (test below)")
    assert {s.name: registry.audited(s.name) for s in registry.SPEEDUPS} == {s.name: True for s in registry.SPEEDUPS}


@pytest.mark.quick
def test_every_switchable_module_is_registered_and_ordered():
    """No patch outside the registry: every speed-ups module with an enable() is an entry, and arm turns each on."""
    folder = ROOT / "lowercache" / "speedups"
    switchable = set()
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if "enable" in names and path.stem not in PARTS:
            switchable.add(path.stem)
    # gcfreeze is a context the flow enters, gated by the registry; the flow's own speed-ups live in lowering/
    assert switchable == set(registry.NAMES) - {"gcfreeze"} - set(arm._FLOW_SPEEDUPS)
    assert set(switches.ORDER) - set(arm._FLOW_PATCHES) == set(registry.NAMES) - {"gcfreeze"}
    assert registry.EVERY == tuple(f.name for f in FAMILIES) and (ROOT / registry.XNNPACK_PROOF).is_file()
    for entry in registry.SPEEDUPS:
        assert (ROOT / entry.proof).is_file(), entry.proof
        assert entry.families and set(entry.families) <= set(registry.EVERY), entry
        assert "\n" not in entry.why and entry.why.endswith(".")


@pytest.mark.quick
@pytest.mark.parametrize(
    "text, chosen",
    [
        ("all", set(registry.NAMES) - registry.OPT_IN),
        ("", set(registry.NAMES) - registry.OPT_IN),
        ("all,regions", set(registry.NAMES) - {"rebind"}),
        ("all,regions,rebind", set(registry.NAMES)),
        ("none", set()),
        ("retrace,fastcopy", {"retrace", "fastcopy"}),
        ("all,-fastcopy,-gcfreeze", set(registry.DEFAULT) - {"fastcopy", "gcfreeze"}),
        (" none , lazycode ", {"lazycode"}),
    ],
)
def test_selection_grammar(text, chosen):
    assert registry.parse(text) == chosen


def test_an_unknown_speedup_is_a_one_line_error(tmp_path):
    with pytest.raises(LowercacheError, match="unknown speed-up 'fastcpy'"):
        registry.parse("all,-fastcpy")
    model = ROOT / "examples" / "tiny_cnn.py"
    env = {**os.environ, "LOWERCACHE_SPEEDUPS": "all,-fastcpy", "LOWERCACHE_DIR": str(tmp_path / "c")}
    result = subprocess.run(
        [sys.executable, "-m", "lowercache.cli", "lower", f"{model}:model", "-t", "tosa-fp", "-o", str(tmp_path / "out")],
        capture_output=True, text=True, env=env,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowercache: error:")]
    assert len(errors) == 1 and "fastcpy" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# A float model through TOSA-FP and a quantized one through Ethos-U55: between them every speed-up has work.
CASES = [("transformer_block", "tosa-fp"), ("tiny_cnn", "ethos-u55-128")]


@pytest.mark.parametrize("model, target", CASES)
def test_every_speedup_off_gives_stock_bytes(model, target, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", "none")
    module, example = models.MODELS[model]()
    artifacts = lowercache.lower(module, example, target=target, use_cache=False)
    assert artifacts.pte == reference(model, target)
    family = family_of(target).name
    states = artifacts.manifest["speedups"]
    assert {states[n] for n in registry.NAMES if registry.applies(n, family)} == {"off: disabled by setting"}
    assert {states[n] for n in registry.NAMES if not registry.applies(n, family)} <= {f"off: not for {family}"}
    assert artifacts.nodes["copied"] == 0 and artifacts.nodes["copied_fast"] == 0


def _proven_on(target: str) -> list[str]:
    """The default speed-ups proven on ``target``'s family (the others are off for it whatever the setting)."""
    return [name for name in sorted(registry.DEFAULT) if registry.applies(name, family_of(target).name)]


@pytest.mark.parametrize("model, target, name", [(m, t, n) for m, t in CASES for n in _proven_on(t)])
def test_each_speedup_off_gives_stock_bytes(name, model, target, monkeypatch):
    monkeypatch.setenv("LOWERCACHE_SPEEDUPS", f"all,-{name}")
    module, example = models.MODELS[model]()
    artifacts = lowercache.lower(module, example, target=target, use_cache=False)
    assert artifacts.pte == reference(model, target)
    assert artifacts.manifest["speedups"][name] == "off: disabled by setting"
    assert sum(state == "on" for state in artifacts.manifest["speedups"].values()) == len(_proven_on(target)) - 1


def test_a_speedup_whose_source_differs_switches_itself_off(monkeypatch):
    """As on another ExecuTorch release: retrace's pinned functions read differently, so it stays off; bytes are stock's."""
    real = registry.targets_digest
    retrace_patches = next(s.patches for s in registry.SPEEDUPS if s.name == "retrace")
    monkeypatch.setattr(registry, "targets_digest", lambda t: "0" * 64 if tuple(t) == retrace_patches else real(t))
    monkeypatch.setattr(registry, "_audit", {})
    assert registry.state("retrace") == "off: installed source differs"
    module, example = models.MODELS["transformer_block"]()
    artifacts = lowercache.lower(module, example, target="tosa-fp", use_cache=False)
    assert artifacts.pte == reference("transformer_block", "tosa-fp")
    assert artifacts.manifest["speedups"]["retrace"] == "off: installed source differs"
    assert artifacts.nodes["copied"] == 0  # no node value was reused: retrace never ran
    assert not retrace.enabled()


def test_speedups_command_reports_each_state(tmp_path):
    env = {**os.environ, "LOWERCACHE_SPEEDUPS": "all,-fastcopy", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "lowercache.cli", "speedups"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "executorch 1." in result.stdout and "torch 2." in result.stdout
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│ ") and len(line.split()) > 3}
    assert "off: disabled by setting" in lines["fastcopy"]
    assert "│ on " in lines["retrace"]
    cells = {name: [c.strip() for c in line.split("│")[3:6]] for name, line in lines.items()}  # TOSA, Ethos-U, XNNPACK
    assert cells["retrace"] == ["on", "on", "on"] and cells["fastcopy"] == ["off", "off", "off"]
    assert cells["callsite"] == ["on", "on", "-"] and cells["regions"] == ["-", "off", "-"]
    assert cells["rebind"] == ["off", "off", "-"] and cells["qpatterns"] == ["-", "-", "on"]
    per_family = {column: sum(c[i] == "on" for c in cells.values()) for i, column in enumerate(("TOSA", "Ethos-U", "XNNPACK"))}
    assert per_family["TOSA"] == sum("arm-tosa" in s.families for s in registry.SPEEDUPS if s.name in registry.DEFAULT) - 1
    assert f"({per_family['TOSA']} for TOSA, {per_family['Ethos-U']} for Ethos-U, {per_family['XNNPACK']} for XNNPACK)" in result.stdout


def test_the_warm_up_reads_the_sources_a_loaded_backends_speedups_pin(monkeypatch):
    """Arm's export script loads XNNPACK's backend, so each ``run`` child of a warm server wraps it: the server's
    warm-up reads and digests the sources its speed-ups pin, and the hooks read none of them again."""
    import inspect

    from lowercache.lowering import xnnpack
    from lowercache.server import warm
    from lowercache.speedups import sourcepin

    importlib.import_module(xnnpack.XNNPACK_MODULE)
    monkeypatch.setattr(sourcepin, "_digests", {})  # what a server that never lowered for XNNPACK holds
    reads = []
    monkeypatch.setattr(inspect, "getsource", lambda fn, read=inspect.getsource: reads.append(fn) or read(fn))
    warm._pin_sources()
    assert reads, "the warm-up read no source: the check below could not fail"
    reads.clear()
    with xnnpack.hooks():
        pass
    assert reads == []
