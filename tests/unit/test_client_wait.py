"""How long a client waits on a silent server: the silent limit, or longer while the server says it is warming up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from lowercache import client


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """A connected pair of Unix sockets (the peer is this process, as the server's pid the marker names) and the
    socket directory the client looks in."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    client.socket_dir().mkdir(parents=True, exist_ok=True)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield mine, theirs, client.socket_dir() / client.WARMING
    mine.close()
    theirs.close()


def test_a_silent_server_is_not_responding_after_the_limit(pair):
    mine, _, _ = pair
    with pytest.raises(client.ServerNotResponding, match="nothing from it for 1 s"):
        next(client.frames(mine, limit=1.0))


def test_a_client_waits_past_the_limit_while_the_server_says_it_is_warming(pair):
    mine, theirs, marker = pair
    marker.write_text(str(os.getpid()))
    answer = threading.Timer(3.5, lambda: theirs.sendall(b'{"pid": 1}\n'))
    answer.start()
    try:
        assert next(client.frames(mine, limit=1.0)) == {"pid": 1}
    finally:
        answer.cancel()


def test_a_marker_of_another_process_does_not_extend_the_wait(pair):
    mine, _, marker = pair
    marker.write_text(str(os.getpid() + 1))
    with pytest.raises(client.ServerNotResponding):
        next(client.frames(mine, limit=1.0))


def test_an_exited_process_no_one_has_reaped_is_gone():
    """``server stop`` waits for the server to exit; a zombie has, whenever its parent (the init process, for a
    server) reaps it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while not client._gone(child.pid):  # running, then a zombie: this process does not reap it yet
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{child.pid}")  # not reaped: os.kill(pid, 0) alone still finds it
        assert client._wait_gone(child.pid, timeout=1.0)
    finally:
        child.wait()
    assert not client._gone(os.getpid())
