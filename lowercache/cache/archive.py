"""``lowercache export`` / ``import``: the local cache as one archive.

CI systems whose cache action stores one tarball handle one file better than
thousands of small remote entries. The archive is a plain tar: for every
action its record ``action/<kind>/<key>.json`` (the JSON every tier stores,
:class:`~lowercache.cache.records.ActionRecord`) naming its blobs, and every
blob as ``blob/<digest>``. Import checks everything before storing it: a
record must pass the one strict reader every tier uses, filed under its own
key, and each blob must hash to its name. Nothing is unpickled; anything that
fails a check is skipped with a warning.
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
from pathlib import Path

from ..errors import LowercacheError
from .digests import digest
from .records import ActionRecord, CorruptEntry, parse
from .store import Store

log = logging.getLogger("lowercache")

_ACTION = re.compile(r"action/([a-z_]+)/([0-9a-f]{32})\.json")
_BLOB = re.compile(r"blob/([0-9a-f]{32})")


def export_entries(store: Store, path: str | os.PathLike) -> tuple[int, int]:
    """Write every intact entry to a tar file; returns (actions, blobs) written."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    actions = 0
    written: set[str] = set()
    try:
        with tarfile.open(tmp, "w") as tar:
            for kind, key in store.actions():
                entry = store.get(kind, key)
                if entry is None:
                    continue
                record = ActionRecord.of(kind, key, entry)  # read back by the store's strict reader: cannot fail
                for name, blob_digest in record.blobs.items():
                    if blob_digest not in written:
                        _add(tar, f"blob/{blob_digest}", entry.blobs[name])
                        written.add(blob_digest)
                _add(tar, f"action/{kind}/{key}.json", record.to_bytes())
                actions += 1
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LowercacheError(f"cannot write archive {target}: {e.strerror or e}") from None
    return actions, len(written)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def import_entries(store: Store, path: str | os.PathLike) -> int:
    """Load a tar made by :func:`export_entries`; returns how many actions were stored."""
    try:
        tar = tarfile.open(path, "r")
    except (OSError, tarfile.TarError) as e:
        raise LowercacheError(f"cannot read archive {path}: {e}") from None
    blobs: dict[str, bytes] = {}
    records: list[ActionRecord] = []
    with tar:
        for member in tar:
            if not member.isfile():
                continue
            data = tar.extractfile(member).read()
            if (m := _BLOB.fullmatch(member.name)) is not None:
                if digest(data) == m.group(1):
                    blobs[m.group(1)] = data
                else:
                    log.warning("archive blob %s holds other content; skipped", m.group(1)[:12])
            elif (m := _ACTION.fullmatch(member.name)) is not None:
                try:
                    records.append(parse(data, m.group(1), m.group(2)))
                except CorruptEntry as e:
                    log.warning("archive record %s is unusable (%s); skipped", member.name, e)
    stored = 0
    for record in records:
        missing = [d for d in record.blobs.values() if d not in blobs]
        if missing:
            log.warning("archive record %s/%s lacks a blob; skipped", record.kind, record.key[:12])
            continue
        stored += store.put(record.kind, record.key, record.entry({name: blobs[d] for name, d in record.blobs.items()}))
    return stored
