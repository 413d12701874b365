"""Direct mode end to end, in subprocesses of the real CLI: hits without torch, misses on every kind of changed input, never a wrong hit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowercache.cache.store import Entry, Store
from lowercache.direct import Request

from tests.helpers.direct import (MODEL, PORTABLE_MODEL, TARGET, cli_env, confirmed, explain, fresh, lower, make_project, served,
                                  stock, weights)
from tests.helpers.isolation import isolate
from tests.helpers.seeded import restored, set_aside


@pytest.fixture(scope="module")
def _confirmed_once(tmp_path_factory) -> tuple[Path, bytes]:
    """The plain project recorded and confirmed once for the tests that start from there (two lowerings each saved),
    then copied aside."""
    base = tmp_path_factory.mktemp("confirmed")
    with pytest.MonkeyPatch.context() as env:
        isolate(env, base)
        normal = confirmed(make_project(base / "proj"), base / "cache")
    set_aside(base, "proj", "cache")
    return base, normal


@pytest.fixture
def confirmed_project(_confirmed_once) -> tuple[Path, Path, bytes]:
    """The confirmed project and its cache, restored for this test at the paths they were recorded at; their bytes."""
    base, normal = _confirmed_once
    project, cache = restored(base, "proj", "cache")
    return project, cache, normal


def test_unchanged_inputs_are_served_without_torch_and_each_changed_input_misses(tmp_path):
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    env = {"LC_TEST_SCALE": "1.0"}
    normal = confirmed(project, cache, env)
    assert normal == stock(project, env)

    hit, pte, result = lower(project, cache, env=env)
    assert served(hit) and hit["direct"]["torch_imported"] is False, result.stderr
    assert pte == normal and "direct mode" in result.stderr
    assert "latest lookup: hit" in explain(project, cache)

    # Off by flag and by setting: the normal path runs (and still gives the same bytes).
    for extra, extra_env in ((("--no-direct",), {}), ((), {"LOWERCACHE_DIRECT": "0"})):
        bypassed, pte, _ = lower(project, cache, *extra, env={**env, **extra_env})
        assert not served(bypassed) and "direct" not in bypassed and pte == normal

    # Each input changed on its own: never served, new bytes equal stock's for the new inputs.
    changes = [
        ("helper.py", lambda: (project / "helper.py").write_text("OFFSET = 0.5\n"), env),
        ("weights.pt", lambda: torch.save(weights(2), project / "weights.pt"), env),
        ("LC_TEST_SCALE", lambda: None, {"LC_TEST_SCALE": "2.0"}),
        ("model.py", lambda: (project / "model.py").write_text(MODEL.replace("torch.relu(", "torch.sigmoid(")), {"LC_TEST_SCALE": "2.0"}),
    ]
    previous = normal
    for name, change, env in changes:
        change()
        manifest, pte, _ = lower(project, cache, env=env)
        assert not served(manifest), name
        assert pte != previous and pte == stock(project, env), name
        assert name in explain(project, cache), name
        previous = pte


def test_inputs_lowered_before_are_served_from_an_earlier_record(tmp_path):
    """An edit undone, then redone, is answered without the factory (as ccache's manifest keeps several results); an
    earlier record is held to every rule of the latest: it answers only while each input it names is as recorded."""
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    original = (project / "helper.py").read_text()
    first = confirmed(project, cache)
    (project / "helper.py").write_text("OFFSET = 0.5\n")
    second = confirmed(project, cache)
    assert second != first and second == stock(project)

    (project / "helper.py").write_text(original)  # undone: the same bytes, a new mtime
    manifest, pte, _ = lower(project, cache)
    assert served(manifest) and manifest["direct"]["torch_imported"] is False and pte == first

    latest = Request(model="model.py:model", target=TARGET, out_dir="out", cwd=str(project)).key()
    store = Store(cache)
    earlier = [key for kind, key in store.actions() if kind == "direct" and key != latest]
    assert earlier
    for key in earlier:  # a malformed earlier record answers nothing; the normal path runs
        store.put("direct", key, Entry(meta={"version": 2, "status": "confirmed", "flow": "not a dict"}))
    store.close()
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest) and pte == first
    (project / "helper.py").write_text("OFFSET = 0.5\n")  # redone: the record that run replaced answers
    manifest, pte, _ = lower(project, cache)
    assert served(manifest) and pte == second

    (project / "helper.py").write_text(original)  # undone, with the weights the earlier record names changed
    torch.save(weights(2), project / "weights.pt")
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest) and pte == stock(project) != first
    explained = explain(project, cache)  # what the latest record found changed, then the earlier ones
    assert "helper.py changed" in explained and "1 earlier record did not answer either (the newest: helper.py changed)" in explained


# A helper whose value depends on whether Python runs its asserts (``-O`` strips them).
ASSERTING_HELPER = "OFFSET = 0.0\ntry:\n    assert False\nexcept AssertionError:\n    OFFSET = 0.5\n"


def test_settings_changed_and_set_back_are_served_from_the_earlier_records(tmp_path):
    """What is not a file, changed then set back: a variable, then an interpreter flag. Each first setting's record
    answers again, a variable that only says how output is shown does not stop it, and a combination no record has
    seen lowers afresh."""
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    (project / "helper.py").write_text(ASSERTING_HELPER)
    one, two = {"LC_TEST_SCALE": "1.0"}, {"LC_TEST_SCALE": "2.0"}

    recorded = {((), "1.0"): confirmed(project, cache, one), ((), "2.0"): confirmed(project, cache, two)}
    recorded[("-O",), "1.0"] = lower(project, cache, env=one, interpreter=("-O",))[1]  # the latest: the two kept earlier
    assert recorded[(), "1.0"] == stock(project, one) and recorded[(), "2.0"] == stock(project, two)
    assert recorded[("-O",), "1.0"] == fresh(project, tmp_path, one, ("-O",)) and len(set(recorded.values())) == 3

    for env in (two, one, {**one, "COLUMNS": "80", "LINES": "24"}):
        manifest, pte, result = lower(project, cache, env=env)
        assert served(manifest) and pte == recorded[(), env["LC_TEST_SCALE"]], result.stderr[-2000:]

    manifest, pte, _ = lower(project, cache, env=two, interpreter=("-O",))
    assert not served(manifest) and pte == fresh(project, tmp_path, two, ("-O",)) and pte not in recorded.values()
    assert "earlier records did not answer either" in explain(project, cache)


def test_a_factory_that_reads_what_no_record_sees_is_never_served(tmp_path):
    """An unseeded model lowers differently from identical inputs: untrusted for good, never served."""
    unseeded = MODEL.replace("    torch.manual_seed(0)\n", "").replace("net.load_state_dict(weights)", "pass")
    project, cache = make_project(tmp_path / "proj", model=unseeded), tmp_path / "cache"
    outcomes = []
    for _ in range(3):
        manifest, pte, _ = lower(project, cache)
        assert not served(manifest)
        outcomes.append(manifest["direct"]["record"])
    assert outcomes == ["unconfirmed", "untrusted", "untrusted"]
    assert "identical inputs lowered differently" in explain(project, cache)


def test_a_factory_that_uses_the_network_is_never_served(tmp_path):
    network = MODEL.replace(
        "    scale = ", "    import socket\n    try:\n        socket.getaddrinfo('localhost', 9)\n    except OSError:\n        pass\n    scale = "
    )
    project, cache = make_project(tmp_path / "proj", model=network), tmp_path / "cache"
    for _ in range(3):
        manifest, _, _ = lower(project, cache)
        assert not served(manifest) and manifest["direct"]["record"] == "untrusted"
    assert "used the network" in explain(project, cache)


def test_a_corrupt_record_or_flow_entry_falls_back_to_a_normal_lowering(confirmed_project):
    project, cache, normal = confirmed_project
    store = Store(cache)
    flow_keys = [key for kind, key in store.actions() if kind == "flow"]
    for key in flow_keys:  # the record stays, the entry it names is gone
        store._discard(f"action/flow/{key}")
    store.close()
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest) and pte == normal
    assert "flow entry is missing or corrupt" in explain(project, cache)

    lower(project, cache)  # the re-run re-records (and confirms) with the flow entry back
    hit, _, _ = lower(project, cache)
    assert served(hit)
    for path in (cache / "entries").rglob("*.val"):  # every stored value damaged, record included
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
    store = Store(cache)
    for kind, key in list(store.actions()):  # and the small entries kept in the index itself
        raw = bytearray(store._entries.get(f"action/{kind}/{key}"))
        raw[-2] ^= 0x55
        store._entries.set(f"action/{kind}/{key}", bytes(raw))
    store.close()
    manifest, pte, result = lower(project, cache)
    assert not served(manifest) and pte == normal
    assert "lowercache: warning:" in result.stderr


def test_the_remote_tier_serves_a_record_to_an_empty_cache_in_another_directory(tmp_path, redis_url):
    env = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "direct-test-key"}
    first = make_project(tmp_path / "a" / "proj", model=PORTABLE_MODEL)
    normal = confirmed(first, tmp_path / "cache-a", env)
    for name in ("b", "c"):  # a runner elsewhere lowers once, and confirms the record in a second directory
        elsewhere = tmp_path / name / "checkout"
        shutil.copytree(first, elsewhere, ignore=shutil.ignore_patterns("out", "__pycache__"))
        manifest, pte, result = lower(elsewhere, tmp_path / f"cache-{name}", env=env)
    assert served(manifest) and manifest["direct"]["torch_imported"] is False, result.stderr
    assert manifest["steps"][0]["tier"] == "remote" and manifest["model"] == f"{elsewhere}/model.py:model"
    assert pte == normal

    # The same checkout with the key another team signs with: nothing from the remote is used.
    other = tmp_path / "d" / "checkout"
    shutil.copytree(first, other, ignore=shutil.ignore_patterns("out", "__pycache__"))
    manifest, pte, _ = lower(other, tmp_path / "cache-d", env={**env, "LOWERCACHE_HMAC_KEY": "another-key"})
    assert not served(manifest) and pte == normal


def test_a_package_that_would_shadow_an_imported_module_misses(confirmed_project):
    """A new ``helper/`` package beside ``helper.py`` wins the import: the record's module lookup sees it."""
    project, cache, normal = confirmed_project
    (project / "helper").mkdir()
    (project / "helper" / "__init__.py").write_text("OFFSET = 0.25\n")
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest)
    assert pte != normal and pte == stock(project)


