"""Direct mode on a small project: a model file that loads its weights from beside it, lowered by the CLI."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import torch

from . import references
from .oracle import stock_pte

TARGET = "tosa-fp"
# The environment before this process lowers anything: torch sets variables of its own (TORCHINDUCTOR_CACHE_DIR)
# when it exports, and a changed environment rightly misses.
BASE_ENV = dict(os.environ)
# One default cache directory for the direct-mode tests of this process, not each test's own: the whole environment is
# an input of a record (lowercache/environment.py), and a record a module's fixture made must still answer its tests.
_XDG_CACHE = tempfile.mkdtemp(prefix="lowercache-xdg-")

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
    """The environment a test's CLI process gets: the test's settings, its cache (the thread count the whole run has,
    ``tests/conftest.py``), then ``env``."""
    base = {k: v for k, v in BASE_ENV.items() if not k.startswith(("LOWERCACHE_", "XDG_"))}
    return {**base, **_isolated(), "XDG_CACHE_HOME": _XDG_CACHE, "LOWERCACHE_DIR": str(cache_dir), **(env or {})}


# The socket directory of this worker's warm server while a module sends ``lower`` through it (``through_server``).
_server_run: Path | None = None


def server_env(own: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that send a ``lower`` to this worker's warm server, which confirms nothing in the background (a
    test's sequence of runs records, confirms and hits as without a server); empty when no server is on, or when the
    command's own variables ``own`` are not all lowercache's settings (a request under other variables would replace
    the server)."""
    if _server_run is None or not all(name.startswith("LOWERCACHE_") for name in own or {}):
        return {}
    return {"LOWERCACHE_SERVER": "1", "XDG_RUNTIME_DIR": str(_server_run), "LOWERCACHE_SERVER_CONFIRM": "0",
            "LOWERCACHE_SERVER_IDLE_TIMEOUT": "3600"}


@contextlib.contextmanager
def through_server(run: Path) -> Iterator[None]:
    """``lower`` goes through a warm server with its socket in ``run`` (started by the first command, as a user's is)
    unless a test gives it variables of its own: a request under other variables would replace the server. A miss then
    costs a fork, not a new interpreter's imports of torch and ExecuTorch (seconds each)."""
    global _server_run
    _server_run = run
    try:
        yield
    finally:
        _server_run = None


@contextlib.contextmanager
def without_server() -> Iterator[None]:
    """A test's commands start new processes though its module goes through the server (``new_processes``)."""
    global _server_run
    saved, _server_run = _server_run, None
    try:
        yield
    finally:
        _server_run = saved


def lower(project: Path, cache_dir: Path, *extra: str, env: dict[str, str] | None = None, out: str = "out",
          interpreter: tuple[str, ...] = ()):
    """``lowercache lower`` of the project in a new process (``interpreter``: Python's own flags, such as ``-O``); its
    manifest, bytes and the finished process."""
    own = env or {}
    result = subprocess.run(
        [sys.executable, *interpreter, "-m", "lowercache.cli", "lower", "model.py:model", "-t", TARGET, "-o", out, *extra],
        capture_output=True, text=True, cwd=project, env=cli_env(cache_dir, {**server_env(own), **own}), timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((project / out / "manifest.json").read_text())
    return manifest, (project / out / "model.pte").read_bytes(), result


def fresh(project: Path, base: Path, env: dict[str, str] | None = None, interpreter: tuple[str, ...] = ()) -> bytes:
    """The bytes of an uncached lowering of the project as it is now, in a new process (``--no-cache --no-server``;
    ``interpreter``: Python's own flags),
    run once per test run for the same project, environment and lowercache (``helpers/references.py``). ``base``: the
    test's own directory, all of it in the key: a model may read beside the project (``../runs/latest``), where a key
    of the project alone would serve step 1's reference after the link moved. The outputs of earlier lowerings (``out``,
    ``fresh``) are no input of the model."""
    out = project / "fresh"
    result = references.run(
        [sys.executable, *interpreter, "-m", "lowercache.cli", "lower", "model.py:model", "-t", TARGET, "-o", "fresh", "--no-cache",
         "--no-server"],
        cwd=project, env=cli_env(base / "unused-cache", env), outputs=[out / "model.pte", out / "manifest.json"],
        places={base: "<tmp>", Path(_XDG_CACHE): "<xdg>"}, trees=(base,), ignore=(str(project / "out"), str(out)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return (out / "model.pte").read_bytes()


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


def until_served(project: Path, cache: Path, env: dict[str, str] | None = None, runs: int = 4) -> bytes:
    """Lower until direct mode serves the record (recorded, confirmed, then used); the bytes served."""
    for _ in range(runs):
        manifest, pte, _ = lower(project, cache, env=env)
        if served(manifest):
            return pte
    raise AssertionError(f"never served: {explain(project, cache)}")


def tiny_project(root: Path, model: str, git: bool = True) -> Path:
    """A project directory holding ``model.py`` (``model`` dedented), inside a git checkout unless ``git`` is False."""
    root.mkdir(parents=True)
    if git:
        (root / ".git").mkdir()
    (root / "model.py").write_text(textwrap.dedent(model))
    return root


def confirmed(project: Path, cache_dir: Path, env: dict[str, str] | None = None, interpreter: tuple[str, ...] = ()) -> bytes:
    """Record, then confirm (the first re-run with the same inputs is never served); returns the bytes."""
    first, pte, _ = lower(project, cache_dir, env=env, interpreter=interpreter)
    assert first["direct"]["record"] == "unconfirmed", first.get("direct")
    second, again, _ = lower(project, cache_dir, env=env, interpreter=interpreter)
    assert not served(second) and second["direct"]["record"] == "confirmed", second.get("direct")
    assert again == pte
    return pte
