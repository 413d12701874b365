"""The local cache store: checked byte entries on top of ``diskcache``.

Layout (Bazel's split): an *action* entry maps a step's key to a small JSON
record naming its output blobs by digest; a *blob* entry maps a digest to the
bytes. Equal outputs of different steps are stored once.

Safety rules, all enforced here:
- values are bytes written as ``MAGIC + xxh3-128(payload) + payload``; a read
  recomputes the digest, so a flipped byte is a miss plus a warning, never a
  wrong result;
- nothing is unpickled: :class:`_BytesOnlyDisk` refuses diskcache's pickle
  mode for keys and values, so a planted pickle is rejected, not loaded;
- diskcache writes a value file first and commits its row after, inside an
  SQLite transaction (values under 1 KiB live in the row itself), so writes
  are atomic and several processes can share one directory.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import diskcache
from diskcache.core import MODE_PICKLE

from ..config import DEFAULT_MAX_SIZE
from ..errors import LowercacheError
from .hashing import digest

log = logging.getLogger("lowercache")

MAGIC = b"LCE1"
_DIGEST_LEN = 16


class _BytesOnlyDisk(diskcache.Disk):
    """A diskcache Disk that stores and returns bytes and strings only."""

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not isinstance(value, (bytes, str, int)):
            raise TypeError(f"lowercache stores bytes only, not {type(value).__name__}")
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode == MODE_PICKLE:
            raise CorruptEntry("entry is in pickle form; refusing to load it")
        return super().fetch(mode, filename, value, read)

    def get(self, key, raw):
        if not raw:
            raise CorruptEntry("key is in pickle form; refusing to load it")
        return super().get(key, raw)


class CorruptEntry(Exception):
    """An entry failed its integrity check."""


def frame(payload: bytes) -> bytes:
    return MAGIC + bytes.fromhex(digest(payload)) + payload


def unframe(data: Any) -> bytes:
    """The payload of a framed value, or :class:`CorruptEntry`."""
    if not isinstance(data, (bytes, bytearray)) or len(data) < len(MAGIC) + _DIGEST_LEN:
        raise CorruptEntry("entry is truncated or not bytes")
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptEntry("entry has a bad header")
    expected = data[len(MAGIC) : len(MAGIC) + _DIGEST_LEN].hex()
    payload = bytes(data[len(MAGIC) + _DIGEST_LEN :])
    if digest(payload) != expected:
        raise CorruptEntry("entry content does not match its checksum")
    return payload


@dataclass
class Entry:
    """A step's cached output: JSON metadata plus named blobs."""

    meta: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    cost: float = 0.0  # seconds the computation took; not part of the output

    def digest(self) -> str:
        """Digest of the whole output, used for early cutoff and verification."""
        form = {"meta": self.meta, "blobs": {k: digest(v) for k, v in self.blobs.items()}}
        return digest(json.dumps(form, sort_keys=True).encode())


