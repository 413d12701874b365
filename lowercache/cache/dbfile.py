"""The SQLite index files of a cache directory, and what the store does when they fail.

The store must outlive damage to its own files: a malformed index is moved
aside (kept for a bug report) and started afresh, a full disk turns writing
off instead of failing the build, and a read-only directory is read without
a single write. This module holds the file-level parts of that:

- :func:`damaged` and :func:`disk_full` sort SQLite and OS errors;
- :func:`move_aside` renames a damaged ``cache.db`` (and its WAL files),
  once, however many processes notice the damage at the same time;
- :class:`Reader` reads diskcache's table through an ``immutable`` SQLite
  connection: no lock, no WAL or shared-memory file, no access-time update,
  so it works on a read-only mount and changes no byte of the directory;
- :func:`orphans` finds value files no row refers to (left by a deleted or
  moved-aside index), so ``gc`` can reclaim them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

DB_NAME = "cache.db"
ASIDE_INFIX = ".corrupt-"
# A value file is written before its row is committed; one younger than this may be a
# concurrent writer's, not an orphan.
ORPHAN_GRACE_SECONDS = 600.0

_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 11, 13, 26


def _code(e: BaseException) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def damaged(e: BaseException) -> bool:
    """True when ``e`` says the database file itself is malformed (not busy, not full)."""
    if not isinstance(e, sqlite3.DatabaseError):
        return False
    if _code(e) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    text = str(e).lower()
    return "malformed" in text or "not a database" in text


def disk_full(e: BaseException) -> bool:
    """True when ``e`` is a full disk or an exhausted quota."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, sqlite3.Error) and (_code(e) == _SQLITE_FULL or "disk is full" in str(e).lower())


def no_space_left(directory: Path) -> bool:
    """True when the filesystem of ``directory`` has no block left (SQLite may report that as an I/O error)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024


def _sound(db: Path) -> bool:
    """True unless a fresh connection finds ``db`` malformed (a busy file counts as sound)."""
    try:
        con = sqlite3.connect(db, timeout=10)
        try:
            rows = con.execute("PRAGMA quick_check(1)").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        return not damaged(e)
    return rows == [("ok",)]


def confirmed_damaged(db: Path) -> bool:
    """True only when a fresh read-only connection, which reads the write-ahead log too and writes nothing, finds ``db`` malformed.

    An immutable :class:`Reader` ignores the log: after a checkpoint cut
    short (a full disk) or while another process checkpoints, the main file
    alone can look malformed though the database is sound.
    """
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
        try:
            rows = con.execute("PRAGMA quick_check(1)").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        return damaged(e)
    return rows != [("ok",)]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def move_aside(db: Path) -> Path | None:
    """Rename a damaged ``db`` and its WAL files to ``cache.db.corrupt-<time>``; returns the new path.

    Under a lock, and only when a fresh connection confirms the damage: the
    processes that met the same damage find a sound (new) file and return
    None, so none of them moves aside another's fresh database.
    """
    with _locked(db.parent / ".heal.lock"):
        if not db.exists() or _sound(db):
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = db.with_name(f"{db.name}{ASIDE_INFIX}{stamp}-{os.getpid()}")
        os.replace(db, aside)
        for suffix in ("-wal", "-shm"):  # a stale WAL must not be replayed into the new file
            with contextlib.suppress(FileNotFoundError):
                os.replace(db.with_name(db.name + suffix), aside.with_name(aside.name + suffix))
        return aside


def aside_copies(directory: Path) -> list[Path]:
    """Damaged databases moved aside under ``directory`` (kept until ``clear``)."""
    return sorted(directory.glob(f"{DB_NAME}{ASIDE_INFIX}*"))


def value_files(directory: Path) -> Iterator[Path]:
    """diskcache's value files under ``directory``."""
    return directory.glob("*/*/*.val")


def orphans(directory: Path, referenced: set[str], grace: float = ORPHAN_GRACE_SECONDS) -> list[Path]:
    """Value files under ``directory`` that no row names and that are older than ``grace`` seconds."""
    now = time.time()
    found = []
    for path in value_files(directory):
        if str(path.relative_to(directory)) in referenced:
            continue
        try:
            if now - path.stat().st_mtime >= grace:
                found.append(path)
        except FileNotFoundError:
            pass
    return found


class UnreadableKey:
    """A row key stored in pickle form: never unpickled, only shown as unreadable and deletable."""

    def __init__(self, data: bytes):
        self.data = data

    def __repr__(self) -> str:
        return f"UnreadableKey({len(self.data)} bytes)"


def _live_reader(db: Path) -> sqlite3.Connection | None:
    """A read-only connection that sees a live writer's WAL, when there is one and it can be read."""
    wal = db.with_name(db.name + "-wal")
    if not wal.is_file() or wal.stat().st_size == 0:
        return None
    con = None
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=10)
        con.execute("SELECT count(*) FROM Cache").fetchall()
        return con
    except sqlite3.Error:
        if con is not None:
            con.close()
        return None


class Reader:
    """diskcache's table read through an immutable connection: no writes of any kind.

    Immutable means SQLite neither locks nor reads the WAL, and a page being
    checkpointed while read may look malformed: a miss, never a wrong
    result, as every value carries its own digest (see :mod:`.store`). When
    a writer's WAL holds rows (a live shared directory), the WAL is read
    through a ``mode=ro`` connection instead, which takes SQLite's read
    locks in the writer's shared-memory file but writes no row.
    ``fetch`` is the store's bytes-only Disk, so pickles stay refused.
    """

    def __init__(self, directory: Path, fetch: Any):
        self.directory = directory
        self._fetch = fetch
        db = directory / DB_NAME
        self._con = None
        if db.is_file():
            self._con = _live_reader(db) or sqlite3.connect(f"{db.resolve().as_uri()}?immutable=1", uri=True, check_same_thread=False)

    def _rows(self, query: str, args: tuple = ()) -> list[tuple]:
        if self._con is None:
            return []
        try:
            return self._con.execute(query, args).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):  # created by a writer that ran out of space (or is still creating it)
                return []
            raise

    def get(self, key: str, default: Any = None) -> Any:
        rows = self._rows("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,))
        if not rows:
            return default
        mode, filename, value = rows[0]
        return self._fetch(mode, filename, value, False)

    def iterkeys(self) -> Iterator[str | UnreadableKey]:
        for key, raw in self._rows("SELECT key, raw FROM Cache ORDER BY rowid"):
            yield key if raw else UnreadableKey(bytes(key))

    def volume(self) -> int:
        if self._con is None:
            return 0
        ((pages,),) = self._rows("PRAGMA page_count")
        ((page_size,),) = self._rows("PRAGMA page_size")
        size = self._rows("SELECT value FROM Settings WHERE key = 'size'")
        return pages * page_size + (size[0][0] if size else 0)

    def files(self) -> set[str]:
        """Value files the rows name, relative to the directory."""
        return {f for (f,) in self._rows("SELECT filename FROM Cache WHERE filename IS NOT NULL")}

    def least_recent_files(self) -> list[tuple[str, int]]:
        """(value file, size) of rows with a file, least recently used first."""
        return self._rows("SELECT filename, size FROM Cache WHERE filename IS NOT NULL ORDER BY access_time")

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None


def referenced_files(directory: Path) -> set[str]:
    """Value files the index under ``directory`` names: read consistently, WAL included.

    Raises :class:`sqlite3.Error` when the index cannot be read: the caller
    must then delete nothing, as every file would look orphaned.
    """
    db = directory / DB_NAME
    if not db.exists():
        return set()
    con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=60)
    try:
        return {f for (f,) in con.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    finally:
        con.close()
