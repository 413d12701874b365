"""Where a command's output is shown: a warm server's child writes into pipes, but answers as the client's streams would.

The child's stdout and stderr are pipes the server relays to the client. What
the client's streams are (a terminal or not, its size) reaches the child in
the request and lives in these streams, never in the child's environment: the
factory, and the records made while it runs, see the client's environment as
it is (``environment.py``). Code that asks ``sys.stderr.isatty()`` (rich,
typer, a progress bar of the user's) gets the client's answer, as it would in
a new process; lowercache's own consoles take the size from here too.
"""

from __future__ import annotations

import io
from typing import Any


class Relayed(io.TextIOWrapper):
    """A server child's stdout or stderr: a pipe to the client, saying whether the client's stream is a terminal, and its size."""

    def __init__(self, fd: int, tty: bool, size: tuple[int, int], encoding: str | None, errors: str | None,
                 line_buffering: bool, files: list[tuple[int, int]] | None = None) -> None:
        super().__init__(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding=encoding, errors=errors,
                         line_buffering=line_buffering)
        self.tty = tty
        self.size = size
        self.files = files or []  # the regular files the client's stream ends in (device, inode): sweep.written_by

    def isatty(self) -> bool:
        return self.tty


def size(stream: Any) -> tuple[int, int] | None:
    """``(columns, lines)`` of the client's terminal when ``stream`` is a server child's stream to one (and its size is known)."""
    if isinstance(stream, Relayed) and stream.tty and stream.size[0] > 0:
        return stream.size[0], stream.size[1] or 25  # rich's own default when a terminal does not say
    return None
