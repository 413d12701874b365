"""The interface every remote backend implements: raw bytes by key, no checks, no error handling.

Policy (sealing, deadlines, turning off at the first fault) is :class:`~.guarded.Guarded`'s,
so each backend stays a thin client of its store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any
from urllib.parse import urlsplit

from ...errors import LowercacheError
from .seal import MAX_WIRE_SIZE

DEFAULT_PREFIX = "lowercache/"
DEFAULT_TIMEOUT = 5.0
"""Seconds a remote may take to connect, or to send the next bytes of a reply."""


class Remote(ABC):
    """A remote key-value store of raw bytes.

    Backends do no checking and no error handling: they raise on any fault and
    leave the policy to :class:`~.guarded.Guarded`. Keys are lowercache's own
    (``action/<kind>/<hex>``, ``blob/<hex>``); a backend files them under its
    prefix.
    """

    name: str
    max_value_size: int = MAX_WIRE_SIZE
    """Largest value the backend takes; bigger ones are not written (and not read)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None when there are none."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any old value."""

    def add(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless a value is there; False when one was.

        Backends override this with an atomic conditional write; this
        fallback looks first, so two writers may still race.
        """
        if self.get(key) is not None:
            return False
        self.put(key, data)
        return True

    def close(self) -> None:
        """Release connections. Safe to call more than once."""


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return parts._replace(netloc=user + netloc).geturl()


def import_client(module: str, purpose: str) -> Any:
    """Import a backend's client library only when that backend is used."""
    try:
        return __import__(module)
    except ImportError:
        raise LowercacheError(f"{purpose} needs the Python package {module!r}; pip install {module}") from None
