"""A server's child takes the client's process state, not the server's (``lowercache/process_state.py``).

``fork`` carries the server's umask, CPU set, resource limits, nice value,
ignored and blocked signals into every child. Each case starts a client under
other values than the server's (one CPU, a umask, a lower open-files limit,
SIGHUP ignored, SIGUSR1 blocked, nice 5) and compares what the model
factory, or a script under ``lowercache run``, sees and writes with a new
process under the same values; a state the child cannot take (another stack
limit) is declined, and the command runs as a new process would. The time
zone is a variable: one that differs replaces the server (environment.py).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.server import WAIT

PY = sys.executable
TARGET = "tosa-fp"

SEEN = textwrap.dedent(
    """
    import datetime, json, os, resource, signal, time
    import torch

    def seen():
        umask = os.umask(0)
        os.umask(umask)
        return {
            "zone": time.strftime("%Z %z", time.localtime(0)), "tzname": list(time.tzname),
            "now": datetime.datetime.now().astimezone().tzname(),
            "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "umask": umask,
            "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)), "nice": os.nice(0),
            "hup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        }
    """
)

MODEL = SEEN + textwrap.dedent(
    """
    class M(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return torch.relu(x) * self.scale

    def model():
        state = seen()
        with open(os.environ["SEEN"], "w") as f:
            json.dump(state, f)
        return M(1.0 + time.localtime(0).tm_gmtoff / 3600 + state["threads"]).eval(), (torch.ones(1, 8),)
    """
)

SCRIPT = SEEN + textwrap.dedent(
    """
    print(json.dumps(seen()))
    with open("out.txt", "w") as f:
        f.write("written")
    """
)


def _client_state() -> None:
    """In the client, before it starts: what a user's shell, ``taskset``, ``ulimit``, ``nohup`` and ``nice`` set."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    os.nice(5)


def _other_stack() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (4 * 2**20 if soft != 4 * 2**20 else 6 * 2**20, hard))


def client(server, *args: str, preexec=_client_state, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "lowercache.cli", *args], cwd=server.project, env={**server.env, "TZ": "Asia/Tokyo", **env},
                          capture_output=True, text=True, timeout=WAIT, umask=0o077, preexec_fn=preexec)


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A server started under the test process's own state (all CPUs, umask 022), for this module. Its environment is the
    clients' (``TZ`` included): a variable that differs replaces the server (environment.py), which would test nothing."""
    from tests.helpers.server import Server

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: a client on one must differ from the server")
    root = tmp_path_factory.mktemp("state")
    server = Server(root, SEEN=str(root / "seen.json"), TZ="Asia/Tokyo")
    (server.project / "model.py").write_text(MODEL)
    (server.project / "script.py").write_text(SCRIPT)
    server.pid = server.start()
    yield server
    server.close()


def lowered(server, out: Path, *flags: str, **kwargs) -> tuple[dict, bytes, int, str]:
    seen = Path(server.env["SEEN"])
    seen.unlink(missing_ok=True)
    result = client(server, "lower", "model.py:model", "-t", TARGET, "-o", str(out), *flags, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert server.status()["pid"] == str(server.pid), "the client replaced the server: the case tests nothing"
    pte = out / "model.pte"
    return json.loads(seen.read_text()), pte.read_bytes(), pte.stat().st_mode & 0o777, result.stderr


def test_a_factory_through_the_server_sees_the_clients_process_state(started, tmp_path):
    fresh = lowered(started, tmp_path / "fresh", "--no-cache", "--no-server")
    assert fresh[0]["zone"] == "JST +0900" and fresh[0]["cpus"] == [min(os.sched_getaffinity(0))] and fresh[0]["threads"] == 1
    assert fresh[0]["umask"] == 0o077 and fresh[0]["nofile"][0] == 512 and fresh[0]["hup_ignored"] and fresh[0]["nice"] >= 5
    served = lowered(started, tmp_path / "served", "--no-cache", "--no-direct")
    assert "warning" not in served[3], served[3]
    assert served[:3] == fresh[:3]


def test_a_script_through_the_server_sees_the_clients_process_state(started, tmp_path):
    seen = []
    for flags in (("--no-server",), ()):
        result = client(started, "run", *flags, "--", PY, "script.py")  # a record's first run, then its confirming run
        assert result.returncode == 0, result.stderr[-3000:]
        out = started.project / "out.txt"
        seen.append((json.loads(result.stdout), out.stat().st_mode & 0o777))
        out.unlink()
    assert seen[0] == seen[1] and seen[0][0]["zone"] == "JST +0900" and seen[0][1] == 0o600
    explained = client(started, "run", "--explain", "--", PY, "script.py").stdout
    assert "in a child of the warm server" in explained, explained


def test_a_state_the_child_cannot_take_is_declined_in_one_line(started, tmp_path):
    """The main thread's stack was laid out by the server's own stack limit: a client under another runs in its own process."""
    fresh = lowered(started, tmp_path / "fresh", "--no-cache", "--no-server", preexec=_other_stack)
    served = lowered(started, tmp_path / "served", "--no-cache", "--no-direct", preexec=_other_stack)
    assert served[:3] == fresh[:3]
    warnings = [line for line in served[3].splitlines() if "warning" in line]
    assert warnings == ["lowercache: warning: the lowering server cannot stand in for this interpreter (the server's child "
                        "cannot take the client's resource limit RLIMIT_STACK (the server started under another)); "
                        "running in this process"], served[3]
    (started.project / "other.py").write_text(SCRIPT)
    result = client(started, "run", "--", PY, "other.py", preexec=_other_stack)
    assert result.returncode == 0 and json.loads(result.stdout)["zone"] == "JST +0900"
    explained = client(started, "run", "--explain", "--", PY, "other.py", preexec=_other_stack).stdout
    assert "as a new process (the server's child cannot take the client's resource limit RLIMIT_STACK" in explained, explained
