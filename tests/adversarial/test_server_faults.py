"""The warm server under bad requests and faults (issue 40, section 6; issue 41, item 5).

The threat model in one place: a client (or any process of the same user)
may send any bytes; the server may be paused, or its socket path taken by
something that is not a socket; the disk may be full; the user may press
Ctrl-C. None of these may end the server, hang the client, fail a lowering
that would succeed without lowercache, or leave wrong or partial bytes.
The servers and helpers are tests/test_server.py's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..test_server import TARGET, TINY, WAIT, base_env, errors, lc, shared, tiny_stock, warnings_of  # noqa: F401  (shared: fixture)


def raw(server, line: bytes, timeout: float = 60) -> dict | None:
    """Send one raw request line to ``server``'s socket and return its reply (None when it closes without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(server.run / "lowercache" / "server.sock"))
        sock.sendall(line)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    return json.loads(data) if data else None


def request(server, **fields) -> bytes:
    """A ``run`` request as the client sends it, with the server's identity, then ``fields`` over it."""
    identity = raw(server, b'{"op":"hello"}\n')["identity"]
    message = {"op": "run", "argv": ["--version"], "cwd": str(server.project), "env": dict(server.env), "path": list(sys.path),
               "timeout": 60, "identity": identity}
    message.update(fields)
    return json.dumps(message).encode() + b"\n"


def still_serves(server, tmp_path: Path, name: str) -> None:
    """The same server answers, and lowers the stock bytes."""
    assert server.status()["pid"] == str(server.pid)
    result = server("lower", TINY, "-t", TARGET, "-o", tmp_path / name, "--no-direct")
    assert result.returncode == 0 and warnings_of(result) == [], result.stderr[-2000:]
    assert (tmp_path / name / "model.pte").read_bytes() == tiny_stock()


# 1. requests that ended the server


def test_requests_that_ended_the_server_get_an_error_reply(shared, tmp_path):
    """Each of these ended the old server: a TypeError, a RecursionError, an OverflowError."""
    identity = raw(shared, b'{"op":"hello"}\n')["identity"]
    exec_int_argv = {"op": "exec", "argv": 5, "cwd": "/", "env": {}, "executable": sys.executable, "identity": identity}
    replies = [
        raw(shared, json.dumps(exec_int_argv).encode() + b"\n"),
        raw(shared, b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        raw(shared, b'{"op":"run","argv":' + b"[" * 500 + b"]" * 500 + b"}\n"),
        raw(shared, request(shared, timeout=10**400)),
    ]
    assert replies == [
        {"error": "exec request: field 'argv' must be a list of at most 65536 strings"},
        {"error": "a request nested too deep"},
        {"error": "run request: field 'argv' must be a string without NUL"},
        {"error": "run request: field 'timeout' must be null or a number of seconds from 0 to 1000000000"},
    ]
    still_serves(shared, tmp_path, "after")


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"cwd": "relative"}, "field 'cwd' must be an absolute path"),
        ({"cwd": "/tmp\0x"}, "field 'cwd' must be a string without NUL"),
        ({"env": {"A=B": "1"}}, "field 'env' must be an object of strings, names without '=' or NUL"),
        ({"env": {"A": 1}}, "field 'env' must be an object of strings, names without '=' or NUL"),
        ({"path": "/x"}, "field 'path' must be a list of at most 65536 strings"),
        ({"tty": [1, 0]}, "field 'tty' must be two booleans"),
        ({"columns": -1}, "field 'columns' must be a whole number from 0 to 65536"),
        ({"columns": True}, "field 'columns' must be a whole number from 0 to 65536"),
        ({"encoding": ["utf-8", "no-such-codec"]}, "field 'encoding' must be two names Python knows"),
        ({"errors": ["strict", "nope"]}, "field 'errors' must be two names Python knows"),
        ({"timeout": -1}, "field 'timeout' must be null or a number of seconds from 0 to 1000000000"),
        ({"timeout": "60"}, "field 'timeout' must be null or a number of seconds from 0 to 1000000000"),
        ({"identity": []}, "field 'identity' must be an object"),
        ({"umask": 18}, "unknown field 'umask'"),
        ({"argv": None}, "field 'argv' must be a list of at most 65536 strings"),
    ],
)
def test_each_field_is_checked_before_use(shared, fields, why):
    assert raw(shared, request(shared, **fields)) == {"error": f"run request: {why}"}
    assert shared.status()["pid"] == str(shared.pid)


def test_other_malformed_requests(shared, tmp_path):
    for line, why in (
        (b'{"op":"frobnicate"}\n', "unknown request 'frobnicate'"),
        (b'{"op":5}\n', "unknown request '5'"),
        (b'{"op":"exec","argv":["python","s.py"],"cwd":"/","env":{},"executable":"/bin/python","umask":512}\n',
         "exec request: field 'umask' must be a whole number from 0 to 511"),
        (b'{"op":"run","argv":[]}\n', "run request: missing field(s) cwd, env, path"),
        (b'"just a string"\n', "a request that is not a JSON object"),
        (b"\xff\xfe\n", "a request that is not JSON"),
        (b'{"op":"status","x":1}\n', "status request: unknown field 'x'"),
    ):
        assert raw(shared, line) == {"error": why}
    still_serves(shared, tmp_path, "after")


def test_a_huge_server_timeout_setting_is_one_line(shared, tmp_path):
    """LOWERCACHE_SERVER_TIMEOUT of 10**400 reached the server as an OverflowError; now config refuses it."""
    for name in ("LOWERCACHE_SERVER_TIMEOUT", "LOWERCACHE_SERVER_IDLE_TIMEOUT"):
        result = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", **{name: "9" * 400})
        setting = name.removeprefix("LOWERCACHE_").lower()
        assert result.returncode == 2, result.stderr[-2000:]
        assert errors(result) == [f"lowercache: error: bad value '{'9' * 400}' for {setting}; use a whole number of seconds from 0 to 1000000000"]
        assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert shared.status()["pid"] == str(shared.pid)
