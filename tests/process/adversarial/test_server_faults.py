"""The warm server under bad requests and faults (issue 40, section 6; issue 41, item 5).

The threat model in one place: a client (or any process of the same user)
may send any bytes; the server may be paused, or its socket path taken by
something that is not a socket; the disk may be full; the user may press
Ctrl-C. None of these may end the server, hang the client, fail a lowering
that would succeed without lowercache, or leave wrong or partial bytes.
The servers and helpers are tests/process/test_server.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from lowercache import process_state
from tests.helpers import ROOT
from tests.helpers.disks import tmpfs
from tests.helpers.runserver import explain
from tests.helpers.cli import TINY, error_lines, stock_tiny, warnings_of
from tests.helpers.server import TARGET, WAIT, alive, base_env, lc, wait_until, fresh as fresh_reference


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
               "timeout": 60, "identity": identity, "process": process_state.capture()}
    message.update(fields)
    return json.dumps(message).encode() + b"\n"


def still_serves(server, tmp_path: Path, name: str) -> None:
    """The same server answers, and lowers the stock bytes."""
    assert server.status()["pid"] == str(server.pid)
    result = server("lower", TINY, "-t", TARGET, "-o", tmp_path / name, "--no-direct")
    assert result.returncode == 0 and warnings_of(result) == [], result.stderr[-2000:]
    assert (tmp_path / name / "model.pte").read_bytes() == stock_tiny(TARGET)


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
        ({"encoding": ["utf-8", "no-such-codec"]}, "field 'encoding' must be two names Python knows (or null)"),
        ({"errors": ["strict", "nope"]}, "field 'errors' must be two names Python knows (or null)"),
        ({"files": [[[1]], []]}, "field 'files' must be two lists of at most 64 files (a device and an inode each)"),
        ({"files": [[[1, -2]], []]}, "field 'files' must be two lists of at most 64 files (a device and an inode each)"),
        ({"files": [[[1, 2]] * 65, []]}, "field 'files' must be two lists of at most 64 files (a device and an inode each)"),
        ({"timeout": -1}, "field 'timeout' must be null or a number of seconds from 0 to 1000000000"),
        ({"timeout": "60"}, "field 'timeout' must be null or a number of seconds from 0 to 1000000000"),
        ({"identity": []}, "field 'identity' must be an object"),
        ({"umask": 18}, "unknown field 'umask'"),
        ({"process": {"umask": 18}}, "field 'process' must be an object with the client's process state"),
        ({"process": {**process_state.capture(), "nice": 40}},
         "field 'process' must be an object with the client's process state (bad 'nice')"),
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
        (b'{"op":"exec","argv":["python","s.py"],"cwd":"/","env":{},"executable":"/bin/python","umask":18}\n',
         "exec request: unknown field 'umask'"),
        (b'{"op":"run","argv":[]}\n', "run request: missing field(s) cwd, env, path, process"),
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
        assert error_lines(result) == [f"lowercache: error: bad value '{'9' * 400}' for {setting}; use a whole number of seconds from 0 to 1000000000"]
        assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert shared.status()["pid"] == str(shared.pid)


# 2. a paused server


def lower_model(server, out: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lowercache.cli", "lower", "model.py:model", "-t", "tosa-int", "-o", str(out), "--no-direct"],
        env={**server.env, **extra}, cwd=server.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def fresh(server, out: Path, cache: Path, **extra: str) -> bytes:
    """model.py lowered by a new process, no server, an empty cache: what the user's bytes must be."""
    result = server("lower", "model.py:model", "-t", "tosa-int", "-o", out, "--no-server", "--no-direct", LOWERCACHE_DIR=str(cache), **extra)
    assert result.returncode == 0, result.stderr[-2000:]
    return (out / "model.pte").read_bytes()


def fresh_tiny(server, base: Path) -> subprocess.CompletedProcess:
    """The bundled tiny example lowered afresh for tosa-int into ``base / "fresh"``, shared across the run's tests."""
    return fresh_reference(server, base, "lower", TINY, "-t", "tosa-int", "-o", base / "fresh",
                           trees=(ROOT / "examples" / "tiny_cnn.py",))


