"""Real servers on loopback for the remote-cache tests: Redis, S3 (moto), and a silent one.

Each binds 127.0.0.1 only and on a free port, and is stopped by its owner.
"""

from __future__ import annotations

import socket
import threading

from lowercache.bench.redisserver import RedisServer, free_port

__all__ = ["BUCKET", "RedisServer", "SilentServer", "free_port", "start_moto"]

BUCKET = "lowercache-test"  # the S3 bucket moto serves to the suite


def start_moto():
    """moto's S3 in server mode on a free loopback port; returns ``(server, endpoint_url)``."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


class SilentServer:
    """Accepts connections and never answers: a remote that is up but stuck."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._connections.append(conn)

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for conn in self._connections:
            conn.close()
