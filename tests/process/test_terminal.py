"""At a real terminal (a pseudo-terminal): what an interactive user sees while ``lower`` waits for and runs in the server."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from tests.helpers.cli import TINY
from tests.helpers.server import Server


def at_a_terminal(server: Server, *args: str, timeout: float = 600) -> tuple[int, str]:
    """The command with a pseudo-terminal as its stdin, stdout and stderr: its exit code and everything it showed."""
    leader, follower = os.openpty()
    process = subprocess.Popen([sys.executable, "-m", "lowercache.cli", *args], cwd=server.project, env={**server.env, "COLUMNS": "100"},
                               stdin=follower, stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    shown = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # the terminal's other side closed: the command has exited
                break
            if not chunk:
                break
            shown += chunk
        elif process.poll() is not None:
            break
    code = process.wait(timeout=60)
    os.close(leader)
    return code, shown.decode("utf-8", "replace")


def test_the_first_lower_says_it_starts_the_server_and_shows_progress_from_it(own, tmp_path):
    server = own()
    code, shown = at_a_terminal(server, "lower", TINY, "-t", "ethos-u55-128", "-o", str(tmp_path / "out"))
    assert code == 0, shown[-3000:]
    starting = shown.find("starting the lowering server")
    table = shown.find("lowercache steps")
    assert 0 <= starting < table, shown[:2000]
    # the spinner, drawn by the server's child on the client's terminal, names the stages as they run (a stage shorter
    # than one refresh may be skipped: any of them shows it drew)
    between = shown[starting:table]
    assert any(stage in between for stage in ("export", "quantize:", "to_edge", "tosa: partition", "vela: partition")), between[:2000]
    assert server.status()  # it went through the server