def test_a_paused_server_does_not_hang_the_client(own, tmp_path):
    """SIGSTOP while idle: the old client waited 33 s, then said the server 'exited during start-up'. Mid-request: it hung."""
    server = own()
    pid = server.start()
    expected = fresh(server, tmp_path / "fresh", tmp_path / "fresh-cache")
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        idle = lower_model(server, tmp_path / "idle")
        first = ""
        while "warning" not in first and (line := idle.stderr.readline()):
            first += line
        # Noticed in the client's start-up plus a second or two, on a loaded machine too; the old client waited 33 s.
        assert time.monotonic() - start < 20, first
        stdout, rest = idle.communicate(timeout=WAIT)
        stderr = first + rest
        assert idle.returncode == 0, stderr[-2000:]
        assert [line for line in stderr.splitlines() if "warning" in line] == [
            f"lowercache: warning: the lowering server (pid {pid}) is not responding (its process is stopped); running in this process"
        ]
        assert (tmp_path / "idle" / "model.pte").read_bytes() == expected
    finally:
        os.kill(pid, signal.SIGCONT)

    marker = tmp_path / "marker"
    with server.switched(behaviour="slow", marker=str(marker)):  # the fallback runs the factory again: on until it is done
        busy = lower_model(server, tmp_path / "busy")
        assert wait_until(marker.exists, 120)
        child = int(marker.read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            stdout, stderr = busy.communicate(timeout=WAIT)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert busy.returncode == 0, stderr[-2000:]
    assert [line for line in stderr.splitlines() if "warning" in line] == [
        f"lowercache: warning: the lowering server (pid {pid}) is not responding (its process is stopped); running in this process"
    ]
    assert int(marker.read_text().split()[0]) == busy.pid  # the factory ran again, in the client
    assert not alive(child)  # the server's child was stopped before the client lowered: no second writer
    assert (tmp_path / "busy" / "model.pte").read_bytes() == expected
    assert server.status()["pid"] == str(pid)  # resumed, the server goes on


# 3. a directory at the socket path


def test_a_directory_at_the_socket_path_falls_back_at_once(tmp_path):
    """The old client started a server that warmed up for 10 s, then failed to bind."""
    run = Path(tempfile.mkdtemp(prefix="lcs", dir="/tmp"))
    try:
        (run / "lowercache").mkdir(mode=0o700)
        (run / "lowercache" / "server.sock").mkdir()
        result = lc("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", env=base_env(run, tmp_path / "cache"), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert warnings_of(result) == [
            f"lowercache: warning: no lowering server ({run}/lowercache/server.sock is a directory, so no server can listen there; "
            "remove it to use the server); running in this process"
        ]
        assert not (run / "lowercache" / "server.log").exists()  # no server was started
        assert (tmp_path / "out" / "model.pte").read_bytes() == stock_tiny(TARGET)
    finally:
        shutil.rmtree(run, ignore_errors=True)


# issue 41, item 5: Ctrl-C


def test_ctrl_c_through_the_server_exits_130_and_leaves_nothing(shared, tmp_path):
    """The old client printed click's 'Aborted!' and exited 1; a new process exits 130."""
    codes = {}
    for how in ("served", "here"):
        marker = tmp_path / f"marker-{how}"
        with shared.switched(behaviour="slow", marker=str(marker)):
            client = subprocess.Popen(
                [sys.executable, "-m", "lowercache.cli", "lower", "model.py:model", "-t", "tosa-int", "-o", str(tmp_path / how),
                 *(["--no-server"] if how == "here" else [])],
                env=shared.env, cwd=shared.project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            )
            assert wait_until(marker.exists, 120)
            child = int(marker.read_text().split()[0])
            os.killpg(client.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the foreground group
            stdout, stderr = client.communicate(timeout=120)
        codes[how] = client.returncode
        assert "Aborted!" not in stderr and "Traceback" not in stderr, stderr[-2000:]
        assert stderr.splitlines()[-1:] == ["lowercache: interrupted"], stderr[-2000:]  # as ccache and Bazel say it
        assert not (tmp_path / how).exists()
        assert wait_until(lambda: not alive(child), 10)
    assert codes == {"served": 130, "here": 130}
    assert shared.status()["pid"] == str(shared.pid)


def test_ctrl_c_through_run_exits_130(shared, tmp_path):
    """A command killed by SIGINT: the old client exited 254 (sys.exit(-2)); a shell says 130."""
    (tmp_path / "wait.py").write_text('import time\nprint("waiting", flush=True)\ntime.sleep(120)\n')
    for flags in (("--no-server",), ()):
        client = subprocess.Popen([sys.executable, "-m", "lowercache.cli", "run", *flags, "--", sys.executable, "wait.py"],
                                  cwd=tmp_path, env=shared.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert client.stdout.readline() == b"waiting\n"
        time.sleep(0.5)
        os.killpg(client.pid, signal.SIGINT)
        _, stderr = client.communicate(timeout=120)
        assert client.returncode == 130, (flags, stderr[-2000:])
    assert "in a child of the warm server" in explain(shared, tmp_path, sys.executable, "wait.py")


def test_an_interrupted_write_leaves_no_staging_or_partial_directory(tmp_path, monkeypatch):
    """Ctrl-C between two renames: the old code left the staging folder and half the files."""
    from lowercache import output

    calls = []
    real = os.replace

    def interrupted(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(source, target)

    monkeypatch.setattr(output.os, "replace", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        output.write_files({"model.pte": b"pte", "x.tosa": b"tosa"}, {}, out)
    assert not out.exists()


# 4. a full disk, through the server


def test_a_full_disk_through_the_server_says_disk_full(shared, tmp_path):
    """SQLite reports the first write to a full disk as 'disk I/O error'; the old warning said only that."""
    seeded = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / "seed-out", "--no-direct", LOWERCACHE_DIR=str(tmp_path / "seed"))
    assert seeded.returncode == 0, seeded.stderr[-2000:]
    fresh = fresh_tiny(shared, tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    with tmpfs(tmp_path / "small", "2m") as disk:
        shutil.copytree(tmp_path / "seed", disk / "cache")
        subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=4k"], capture_output=True)
        assert os.statvfs(disk).f_bavail == 0
        result = shared("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "out", "--no-direct", LOWERCACHE_DIR=str(disk / "cache"))
    assert result.returncode == 0, result.stderr[-2000:]
    said = warnings_of(result)
    assert len(said) == 1 and f"cache directory {disk / 'cache'} cannot be written (disk full" in said[0], said
    assert "damaged" not in result.stderr
    assert (tmp_path / "out" / "model.pte").read_bytes() == (tmp_path / "fresh" / "model.pte").read_bytes()
    assert shared.status()["pid"] == str(shared.pid)


def _cut_short_checkpoint(entries: Path) -> None:
    """An entries index whose main file holds half a checkpoint and whose write-ahead log the rest: sound read with
    its log (as SQLite leaves it when a checkpoint meets a full disk), 'malformed' to a reader that skips the log."""
    import diskcache

    diskcache.Cache(str(entries)).close()
    db = entries / "cache.db"
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = db.read_bytes()
    for i in range(300):
        con.execute("INSERT INTO Cache(key, raw, store_time, access_time, access_count, size, mode, value) "
                    "VALUES (?, 1, 0, 0, 0, 0, 1, ?)", (f"junk/{i}", bytes(200)))
    con.commit()
    log = (entries / "cache.db-wal").read_bytes()
    con.execute("PRAGMA wal_checkpoint(FULL)")
    after = db.read_bytes()
    con.close()
    half = len(after) // 4096 // 2 * 4096
    db.write_bytes(after[:half] + before[half:])
    (entries / "cache.db-wal").write_bytes(log)
    (entries / "cache.db-shm").unlink(missing_ok=True)


def test_a_full_disk_does_not_call_a_sound_index_damaged(shared, tmp_path):
    """Writing stopped, the store read its index through a connection that skips the log, and called it 'damaged
    (database disk image is malformed)' though integrity_check passes."""
    fresh = fresh_tiny(shared, tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    with tmpfs(tmp_path / "small", "2m") as disk:
        _cut_short_checkpoint(disk / "cache" / "entries")
        subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=1k"], capture_output=True)
        assert os.statvfs(disk).f_bavail == 0
        result = shared("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "out", "--no-direct", LOWERCACHE_DIR=str(disk / "cache"))
        (disk / "filler").unlink()  # room for the log's shared-memory file: the index read with its log is sound
        check = sqlite3.connect(f"file:{disk / 'cache' / 'entries' / 'cache.db'}?mode=ro", uri=True)
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        check.close()
    assert result.returncode == 0, result.stderr[-2000:]
    assert "is damaged" not in result.stderr and "malformed); not using" not in result.stderr, result.stderr
    assert any("write-ahead log" in line and "(disk full); it is not damaged" in line for line in warnings_of(result)), result.stderr
    assert (tmp_path / "out" / "model.pte").read_bytes() == (tmp_path / "fresh" / "model.pte").read_bytes()


HARNESS = """
import sys
from lowercache.server import loop, warm

def broken_fork(self, request):
    raise ZeroDivisionError("a fault nobody foresaw")

loop.Server._fork = broken_fork  # the fault: any exception while one request is handled
listener = loop._listen(sys.argv[1])
held = warm.Warm(threads=1, cpus=1, start_env={}, base_path=None)
loop.Server(listener, {"id": 1}, held, idle_timeout=60, jobs=1).serve()
"""


def _accepts(path: Path) -> bool:
    """The socket takes connections: its file appears at bind, a moment before the server listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def test_an_unforeseen_fault_ends_only_its_request(tmp_path):
    """The catch-all: a fault the schema cannot foresee (here injected into the fork) is one error reply; the server goes on."""
    at = types.SimpleNamespace(run=Path(tempfile.mkdtemp(prefix="lcs", dir="/tmp")))  # what raw() needs of a server
    (at.run / "lowercache").mkdir()
    path = at.run / "lowercache" / "server.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", HARNESS, str(path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: _accepts(path), 60)
        line = json.dumps({"op": "run", "argv": ["lower"], "cwd": "/", "env": {}, "path": [], "identity": {"id": 1},
                           "process": process_state.capture()}).encode()
        for _ in range(2):
            assert raw(at, line + b"\n") == {"error": "the server failed on this request (ZeroDivisionError)"}
        assert raw(at, b'{"op":"status"}\n')["failed"] == 2
        assert process.poll() is None
    finally:
        process.kill()
        _, log = process.communicate(timeout=30)
        shutil.rmtree(at.run, ignore_errors=True)
    assert "a request failed in the server: ZeroDivisionError: a fault nobody foresaw" in log
