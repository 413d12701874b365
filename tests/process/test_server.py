"""The warm server, end to end: real server processes in a temporary socket directory, real clients, bounded waits.

Most tests share one server (starting one costs 10-20 s of imports and
warm-up); those about a server's life (idle exit, replacement, death
mid-request) start their own. The shared server is started from the default
environment (no OMP_NUM_THREADS), the case where a fork after torch's thread
pool ran can hang.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from tests.helpers import attention
from tests.helpers.cli import TINY, error_lines, stock_tiny, warnings_of
from tests.helpers.server import MODEL, TARGET, WAIT, alive, base_env, lc, steady, wait_until


# the shared server


def test_status_shows_a_current_server(shared):
    rows = shared.status()
    assert rows["pid"] == str(shared.pid)
    assert rows["state"] == "current"
    assert "lowercache 0.1.0" in rows["server"] and "torch 2.13.0" in rows["server"]
    assert re.fullmatch(r"\d+\.\d s", rows["uptime"])
    assert re.match(r"\d+\.\d MiB resident", rows["memory"]) and float(rows["memory"].split()[0]) > 100
    assert rows["idle exit"] == "after 600 s without a request"


def test_socket_directory_is_private(shared):
    directory = shared.run / "lowercache"
    st = os.lstat(directory)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    sock = os.lstat(directory / "server.sock")
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600


def test_bytes_through_the_server_equal_stock_and_in_process(shared, tmp_path):
    flow_only = {"LOWERCACHE_DIRECT": "0"}  # the third run is to be a flow hit in a child, not a direct-mode answer
    served = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / "served", **flow_only)
    assert served.returncode == 0, served.stderr[-2000:]
    here = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / "here", "--no-server", **flow_only)
    assert here.returncode == 0, here.stderr[-2000:]
    hit = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / "hit", **flow_only)
    assert hit.returncode == 0, hit.stderr[-2000:]
    stock = stock_tiny(TARGET)
    for out in ("served", "here", "hit"):
        assert (tmp_path / out / "model.pte").read_bytes() == stock, out
    # the output is the CLI's own: no warm-up noise (Vela's summary of the warm-up model), the same lines as in-process
    assert served.stdout.replace("served", "X") == here.stdout.replace("here", "X")
    assert steady(hit.stderr) == steady(here.stderr)
    assert "Network summary" not in served.stdout + served.stderr
    assert int(shared.status()["served"]) >= 2


def test_verbose_lists_what_a_new_process_holds_back(shared, tmp_path):
    """The server's imports raised their warnings once, in the server; each child still counts them as its own."""

    def held(*extra: str) -> set[str]:
        result = shared("-v", "lower", TINY, "-t", TARGET, "-o", tmp_path / "out", *extra, LOWERCACHE_DIR=str(tmp_path / f"c{len(extra)}"))
        assert result.returncode == 0, result.stderr[-2000:]
        return {line for line in result.stderr.splitlines() if line.startswith("  ")}

    served, here = held(), held("--no-server")
    assert served == here and len(here) > 0


def test_verify_through_the_server(shared, tmp_path):
    served = shared("verify", TINY, "-t", "tosa-int")
    here = shared("verify", TINY, "-t", "tosa-int", "--no-server")
    assert served.returncode == here.returncode == 0, served.stderr[-2000:] + here.stderr[-2000:]
    assert "byte-identical" in served.stdout and served.stdout.split("checked:")[0] == here.stdout.split("checked:")[0]
    # each checked what lower would serve from where it ran: the server's child is the server's answer itself
    assert served.stdout.rstrip().endswith("the server's answer (this process)")
    assert "the server's answer" not in here.stdout  # --no-server: no server to ask


def test_no_server_stays_in_process(shared, tmp_path):
    before = shared.status()["served"]
    for args, extra in ((["--no-server"], {}), ([], {"LOWERCACHE_SERVER": "0"})):
        result = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", *args, **extra)
        assert result.returncode == 0, result.stderr[-2000:]
    assert shared.status()["served"] == before


def test_two_clients_at_once(shared, tmp_path):
    before = int(shared.status()["served"])
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "lowercache.cli", "lower", "model.py:model", "-t", "tosa-int", "-o", str(tmp_path / f"out{i}")],
            env={**shared.env, "LOWERCACHE_DIR": str(tmp_path / f"cache{i}")},
            cwd=shared.project,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=WAIT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    assert (tmp_path / "out0" / "model.pte").read_bytes() == (tmp_path / "out1" / "model.pte").read_bytes()
    assert int(shared.status()["served"]) == before + 2