def test_bytecode_older_than_its_source_is_seen(tmp_path, monkeypatch):
    """Python trusts a pyc by the source's size and whole-second mtime: a same-size save within that second runs old code."""
    import importlib

    from lowercache.record import places

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "bytecode_probe.py"
    source.write_text("X = 1\n")
    module = importlib.import_module("bytecode_probe")
    assert os.path.exists(module.__cached__) and places.bytecode_matches(module.__file__, module.__cached__)
    before = os.stat(source)
    source.write_text("X = 2\n")
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    del sys.modules["bytecode_probe"]
    module = importlib.import_module("bytecode_probe")
    assert module.X == 1  # the stale bytecode ran
    assert not places.bytecode_matches(module.__file__, module.__cached__)
    # a later save with bytecode writing off: Python compiles the source afresh and the old pyc stays on disk
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    source.write_text("X = 33\n")
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    del sys.modules["bytecode_probe"]
    module = importlib.import_module("bytecode_probe")
    assert module.X == 33 and places.bytecode_matches(module.__file__, module.__cached__)
    del sys.modules["bytecode_probe"]


@pytest.mark.quick
def test_a_calibration_path_is_keyed_as_the_lowering_records_it():
    from lowercache import direct

    typed = direct.parse_lower(["lower", "m.py:f", "-t", "ethos-u55-128", "-o", "out", "--calibration", "./data//c.pt"])
    recorded = direct.Request(model="m.py:f", target="ethos-u55-128", out_dir="out", calibration=str(Path("./data//c.pt")))
    assert typed.key() == recorded.key()


