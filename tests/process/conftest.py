"""Process tests: the CLI, the server and ``run`` in real subprocesses. Servers here run a session snapshot of the
sources (``helpers/server.py``) and are stopped when their module or test ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import direct
from tests.helpers.server import Server, alive, remove_snapshot, snapshot


@pytest.fixture(scope="session", autouse=True)
def _snapshot_per_session(_toolchain_memos):
    """One snapshot of the sources for the worker's modules (a new one per module was compiled again by its first
    processes), its digests added to the toolchain's memos each test starts with (``tests/conftest.py``): the first
    process of each test that runs it read and parsed it again."""
    if _toolchain_memos:
        subprocess.run([sys.executable, "-c", "from lowercache.cache.toolchain import toolchain_parts; toolchain_parts()"],
                       env={**os.environ, "XDG_CACHE_HOME": str(_toolchain_memos[0].parents[1]), "PYTHONPATH": str(snapshot())},
                       check=True, timeout=600)
    yield
    remove_snapshot()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the module's tests."""
    server = Server(tmp_path_factory.mktemp("shared"))
    server.pid = server.start()
    yield server
    server.close()
    assert not alive(server.pid)


@pytest.fixture
def own(tmp_path):
    """Servers of the test's own, made on demand (``own(**env)``), stopped after it."""
    servers = []

    def make(**extra: str) -> Server:
        servers.append(Server(tmp_path / f"s{len(servers)}", **extra))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server for ``lowercache run`` tests, one per module."""
    server = Server(tmp_path_factory.mktemp("runserver"))
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def _worker_server():
    """The socket directory of this worker's warm server for direct-mode ``lower`` commands (``through_server``),
    stopped when the worker's session ends."""
    run = Path(tempfile.mkdtemp(prefix="lcw", dir="/tmp"))  # short: a socket path holds at most 107 bytes
    yield run
    subprocess.run([sys.executable, "-m", "lowercache.cli", "server", "stop"], capture_output=True, timeout=120,
                   env={**os.environ, "XDG_RUNTIME_DIR": str(run), "LOWERCACHE_SERVER": "1"})
    shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def through_server(_worker_server):
    """A module's direct-mode ``lower`` commands go through the worker's warm server (``helpers/direct.py``), as a
    user's do by default: a module opts in with ``pytestmark = pytest.mark.usefixtures("through_server")``."""
    with direct.through_server(_worker_server):
        yield


@pytest.fixture
def new_processes():
    """A test of a module that goes through the server whose commands must each be a new process: what it checks
    happens at a process's start or between processes."""
    with direct.without_server():
        yield
