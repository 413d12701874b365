"""A local store first, then a guarded remote: remote hits are written back, new entries uploaded."""

from __future__ import annotations

import json
import logging
from typing import Any

from ..digests import digest
from ..records import ActionRecord, CorruptEntry, Entry, parse
from ..store import Store
from .guarded import Guarded

log = logging.getLogger("lowercache")

SHARED_RECORDS = "memo/"
"""Prefix of the records a :class:`TieredStore` shares through its remote."""

SUPERSEDED_KINDS = frozenset({"direct"})
"""Kinds whose value under one key is replaced over time: direct mode's records (unconfirmed, then
confirmed, then recorded afresh after an edit). Every other kind's key names its content, so a value
already in the remote is the same and is left alone."""


class TieredStore:
    """A local :class:`Store` first, then a guarded remote; remote hits are written back.

    On the remote, an action ``action/<kind>/<key>`` is the same JSON record
    as in the local store (:class:`~lowercache.cache.records.ActionRecord`,
    read by the one strict :func:`~lowercache.cache.records.parse`) and each
    blob is ``blob/<digest>``, all sealed, so equal outputs are shared as they
    are locally. Locally only :meth:`Store.get` and :meth:`Store.put` are used.

    Modes (of the remote): ``read-only`` serves remote hits and never
    uploads. ``write-only`` never reads the remote and uploads both new
    entries and local hits, which refreshes the remote's copies (their TTL,
    and their signature after a key change).

    Records named under ``memo/`` (small values derived from the toolchain,
    like the compile-spec digest) are shared too, as ``record/<name>``, so
    that a remote hit on an empty local cache needs no work to rebuild them.
    Anything else (counters, other records, gc) is the local store's,
    reached through attribute delegation so this is a drop-in for :class:`Store`.
    """

    def __init__(self, local: Store, remote: Guarded):
        self.local = local
        self.remote = remote
        self._uploaded: set[str] = set()  # blob digests already sent in this process
        self.last_tier = "local"  # which tier served the latest hit (recorded per step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def get(self, kind: str, key: str) -> Entry | None:
        entry = self.local.get(kind, key)
        if entry is not None:
            self.last_tier = "local"
            if self.remote.mode == "write-only":
                self._upload(kind, key, entry)
            return entry
        entry = self._fetch(kind, key)
        if entry is not None:
            self.last_tier = "remote"
            self.local.put(kind, key, entry)
        return entry

    def put(self, kind: str, key: str, entry: Entry) -> bool:
        """Store locally, then upload; True when the local write succeeded.

        A superseded kind's remote value is read first: this client may then replace it, as any value it
        has read (one signed with another key stays); otherwise the first record uploaded, unconfirmed,
        would stay in the remote for good and an empty local cache would never be served from it.
        """
        stored = self.local.put(kind, key, entry)
        if kind in SUPERSEDED_KINDS:
            self.remote.get(f"action/{kind}/{key}")
        self._upload(kind, key, entry)
        return stored

    def get_record(self, name: str) -> Any:
        """A local record; a shared (``memo/``) one missing locally comes from the remote and is kept."""
        value = self.local.get_record(name)
        if not name.startswith(SHARED_RECORDS):
            return value
        if value is not None:
            if self.remote.mode == "write-only":  # a refresh re-signs memos as it does entries
                self.remote.put(f"record/{name}", json.dumps(value, sort_keys=True).encode())
            return value
        raw = self.remote.get(f"record/{name}")
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            log.warning("ignoring remote record %s from %s: it is not JSON", name, self.remote.name)
            return None
        self.local.put_record(name, value)
        return value

    def put_record(self, name: str, value: Any) -> None:
        """Keep a record locally; share a ``memo/`` one through the remote as well."""
        self.local.put_record(name, value)
        if name.startswith(SHARED_RECORDS) and self.remote.can_write:
            self.remote.put(f"record/{name}", json.dumps(value, sort_keys=True).encode())

    def close(self) -> None:
        self.remote.close()
        self.local.close()

    def _fetch(self, kind: str, key: str) -> Entry | None:
        raw = self.remote.get(f"action/{kind}/{key}")
        if raw is None:
            return None
        try:
            record = parse(raw, kind, key)
        except CorruptEntry as e:
            self.remote.refuse(f"action/{kind}/{key}", e)
            return None
        blobs = {}
        for name, blob_digest in record.blobs.items():
            data = self.remote.get(f"blob/{blob_digest}")
            if data is None:
                log.debug("remote entry %s/%s lacks blob %s", kind, key[:12], blob_digest[:12])
                return None
            if digest(data) != blob_digest:
                log.warning("ignoring remote blob %s from %s: it holds other content", blob_digest[:12], self.remote.name)
                return None
            blobs[name] = data
        return record.entry(blobs)

    def _upload(self, kind: str, key: str, entry: Entry) -> None:
        """Blobs first, then the record, so a reader never sees a record without its blobs."""
        if not self.remote.can_write:
            return
        try:
            record = ActionRecord.of(kind, key, entry)
        except CorruptEntry:
            return  # the local store has said why it is not stored
        for name, blob_digest in record.blobs.items():
            if blob_digest not in self._uploaded:
                if not self.remote.put(f"blob/{blob_digest}", entry.blobs[name]):
                    return
                self._uploaded.add(blob_digest)
        self.remote.put(f"action/{kind}/{key}", record.to_bytes())
