"""The local cache store: checked byte entries on top of ``diskcache``.

Layout (Bazel's split): an *action* entry maps a step's key to a small JSON
record naming its output blobs by digest; a *blob* entry maps a digest to the
bytes. Equal outputs of different steps are stored once.

Safety rules, all enforced here:
- values are bytes written as ``MAGIC + xxh3-128(payload) + payload``; a read
  recomputes the digest, so a flipped byte is a miss plus a warning, never a
  wrong result;
- nothing is unpickled: :class:`_BytesOnlyDisk` refuses diskcache's pickle
  mode for values, so a planted pickle is rejected, not loaded, and shows a
  pickle-form key as :class:`UnreadableKey` (``gc --verify`` drops its row);
- diskcache writes a value file first and commits its row after, inside an
  SQLite transaction (values under 1 KiB live in the row itself), so writes
  are atomic and several processes can share one directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import diskcache
from diskcache.core import MODE_PICKLE

from ..config import DEFAULT_MAX_SIZE
from ..errors import LowercacheError
from .dbfile import (
    DB_NAME,
    Reader,
    UnreadableKey,
    aside_copies,
    confirmed_damaged,
    damaged,
    disk_full,
    move_aside,
    no_space_left,
    orphans,
    referenced_files,
    value_files,
)
from .digests import digest
# CorruptEntry and Entry live in .records; callers import them from here too.
from .records import ActionRecord, CorruptEntry, Entry, parse

log = logging.getLogger("lowercache")

MAGIC = b"LCE1"
_warned: set[tuple[str, str]] = set()  # (directory, fault) already reported by this process
_DIGEST_LEN = 16


_ZEROED = "zeroed"  # the meta key of when ``stats --zero`` last ran


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
            return UnreadableKey(bytes(key))  # listed as unreadable, never unpickled
        return super().get(key, raw)

    def put(self, key):
        if isinstance(key, UnreadableKey):
            return sqlite3.Binary(key.data), False  # the row as stored, so it can be deleted
        return super().put(key)


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


_live: "weakref.WeakSet[Store]" = weakref.WeakSet()  # every store of this process, for ``close_for_fork``


def close_for_fork() -> bool:
    """Close this thread's connections of every store in the process, before a fork (``run/ahead.py``).

    SQLite's state must not cross a fork: the child would share the parent's
    lock bookkeeping and the WAL's shared memory through the copied library
    state, and its own writes then corrupt the database (seen as "database
    disk image is malformed" in the parent). Closed connections reopen on
    next use. False when a store cannot be closed so (a read-only index
    holds its one connection): then nothing should fork.
    """
    stores = list(_live)
    if any(isinstance(db, Reader) for s in stores for db in (s._entries, s._meta)):
        return False
    for store in stores:
        store.close()
    return True


class Store:
    """A cache directory shared by any number of processes.

    ``read_only`` stores serve hits and write nothing at all: no entry,
    counter, run record or access time (ccache's read-only touches no
    backend). They read the index through an immutable connection, so a
    read-only mount works and no byte of the directory changes.

    Faults never fail a lowering (see docs/faults.md): a damaged index is
    moved aside and started afresh; a directory that cannot take writes
    (a full disk) turns writing off with one warning and keeps serving hits;
    ``gc`` and ``clear`` can still free space on it.
    """

    last_tier = "local"  # which tier served the latest hit; a tiered store may say "remote"

    def __init__(self, directory: str | os.PathLike, max_size: int = DEFAULT_MAX_SIZE, read_only: bool = False):
        self.directory = Path(directory).expanduser()
        self.read_only = read_only
        self.max_size = max_size
        self.unwritable = ""  # why a store that is not read-only writes nothing (a full disk); "" when it writes
        self._healed: set[str] = set()
        self._entries: diskcache.Cache | Reader | None = None
        self._meta: diskcache.Cache | Reader | None = None
        if not read_only:
            self._check_writable()
        self._entries = self._open("entries")
        self._meta = self._open("meta")
        _live.add(self)

    @property
    def writable(self) -> bool:
        return not self.read_only and not self.unwritable

    def close(self) -> None:
        for db in (self._entries, self._meta):
            if db is not None:
                db.close()

    # -- opening, healing, degrading --------------------------------------------

    def _check_writable(self) -> None:
        """Fail early, in one line, when the cache directory cannot be used; a full disk only turns writing off."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-"):
                pass
        except OSError as e:
            if disk_full(e):
                self._stop_writing(e)
                return
            reason = e.strerror or str(e)
            hint = "; set LOWERCACHE_READ_ONLY=1 to use it read-only" if self.directory.is_dir() else ""
            raise LowercacheError(f"cache directory {self.directory} is not writable: {reason}{hint}") from None

    def _open(self, name: str) -> diskcache.Cache | Reader:
        """The index ``name`` (entries or meta): diskcache when writable, else a :class:`Reader`."""
        if self.writable:
            try:
                return self._diskcache(name)
            except (sqlite3.Error, OSError) as e:
                error = e
            if self._heal(name, error):
                try:
                    return self._diskcache(name)
                except (sqlite3.Error, OSError) as e:
                    error = e
            self._stop_writing(error)
        return self._reader(name)

    def _reader(self, name: str) -> Reader:
        path = self.directory / name
        return Reader(path, _BytesOnlyDisk(str(path)).fetch)

    def _diskcache(self, name: str) -> diskcache.Cache:
        if name == "entries":
            settings = dict(
                size_limit=self.max_size,
                disk_min_file_size=1024,  # small entries (qparams, action records) stay in SQLite
                eviction_policy="least-recently-used",
                statistics=False,
            )
        else:
            settings = dict(size_limit=2**40, disk_min_file_size=2**20)
        return diskcache.Cache(str(self.directory / name), disk=_BytesOnlyDisk, **settings)

    def _reopen(self) -> None:
        """Try writing again (after ``gc`` or ``clear`` freed space)."""
        self.close()
        self.unwritable = ""
        self._entries = self._meta = None
        self._entries = self._open("entries")
        self._meta = self._open("meta")

    def _warn(self, topic: str, message: str, *args: Any) -> None:
        """One warning per fault per directory per process: not per entry, nor per store opened (the CLI opens two)."""
        if (str(self.directory), topic) not in _warned:
            _warned.add((str(self.directory), topic))
            log.warning(message, *args)

    def _heal(self, name: str, error: BaseException) -> bool:
        """Move a damaged index aside and start an empty one; False when ``error`` is not damage."""
        if not damaged(error) or name in self._healed:
            return False
        self._healed.add(name)
        db = self.directory / name / DB_NAME
        current = getattr(self, f"_{name}")
        if current is not None:
            current.close()
        try:
            aside = move_aside(db)
        except OSError as e:
            self._stop_writing(e)
            return False
        done = f"moved it to {aside.name}" if aside is not None else "another process already moved it aside"
        self._warn(f"damaged {name}", "cache database %s is damaged (%s); %s and started an empty one; recomputing", db, error, done)
        if current is not None:
            setattr(self, f"_{name}", self._open(name))
        return True

    def _stop_writing(self, error: BaseException) -> None:
        """Serve hits only from now on, through readers (diskcache's reads write access times)."""
        full = disk_full(error) or no_space_left(self.directory)
        hint = "; `lowercache gc --max-size SIZE` or `lowercache clear` frees space" if full else ""
        self.unwritable = "disk full" if full else str(error)
        # SQLite reports a write that found no free block as "disk I/O error" (SQLITE_IOERR_WRITE): say what it is
        said = error if disk_full(error) or not full else f"disk full: {error}"
        self._warn("unwritable", "cache directory %s cannot be written (%s); storing nothing this run%s", self.directory, said, hint)
        for name in ("entries", "meta"):
            current = getattr(self, f"_{name}")
            if isinstance(current, diskcache.Cache):
                current.close()
                setattr(self, f"_{name}", self._reader(name))

    def _failed(self, name: str, error: BaseException) -> bool:
        """Handle an index error: heal damage, stop writing on a full disk. True when handled (and warned)."""
        if damaged(error):
            db = self.directory / name / DB_NAME
            if not self.writable and not confirmed_damaged(db):  # a reader that skips the log, not a damaged file
                full = " (disk full)" if no_space_left(self.directory) else ""
                self._warn(f"unreadable {name}", "cache database %s could not be read without its write-ahead log (%s), "
                           "which cannot be opened now%s; it is not damaged; not using it this run", db, error, full)
                return True
            if self.writable and not self._heal(name, error):
                self._stop_writing(error)  # damaged again after a heal: leave the file alone
            self._warn(f"damaged {name}", "cache database %s is damaged (%s); not using it", db, error)
            return True
        if disk_full(error):
            if not self.read_only:
                self._stop_writing(error)
            return True
        return False

    def _keys(self, name: str) -> list[str | UnreadableKey]:
        """Every row key of an index; unreadable (pickle-form) keys as :class:`UnreadableKey`."""
        try:
            return list(getattr(self, f"_{name}").iterkeys())
        except (OSError, sqlite3.Error) as e:
            self._failed(name, e)
            return []

    # -- entries -----------------------------------------------------------

    def get(self, kind: str, key: str) -> Entry | None:
        """The entry stored for ``key``, or None. A bad entry is dropped with a warning."""
        action_key = f"action/{kind}/{key}"
        try:
            raw = self._entries.get(action_key)
            if raw is None:
                return None
            record = parse(unframe(raw), kind, key)
            return record.entry({name: self._get_blob(d) for name, d in record.blobs.items()})
        except (CorruptEntry, ValueError, KeyError, TypeError, OSError, sqlite3.Error) as e:
            if isinstance(e, (OSError, sqlite3.Error)) and self._failed("entries", e):
                return None
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
        """Store ``entry`` under ``key``; False when read-only, unwritable or the write failed."""
        if not self.writable:
            return False
        try:
            record = ActionRecord.of(kind, key, entry)
        except CorruptEntry as e:
            self._warn("unstorable", "not storing cache entry %s/%s: %s", kind, key[:12], e)
            return False
        try:
            for name, blob_digest in record.blobs.items():
                if not self._has_good_blob(blob_digest):
                    self._entries.set(f"blob/{blob_digest}", frame(entry.blobs[name]))
            self._entries.set(f"action/{kind}/{key}", frame(record.to_bytes()))
            return True
        except (OSError, sqlite3.Error) as e:
            if not self._failed("entries", e):
                self._warn("write", "could not write cache entry %s/%s (%s)", kind, key[:12], e)
            return False

    def _has_good_blob(self, blob_digest: str) -> bool:
        """True when an intact copy is stored (a miss path only, so reading it is cheap enough)."""
        try:
            self._get_blob(blob_digest)
            return True
        except (CorruptEntry, OSError, sqlite3.Error):
            return False

    def _discard(self, key: str | UnreadableKey) -> None:
        if not self.writable:
            return
        try:
            self._entries.delete(key)
        except (OSError, sqlite3.Error) as e:
            self._failed("entries", e)

    def actions(self) -> Iterator[tuple[str, str]]:
        """(kind, key) of every stored action entry."""
        for k in self._keys("entries"):
            if isinstance(k, str) and k.startswith("action/"):
                _, kind, key = k.split("/", 2)
                yield kind, key

    def verify_all(self) -> int:
        """Check every entry (frames, blob digests, action records); drop the bad ones, and rows whose key cannot be read.

        Returns how many were dropped.
        """
        dropped = 0
        for key in self._keys("entries"):
            try:
                if isinstance(key, UnreadableKey):
                    raise CorruptEntry("key is in pickle form")
                payload = unframe(self._entries.get(key))
                if key.startswith("blob/") and digest(payload) != key[len("blob/") :]:
                    raise CorruptEntry("blob holds other content")
                if key.startswith("action/"):
                    _, kind, action_key = key.split("/", 2)
                    parse(payload, kind, action_key)
            except (CorruptEntry, OSError, sqlite3.Error):
                self._discard(key)
                dropped += 1
        return dropped

    # -- counters and history ------------------------------------------------

    def add_counts(
        self, counts: dict[str, dict[str, int]], seconds_saved: float = 0.0, remote_hits: dict[str, int] | None = None
    ) -> None:
        """Add outcome counts by kind, remote hits by kind, and time saved, in one transaction."""
        if not self.writable:
            return
        try:
            with self._meta.transact():
                for kind, by_outcome in counts.items():
                    for outcome, n in by_outcome.items():
                        self._meta.incr(f"count/{kind}/{outcome}", n)
                for kind, n in (remote_hits or {}).items():
                    self._meta.incr(f"count/{kind}/remote_hit", n)
                if seconds_saved > 0:
                    self._meta.incr("saved_ms", int(seconds_saved * 1000))
        except (OSError, sqlite3.Error) as e:
            self._failed("meta", e)

    def counters(self) -> dict[str, int]:
        out = {}
        for key in self._keys("meta"):
            if isinstance(key, str) and (key.startswith("count/") or key == "saved_ms"):
                try:
                    value = self._meta.get(key)
                except (CorruptEntry, OSError, sqlite3.Error):
                    continue
                if isinstance(value, int):
                    out[key] = value
        return out

    def zero_counters(self) -> None:
        """Set the hit, miss and time-saved counters back to zero (``stats --zero``, as ``ccache -z``), and note when;
        entries stay."""
        if not self.writable:
            return
        try:
            with self._meta.transact():
                for key in list(self.counters()):
                    self._meta.delete(key)
                self._meta.set(_ZEROED, int(time.time()))
        except (OSError, sqlite3.Error) as e:
            self._failed("meta", e)

    def zeroed_at(self) -> int | None:
        """When the counters were last set to zero (seconds since the epoch), or None: never since the cache was made."""
        try:
            value = self._meta.get(_ZEROED)
        except (CorruptEntry, OSError, sqlite3.Error):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def put_record(self, name: str, value: Any) -> None:
        if not self.writable:
            return
        try:
            self._meta.set(f"record/{name}", frame(json.dumps(value, sort_keys=True).encode()))
        except (OSError, sqlite3.Error) as e:
            if not self._failed("meta", e):
                self._warn("record", "could not write run record (%s)", e)

    def get_record(self, name: str) -> Any:
        try:
            return self._load_record(name)
        except (OSError, sqlite3.Error) as e:
            if not self._failed("meta", e):
                log.warning("run record %s is unusable (%s)", name, e)
            return None

    def update_record(self, name: str, update: Callable[[Any], Any]) -> None:
        """Replace a record with ``update(current)`` (None when absent or unusable) in one transaction.

        SQLite's write lock is held from the read to the write, so processes
        updating one record at once (two runs of a model finishing together)
        each see the other's update instead of overwriting it.
        """
        if not self.writable:
            return
        try:
            with self._meta.transact():
                value = update(self._load_record(name))
                self._meta.set(f"record/{name}", frame(json.dumps(value, sort_keys=True).encode()))
        except (OSError, sqlite3.Error) as e:
            if not self._failed("meta", e):
                self._warn("record", "could not write run record (%s)", e)
        except diskcache.Timeout:
            self._warn("record", "could not write run record %s: the cache stayed locked too long", name)

    def _load_record(self, name: str) -> Any:
        """A record's value; None, with a warning, when it is absent or does not check out (I/O errors raise)."""
        try:
            raw = self._meta.get(f"record/{name}")
            return None if raw is None else json.loads(unframe(raw))
        except (CorruptEntry, ValueError, RecursionError) as e:
            log.warning("run record %s is unusable (%s)", name, e)
            return None

    # -- housekeeping ----------------------------------------------------------

    def volume(self) -> int:
        try:
            return self._entries.volume()
        except (OSError, sqlite3.Error) as e:
            self._failed("entries", e)
            return 0

    def entry_count(self) -> dict[str, int]:
        counts = {"actions": 0, "blobs": 0}
        for key in self._keys("entries"):
            if isinstance(key, str):
                counts["blobs" if key.startswith("blob/") else "actions"] += 1
        return counts

    def gc(self, max_size: int | None = None) -> int:
        """Evict least-recently-used entries down to ``max_size`` (default: the store's); returns bytes freed.

        On a full disk SQLite cannot record a deletion, so the value files of
        the entries to evict go first; the index is then reopened and culled.
        """
        limit = self.max_size if max_size is None else max_size
        start = self.volume()
        files_freed = 0
        if self.unwritable and not self.read_only:
            files_freed = self._evict_files(limit)
            self._reopen()
        if self.writable:
            try:
                self._entries.reset("size_limit", limit)
                self._entries.cull()
            except (OSError, sqlite3.Error) as e:
                self._failed("entries", e)
        return max(start - self.volume(), files_freed)

    def _evict_files(self, limit: int) -> int:
        """Remove the value files of the least recently used entries over ``limit``; returns their bytes."""
        excess = self.volume() - limit
        freed = 0
        try:
            victims = self._entries.least_recent_files()
        except (OSError, sqlite3.Error):
            return 0
        for filename, size in victims:
            if freed >= excess:
                break
            if _remove_value_file(self.directory / "entries" / filename):
                freed += size
        return freed

    def reclaim_orphans(self) -> tuple[int, int]:
        """Remove value files no entry names (left by a deleted or damaged index); returns (files, bytes)."""
        if not self.writable:
            return 0, 0
        directory = self.directory / "entries"
        try:
            found = orphans(directory, referenced_files(directory))
        except (OSError, sqlite3.Error):
            return 0, 0  # an index that cannot be read would make every file look orphaned
        files = size = 0
        for path in found:
            with contextlib.suppress(FileNotFoundError):
                n = path.stat().st_size
                if _remove_value_file(path):
                    files, size = files + 1, size + n
        return files, size

    def clear(self) -> int:
        """Remove every entry, counter, run record and moved-aside database; returns the entries removed.

        Value files go first: on a full disk that frees the room SQLite needs
        to record the rest. An index that still cannot be written is removed.
        """
        if self.read_only:
            return 0
        files = 0
        for path in list(value_files(self.directory / "entries")):
            files += _remove_value_file(path)
        for name in ("entries", "meta"):
            for copy in aside_copies(self.directory / name):
                copy.unlink(missing_ok=True)
        if not self.writable:
            self._reopen()
        if not self.writable:
            self.close()
            for name in ("entries", "meta"):
                for suffix in ("", "-wal", "-shm"):
                    (self.directory / name / f"{DB_NAME}{suffix}").unlink(missing_ok=True)
            self._reopen()
        try:
            removed = self._entries.clear()
            self._meta.clear()
        except (AttributeError, OSError, sqlite3.Error) as e:
            self._failed("entries", e)
            removed = 0
        return max(removed, files)


def _remove_value_file(path: Path) -> bool:
    """Unlink a value file and its emptied subdirectories, as diskcache does; False when it was gone."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    with contextlib.suppress(OSError):
        os.removedirs(path.parent)
    return True