@pytest.mark.quick
def test_module_files_looked_up_ahead_are_the_modules_own(tmp_path):
    """The warm server looks up its modules' files once (``remember_modules``); a child's record must read the same
    paths, and a module made later (or a new object under a remembered name) is looked up as it is now."""
    import types

    from lowercache.record import recorder

    recorder.remember_modules()
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        assert recorder._module_file(module) == (os.path.abspath(origin) if isinstance(origin, str) else None)
    fresh = types.ModuleType("json")  # same name as a remembered module, another object
    fresh.__file__ = str(tmp_path / "json.py")
    assert recorder._module_file(fresh) == str(tmp_path / "json.py")
    relative = types.ModuleType("rel")
    relative.__file__ = "rel.py"
    assert recorder._module_file(relative) == os.path.abspath("rel.py")


PROBE = """
import sys
from lowercache import direct, lowerer
from lowercache.record.recorder import keep_initial_environ

keep_initial_environ()
request = direct.Request(model="model.py:model", target=sys.argv[1], out_dir="out")
lowerer._import_first(request, request.settings())
print("executorch.exir" in sys.modules)
"""


def _stack_first(project: Path, cache: Path) -> bool:
    """Whether a run of the project now would import the lowering stack before it records."""
    result = subprocess.run([sys.executable, "-c", PROBE, TARGET], capture_output=True, text=True, cwd=project,
                            env=cli_env(cache), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()[-1] == "True"


def test_a_re_run_with_unchanged_inputs_imports_only_the_export_before_it_records(tmp_path):
    """A confirming re-run (its record's inputs all unchanged) will hit the flow step: the lowering stack's imports, which
    its backstop would make seconds slower, wait for a miss. A changed input, or an untrusted record (an unseeded
    factory: a new key each run), imports them first."""
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    first, pte, _ = lower(project, cache)
    assert first["direct"]["record"] == "unconfirmed" and not _stack_first(project, cache)
    (project / "helper.py").write_text("OFFSET = 0.5\n")
    assert _stack_first(project, cache)
    (project / "helper.py").write_text("OFFSET = 0.0\n")
    again, same, _ = lower(project, cache)
    assert again["direct"]["record"] == "confirmed" and same == pte

    unseeded = MODEL.replace("    torch.manual_seed(0)\n", "").replace("net.load_state_dict(weights)", "pass")
    project, cache = make_project(tmp_path / "unseeded", model=unseeded), tmp_path / "cache-unseeded"
    assert [lower(project, cache)[0]["direct"]["record"] for _ in range(2)] == ["unconfirmed", "untrusted"]
    assert _stack_first(project, cache)


OPENS = """
import sys
from rich.console import Console
from lowercache import direct, lowerer
from lowercache.cache import store
from lowercache.record.recorder import keep_initial_environ

opened = []
init = store.Store.__init__
store.Store.__init__ = lambda self, *args, **kwargs: opened.append(1) or init(self, *args, **kwargs)
keep_initial_environ()
for _ in range(2):  # the run that records, then the one that confirms
    report = lowerer.lower(direct.Request(model="model.py:model", target=sys.argv[1], out_dir="out"), Console(stderr=True))
    print(len(opened), report.summary["flow"])
    opened.clear()
"""


def test_a_lowering_and_its_record_open_the_store_once(tmp_path):
    """The lowering, the guess whether it will hit, and the record all use one store (``cache.tiers.held``): each open
    is a probe write and two databases, and in a recording process the backstop's tracer stops for each of their calls."""
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    result = subprocess.run([sys.executable, "-c", OPENS, TARGET], capture_output=True, text=True, cwd=project,
                            env=cli_env(cache), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1", "miss", "1", "hit"]
