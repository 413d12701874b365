"""A throwaway Redis on loopback: the shared tier for the process-level benchmark and the remote-cache tests.

Debian's ``redis-server`` on a free 127.0.0.1 port, without persistence, stopped by its owner.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway ``redis-server``: no persistence, loopback only."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_for_pong(deadline=time.monotonic() + 20)
        except BaseException:
            self.kill()
            raise

    def _wait_for_pong(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("redis-server did not answer PING")

    def kill(self) -> None:
        """Stop the server and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