@pytest.mark.parametrize("threads", [None, "1", "3"])
def test_the_child_gets_the_clients_thread_count(shared, tmp_path, threads):
    """The server runs single-threaded (fork safety); each request gets what a new process would have."""
    marker = tmp_path / "marker"
    extra = {"OMP_NUM_THREADS": threads} if threads else {}
    with shared.switched(marker=str(marker)):
        result = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "out", **extra)
    assert result.returncode == 0, result.stderr[-2000:]
    child_pid, child_threads = map(int, marker.read_text().split())
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env={**shared.env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child_threads == int(fresh.stdout)
    assert child_pid != shared.pid


def test_a_lowering_made_at_one_thread_count_is_not_served_at_another(shared, tmp_path):
    """Calibration's float sums follow the thread count: this block's .pte differs with OMP_NUM_THREADS=1 from the
    default's, and each command gets what a new process with its variables makes, direct mode on (the default)."""
    (tmp_path / "attention.py").write_text(attention.SOURCE)
    model, pte = f"{tmp_path}/attention.py:attention", {}
    for name, extra in (("default", {}), ("one", {"OMP_NUM_THREADS": "1"}), ("default again", {})):
        result = shared("lower", model, "-t", "tosa-int", "-o", tmp_path / name, **extra)
        assert result.returncode == 0, result.stderr[-2000:]
        pte[name] = (tmp_path / name / "model.pte").read_bytes()
        if name != "default again":
            fresh = shared("lower", model, "-t", "tosa-int", "-o", tmp_path / f"{name} fresh", "--no-cache", "--no-server",
                           **extra)
            assert fresh.returncode == 0, fresh.stderr[-2000:]
            assert pte[name] == (tmp_path / f"{name} fresh" / "model.pte").read_bytes(), name
    assert pte["one"] != pte["default"] == pte["default again"]


def test_a_factory_that_raises(shared, tmp_path):
    with shared.switched(behaviour="raise"):
        served = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "a")
        here = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "b", "--no-server")
    line = next(n for n, text in enumerate(MODEL.splitlines(), 1) if "boom" in text)
    assert served.returncode == here.returncode == 2
    assert error_lines(served) == error_lines(here) == [f"lowercache: error: factory model.py:model raised ValueError: boom (at model.py:{line})"]
    assert served.stdout == "" and "Traceback" not in served.stderr
    assert not (tmp_path / "a").exists()
    with shared.switched(behaviour="raise"):  # LOWERCACHE_DEBUG shows the traceback, through the server and without it
        debugged = [shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "c", *flags, LOWERCACHE_DEBUG="1")
                    for flags in ((), ("--no-server",))]
    for result in debugged:
        assert result.returncode == 2 and "Traceback" in result.stderr and f'model.py", line {line}, in model' in result.stderr
        assert error_lines(result) == error_lines(here)
    assert shared.status()["pid"] == str(shared.pid)


def test_a_factory_that_aborts(shared, tmp_path):
    with shared.switched(behaviour="abort"):
        result = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "out")
    assert result.returncode == 1
    assert error_lines(result) == ["lowercache: error: the lowering process was killed by SIGABRT; the server is still up"]
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert shared.status()["pid"] == str(shared.pid)


def test_a_factory_that_hangs_past_the_timeout(shared, tmp_path):
    marker = tmp_path / "marker"
    start = time.monotonic()
    with shared.switched(behaviour="hang", marker=str(marker)):
        result = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "out", LOWERCACHE_SERVER_TIMEOUT="3")
    assert time.monotonic() - start < 120
    assert result.returncode == 1
    assert error_lines(result) == [
        "lowercache: error: the lowering took longer than the request timeout (3 s, LOWERCACHE_SERVER_TIMEOUT) and was stopped"
    ]
    child = int(marker.read_text().split()[0])
    assert wait_until(lambda: not alive(child), 10)
    assert shared.status()["pid"] == str(shared.pid)


