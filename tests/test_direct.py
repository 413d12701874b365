"""Direct mode end to end, in subprocesses of the real CLI: hits without torch, misses on every kind of changed input, never a wrong hit."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import torch

from lowercache.cache.store import Store

from .conftest import stock_pte

TARGET = "tosa-fp"
# The environment before this process lowers anything: torch sets variables of its own (TORCHINDUCTOR_CACHE_DIR)
# when it exports, and a changed environment rightly misses.
BASE_ENV = dict(os.environ)

MODEL = '''
import os, sys
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import helper


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x) + helper.OFFSET).flatten(1))


def model():
    net = Net()
    weights = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.pt"), weights_only=True)
    net.load_state_dict(weights)
    scale = float(os.environ.get("LC_TEST_SCALE", "1.0"))
    with torch.no_grad():
        net.fc.weight.mul_(scale)
    torch.manual_seed(0)
    return net.eval(), (torch.randn(1, 3, 8, 8),)
'''

# The same model with nothing that tells it where it is (no ``__file__``): a record of it may answer in a copy.
PORTABLE_MODEL = MODEL.replace("os.path.dirname(os.path.abspath(__file__))", '"."').replace('os.path.join(".", "weights.pt")', '"weights.pt"')


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = torch.nn.Module()
    net.conv = torch.nn.Conv2d(3, 4, 3)
    net.fc = torch.nn.Linear(4 * 6 * 6, 5)
    return net.state_dict()


def make_project(root: Path, offset: str = "0.0", seed: int = 1, model: str = MODEL) -> Path:
    """A small project (a git work tree): model file, a module it imports, a checkpoint it loads."""
    (root / ".git").mkdir(parents=True)
    (root / "model.py").write_text(textwrap.dedent(model))
    (root / "helper.py").write_text(f"OFFSET = {offset}\n")
    torch.save(weights(seed), root / "weights.pt")
    return root


def cli_env(cache_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test's CLI process gets: the test's settings, its cache, one thread, then ``env``."""
    base = {k: v for k, v in BASE_ENV.items() if not k.startswith(("LOWERCACHE_", "XDG_"))}
    return {**base, **_isolated(), "LOWERCACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", **(env or {})}


def lower(project: Path, cache_dir: Path, *extra: str, env: dict[str, str] | None = None, out: str = "out"):
    result = subprocess.run(
        [sys.executable, "-m", "lowercache.cli", "lower", "model.py:model", "-t", TARGET, "-o", out, *extra],
        capture_output=True, text=True, cwd=project, env=cli_env(cache_dir, env), timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((project / out / "manifest.json").read_text())
    return manifest, (project / out / "model.pte").read_bytes(), result


def _isolated() -> dict[str, str]:
    """The test's own settings (conftest's isolation: config file, server off)."""
    return {k: v for k, v in os.environ.items() if k.startswith(("LOWERCACHE_", "XDG_"))}


def served(manifest: dict) -> bool:
    return manifest.get("direct", {}).get("outcome") == "hit"


def explain(project: Path, cache_dir: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "lowercache.cli", "explain", "model.py:model", "-t", TARGET],
        capture_output=True, text=True, cwd=project, env={**os.environ, "LOWERCACHE_DIR": str(cache_dir)}, timeout=300,
    )
    return result.stdout


def stock(project: Path, env: dict[str, str] | None = None) -> bytes:
    """Stock ExecuTorch's bytes for the project's model as it is now, imported afresh."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    sys.modules.pop("helper", None)
    try:
        spec = importlib.util.spec_from_file_location(f"direct_model_{uuid.uuid4().hex}", project / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        net, example = module.model()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        sys.modules.pop("helper", None)
        sys.path[:] = [p for p in sys.path if p != str(project)]
    return stock_pte(net, example, TARGET)


def confirmed(project: Path, cache_dir: Path, env: dict[str, str] | None = None) -> bytes:
    """Record, then confirm (the first re-run with the same inputs is never served); returns the bytes."""
    first, pte, _ = lower(project, cache_dir, env=env)
    assert first["direct"]["record"] == "unconfirmed", first.get("direct")
    second, again, _ = lower(project, cache_dir, env=env)
    assert not served(second) and second["direct"]["record"] == "confirmed", second.get("direct")
    assert again == pte
    return pte


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


def test_a_corrupt_record_or_flow_entry_falls_back_to_a_normal_lowering(tmp_path):
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    normal = confirmed(project, cache)
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
    elsewhere = tmp_path / "b" / "checkout"
    shutil.copytree(first, elsewhere, ignore=shutil.ignore_patterns("out", "__pycache__"))
    manifest, pte, result = lower(elsewhere, tmp_path / "cache-b", env=env)
    assert served(manifest) and manifest["direct"]["torch_imported"] is False, result.stderr
    assert manifest["steps"][0]["tier"] == "remote" and manifest["model"] == f"{elsewhere}/model.py:model"
    assert pte == normal

    # The same checkout with the key another team signs with: nothing from the remote is used.
    other = tmp_path / "c" / "checkout"
    shutil.copytree(first, other, ignore=shutil.ignore_patterns("out", "__pycache__"))
    manifest, pte, _ = lower(other, tmp_path / "cache-c", env={**env, "LOWERCACHE_HMAC_KEY": "another-key"})
    assert not served(manifest) and pte == normal


def test_a_package_that_would_shadow_an_imported_module_misses(tmp_path):
    """A new ``helper/`` package beside ``helper.py`` wins the import: the record's module lookup sees it."""
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    normal = confirmed(project, cache)
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


def test_a_calibration_path_is_keyed_as_the_lowering_records_it():
    from lowercache import direct

    typed = direct.parse_lower(["lower", "m.py:f", "-t", "ethos-u55-128", "-o", "out", "--calibration", "./data//c.pt"])
    recorded = direct.Request(model="m.py:f", target="ethos-u55-128", out_dir="out", calibration=str(Path("./data//c.pt")))
    assert typed.key() == recorded.key()


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
