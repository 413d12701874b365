"""Process tests: the CLI, the server and ``run`` in real subprocesses. Servers here run a session snapshot of the
sources (``helpers/server.py``) and are stopped when their module or test ends."""

from __future__ import annotations

import pytest

from tests.helpers.server import Server, alive, remove_snapshot


@pytest.fixture(scope="module", autouse=True)
def _snapshot_per_module():
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