def test_a_corrupt_entry_is_recomputed_in_the_servers_child_as_in_a_new_process(shared, tmp_path):
    """A fault met in a request's child is what it is in a new process: the same warnings (one per damaged entry), a
    recompute, stock's bytes."""
    own = {"LOWERCACHE_DIRECT": "0", "LOWERCACHE_DIR": str(tmp_path / "cache")}  # the second run reads the flow entry
    before = int(shared.status()["served"])
    first = shared("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "out", **own)
    assert first.returncode == 0, first.stderr[-2000:]
    for path in (tmp_path / "cache" / "entries").rglob("*.val"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
    shutil.copytree(tmp_path / "cache", tmp_path / "copy")
    again = shared("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "out", **own)
    assert again.returncode == 0, again.stderr[-2000:]
    assert int(shared.status()["served"]) == before + 2  # both ran in the server's children
    here = shared("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "here", "--no-server", **{**own, "LOWERCACHE_DIR": str(tmp_path / "copy")})
    assert here.returncode == 0, here.stderr[-2000:]
    assert warnings_of(again) == warnings_of(here) and warnings_of(again), again.stderr[-2000:]
    assert all("unusable" in line and line.endswith("recomputing") for line in warnings_of(again)), again.stderr[-2000:]
    assert (tmp_path / "out" / "model.pte").read_bytes() == (tmp_path / "here" / "model.pte").read_bytes() == stock_tiny("tosa-int")
    third = shared("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "out", **own)
    assert third.returncode == 0 and not warnings_of(third), third.stderr[-2000:]
    assert (tmp_path / "out" / "model.pte").read_bytes() == stock_tiny("tosa-int")


def test_an_edited_model_and_module_are_lowered_fresh(shared, tmp_path):
    """The server never imports user code: each request imports the model file and what it imports anew."""

    def lower(name: str) -> bytes:
        served = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / name)
        assert served.returncode == 0, served.stderr[-2000:]
        here = shared("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / f"{name}-here", "--no-server", LOWERCACHE_DIR=str(tmp_path / "c2"))
        assert here.returncode == 0, here.stderr[-2000:]
        pte = (tmp_path / name / "model.pte").read_bytes()
        assert pte == (tmp_path / f"{name}-here" / "model.pte").read_bytes()
        return pte

    helper, model = shared.project / "helper.py", shared.project / "model.py"
    original = (helper.read_text(), model.read_text())
    try:
        first = lower("first")
        helper.write_text(original[0].replace("Conv2d(3, 8, 3)", "Conv2d(3, 16, 3)"))  # the imported module
        second = lower("second")
        model.write_text(original[1].replace("torch.randn(1, 3, 16, 16)", "torch.randn(1, 3, 20, 20)"))  # the model file
        third = lower("third")
    finally:
        helper.write_text(original[0])
        model.write_text(original[1])
    assert len({first, second, third}) == 3
    assert shared.status()["pid"] == str(shared.pid)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_users_client_is_refused(shared):
    """The 0700 directory keeps other users out; behind it the server checks the peer's uid itself."""
    directory = shared.run / "lowercache"
    sock = directory / "server.sock"
    nobody = pwd.getpwnam("nobody").pw_uid
    for path, mode in ((shared.run, 0o755), (directory, 0o755), (sock, 0o666)):
        os.chmod(path, mode)
    try:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.setuid(nobody)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(20)
                s.connect(str(sock))
                try:
                    s.sendall(b'{"op":"status"}\n')
                    reply = s.recv(100)
                except (ConnectionResetError, BrokenPipeError):
                    reply = b""
                code = 0 if reply == b"" else 1  # closed without a reply
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, code = os.waitpid(pid, 0)
    finally:
        for path, mode in ((shared.run, 0o700), (directory, 0o700), (sock, 0o600)):
            os.chmod(path, mode)
    assert os.waitstatus_to_exitcode(code) == 0
    assert shared.status()["pid"] == str(shared.pid)


# servers of their own


def test_start_is_idempotent(shared):
    assert shared.start() == shared.pid  # already running with this identity: reused


def test_start_stop_and_idle_exit(own):
    server = own(LOWERCACHE_SERVER_IDLE_TIMEOUT="5")
    pid = server.start()
    rows = server.status()
    assert rows["pid"] == str(pid) and rows["idle exit"] == "after 5 s without a request"
    assert wait_until(lambda: not alive(pid), 60)
    assert not (server.run / "lowercache" / "server.sock").exists()
    assert server.status() == {}
    begun = time.monotonic()
    pid = server.start()
    took = time.monotonic() - begun
    assert float(server.status()["uptime"].split()[0]) >= took / 2  # from the process's start: the warm-up counts
    result = server("server", "stop", timeout=120)
    assert result.stdout.strip() == f"server stopped (pid {pid})"
    assert not alive(pid) and server.status() == {}
    assert server("server", "stop").stdout.strip() == "no server running"


def test_a_stale_server_is_replaced(own, tmp_path):
    server = own()
    old = server.start()
    changed = {"LOWERCACHE_SERVER_IDLE_TIMEOUT": "601"}  # a server setting: part of the identity
    assert server.status(**changed)["state"].startswith("stale")
    result = server("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", **changed)
    assert result.returncode == 0, result.stderr[-2000:]
    assert warnings_of(result) == []
    rows = server.status(**changed)
    assert rows["pid"] != str(old) and rows["state"] == "current" and rows["served"] == "1"
    assert wait_until(lambda: not alive(old), 60)
    assert (tmp_path / "out" / "model.pte").read_bytes() == stock_tiny(TARGET)
    server.env.update(changed)


def test_the_client_falls_back_when_the_server_dies_mid_request(own, tmp_path):
    server = own()
    pid = server.start()
    marker = tmp_path / "marker"
    with server.switched(behaviour="slow", marker=str(marker)):  # the fallback runs the factory again: on until it is done
        client = subprocess.Popen(
            [sys.executable, "-m", "lowercache.cli", "lower", "model.py:model", "-t", "tosa-int", "-o", str(tmp_path / "out")],
            env=server.env,
            cwd=server.project,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert wait_until(marker.exists, 120)
        child = int(marker.read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = client.communicate(timeout=WAIT)
    assert client.returncode == 0, stderr[-2000:]
    assert [line for line in stderr.splitlines() if line.startswith("lowercache: warning:")] == [
        "lowercache: warning: the lowering server stopped during the request (the server closed the connection); running in this process"
    ]
    assert stdout.startswith("wrote ")
    assert wait_until(lambda: not alive(child), 10)  # the request's process died with its server
    assert int(marker.read_text().split()[0]) == client.pid  # the fallback ran the factory in the client
    here = server("lower", "model.py:model", "-t", "tosa-int", "-o", tmp_path / "here", "--no-server", LOWERCACHE_DIR=str(tmp_path / "c2"))
    assert here.returncode == 0, here.stderr
    assert (tmp_path / "out" / "model.pte").read_bytes() == (tmp_path / "here" / "model.pte").read_bytes()


def test_an_unsafe_socket_directory_is_refused_with_one_warning(tmp_path):
    run = Path(tempfile.mkdtemp(prefix="lcs", dir="/tmp"))
    try:
        (run / "lowercache").mkdir(mode=0o755)
        os.chmod(run / "lowercache", 0o755)
        result = lc("lower", TINY, "-t", TARGET, "-o", tmp_path / "out", env=base_env(run, tmp_path / "cache"), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert len(warnings_of(result)) == 1 and "is not a directory only you can enter" in warnings_of(result)[0]
        assert not (run / "lowercache" / "server.sock").exists()
    finally:
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.quick
def test_config_shows_the_server_settings(tmp_path):
    result = lc("config", env={**os.environ, "LOWERCACHE_SERVER_JOBS": "3"}, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "env LOWERCACHE_SERVER)" in rows["server"] and " false " in rows["server"] + " "
    assert rows["server_jobs"].split()[1] == "3"
    assert rows["server_idle_timeout"].split()[1] == "600" and rows["server_timeout"].split()[1] == "3600"
    bad = lc("lower", TINY, "-t", TARGET, "-o", tmp_path / "o", env={**os.environ, "LOWERCACHE_SERVER_JOBS": "many"}, cwd=tmp_path, timeout=WAIT)
    assert bad.returncode == 2 and error_lines(bad) == ["lowercache: error: bad value 'many' for server_jobs; use a whole number, 0 or more"]


def test_a_usage_error_is_reported_in_the_process_and_starts_no_server(own):
    server = own()
    for line, message in ((["lower", "model.py:model", "-t", TARGET, "-o", "out", "-v"], "No such option: -v"),
                          (["lower", "model.py:model", "-t", TARGET], "Missing option"),
                          (["verify", "model.py:model"], "Missing option")):
        result = server(*line)
        assert result.returncode == 2 and message in result.stderr, (line, result.stderr[-2000:])
    assert server.status() == {} and not (server.run / "lowercache" / "server.sock").exists()
    assert not (server.project / "out").exists()


def test_a_warning_the_client_gave_is_not_given_again_by_the_servers_child(shared, tmp_path):
    # direct mode's lookup in the client meets the remote first: without a key it is off, which the client says
    unkeyed = ("--remote", "redis://127.0.0.1:9/0", "--cache-dir", tmp_path / "cache")
    for out in ("cold", "again"):
        result = shared("lower", TINY, "-t", TARGET, "-o", tmp_path / out, *unkeyed)
        assert result.returncode == 0, result.stderr[-2000:]
        assert len(warnings_of(result)) == 1 and "LOWERCACHE_HMAC_KEY" in warnings_of(result)[0], result.stderr