class Store:
    """A cache directory shared by any number of processes.

    ``read_only`` stores serve hits but write nothing (ccache's read-only
    mode); counters and run history are still kept so ``stats`` stays true.
    """

    last_tier = "local"  # which tier served the latest hit; a tiered store may say "remote"

    def __init__(self, directory: str | os.PathLike, max_size: int = DEFAULT_MAX_SIZE, read_only: bool = False):
        self.directory = Path(directory).expanduser()
        self.read_only = read_only
        _check_writable(self.directory)
        try:
            self._entries = diskcache.Cache(
                str(self.directory / "entries"),
                disk=_BytesOnlyDisk,
                size_limit=max_size,
                disk_min_file_size=1024,  # small entries (qparams, action records) stay in SQLite
                eviction_policy="least-recently-used",
                statistics=False,
            )
            self._meta = diskcache.Cache(
                str(self.directory / "meta"), disk=_BytesOnlyDisk, size_limit=2**40, disk_min_file_size=2**20
            )
        except (sqlite3.Error, OSError) as e:
            raise LowercacheError(f"cannot open cache directory {self.directory}: {e}") from None

    def close(self) -> None:
        self._entries.close()
        self._meta.close()

    # -- entries -----------------------------------------------------------

    def get(self, kind: str, key: str) -> Entry | None:
        """The entry stored for ``key``, or None. A bad entry is dropped with a warning."""
        action_key = f"action/{kind}/{key}"
        try:
            raw = self._entries.get(action_key)
            if raw is None:
                return None
            record = json.loads(unframe(raw))
            if record.get("key") != key or record.get("kind") != kind:
                raise CorruptEntry("entry is filed under the wrong key")
            blobs = {name: self._get_blob(d) for name, d in record["blobs"].items()}
            return Entry(meta=record["meta"], blobs=blobs, cost=float(record.get("cost", 0.0)))
        except (CorruptEntry, ValueError, KeyError, TypeError, OSError, sqlite3.Error) as e:
            log.warning("cache entry %s/%s is unusable (%s); recomputing", kind, key[:12], e)
            self._discard(action_key)
            return None

    def _get_blob(self, blob_digest: str) -> bytes:
        raw = self._entries.get(f"blob/{blob_digest}")
        if raw is None:
            raise CorruptEntry(f"blob {blob_digest[:12]} is missing")
        try:
            payload = unframe(raw)
            if digest(payload) != blob_digest:
                raise CorruptEntry(f"blob {blob_digest[:12]} holds other content")
        except CorruptEntry:
            self._discard(f"blob/{blob_digest}")  # so the recomputed entry writes it afresh
            raise
        return payload

    def put(self, kind: str, key: str, entry: Entry) -> bool:
        """Store ``entry`` under ``key``; False when read-only or the write failed."""
        if self.read_only:
            return False
        try:
            names = {}
            for name, data in entry.blobs.items():
                blob_digest = digest(data)
                names[name] = blob_digest
                if not self._has_good_blob(blob_digest):
                    self._entries.set(f"blob/{blob_digest}", frame(data))
            record = {"kind": kind, "key": key, "meta": entry.meta, "blobs": names, "cost": entry.cost}
            self._entries.set(f"action/{kind}/{key}", frame(json.dumps(record, sort_keys=True).encode()))
            return True
        except (OSError, sqlite3.Error) as e:
            log.warning("could not write cache entry %s/%s (%s)", kind, key[:12], e)
            return False

    def _has_good_blob(self, blob_digest: str) -> bool:
        """True when an intact copy is stored (a miss path only, so reading it is cheap enough)."""
        try:
            self._get_blob(blob_digest)
            return True
        except (CorruptEntry, OSError, sqlite3.Error):
            return False

    def _discard(self, key: str) -> None:
        if self.read_only:
            return
        try:
            self._entries.delete(key)
        except (OSError, sqlite3.Error):
            pass

    def actions(self) -> Iterator[tuple[str, str]]:
        """(kind, key) of every stored action entry."""
        for k in list(self._entries.iterkeys()):
            if k.startswith("action/"):
                _, kind, key = k.split("/", 2)
                yield kind, key

    def verify_all(self) -> int:
        """Check every entry; drop the bad ones. Returns how many were dropped."""
        dropped = 0
        for key in list(self._entries.iterkeys()):
            try:
                payload = unframe(self._entries.get(key))
                if key.startswith("blob/") and digest(payload) != key[len("blob/") :]:
                    raise CorruptEntry("blob holds other content")
            except (CorruptEntry, OSError, sqlite3.Error):
                self._discard(key)
                dropped += 1
        return dropped

    # -- counters and history ------------------------------------------------

    def add_counts(
        self, counts: dict[str, dict[str, int]], seconds_saved: float = 0.0, remote_hits: dict[str, int] | None = None
    ) -> None:
        """Add outcome counts by kind, remote hits by kind, and time saved, in one transaction."""
        try:
            with self._meta.transact():
                for kind, by_outcome in counts.items():
                    for outcome, n in by_outcome.items():
                        self._meta.incr(f"count/{kind}/{outcome}", n)
                for kind, n in (remote_hits or {}).items():
                    self._meta.incr(f"count/{kind}/remote_hit", n)
                if seconds_saved > 0:
                    self._meta.incr("saved_ms", int(seconds_saved * 1000))
        except (OSError, sqlite3.Error):
            pass

    def counters(self) -> dict[str, int]:
        out = {}
        for key in self._meta.iterkeys():
            if key.startswith("count/") or key == "saved_ms":
                value = self._meta.get(key)
                if isinstance(value, int):
                    out[key] = value
        return out

    def put_record(self, name: str, value: Any) -> None:
        try:
            self._meta.set(f"record/{name}", frame(json.dumps(value, sort_keys=True).encode()))
        except (OSError, sqlite3.Error) as e:
            log.warning("could not write run record (%s)", e)

    def get_record(self, name: str) -> Any:
        try:
            raw = self._meta.get(f"record/{name}")
            return None if raw is None else json.loads(unframe(raw))
        except (CorruptEntry, ValueError, OSError, sqlite3.Error) as e:
            log.warning("run record %s is unusable (%s)", name, e)
            return None

    # -- housekeeping ----------------------------------------------------------

    def volume(self) -> int:
        return self._entries.volume()

    def entry_count(self) -> dict[str, int]:
        counts = {"actions": 0, "blobs": 0}
        for key in self._entries.iterkeys():
            counts["blobs" if key.startswith("blob/") else "actions"] += 1
        return counts

    def gc(self, max_size: int | None = None) -> int:
        """Evict least-recently-used entries down to ``max_size``; returns bytes freed."""
        before = self._entries.volume()
        if max_size is not None:
            self._entries.reset("size_limit", max_size)
        self._entries.cull()
        return before - self._entries.volume()

    def clear(self) -> int:
        removed = self._entries.clear()
        self._meta.clear()
        return removed


def _check_writable(directory: Path) -> None:
    """Fail early, in one line, when the cache directory cannot be used."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise LowercacheError(f"cache directory {directory} is not writable: {reason}") from None
