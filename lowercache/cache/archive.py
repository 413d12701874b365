"""``lowercache export`` / ``import``: the local cache as one archive.

CI systems whose cache action stores one tarball handle one file better than
thousands of small remote entries. The archive is a plain tar: for every
action a JSON record ``action/<kind>/<key>.json`` naming its blobs, and every
blob as ``blob/<digest>``. Import checks everything before storing it: a
record must parse and be filed under its own key, and each blob must hash to
its name. Nothing is unpickled; anything that fails a check is skipped with a
warning.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
from pathlib import Path

from ..errors import LowercacheError
from .digests import digest
from .store import Entry, Store

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
                names = {}
                for name, data in entry.blobs.items():
                    blob_digest = digest(data)
                    names[name] = blob_digest
                    if blob_digest not in written:
                        _add(tar, f"blob/{blob_digest}", data)
                        written.add(blob_digest)
                record = {"kind": kind, "key": key, "meta": entry.meta, "blobs": names, "cost": entry.cost}
                _add(tar, f"action/{kind}/{key}.json", json.dumps(record, sort_keys=True).encode())
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
    records: list[dict] = []
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
                    record = json.loads(data)
                    if (record["kind"], record["key"]) != (m.group(1), m.group(2)):
                        raise ValueError("filed under the wrong key")
                    records.append(record)
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("archive record %s is unusable (%s); skipped", member.name, e)
    stored = 0
    for record in records:
        try:
            entry = Entry(
                meta=dict(record["meta"]),
                blobs={name: blobs[d] for name, d in record["blobs"].items()},
                cost=float(record.get("cost", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("archive record %s/%s lacks a blob; skipped", record["kind"], record["key"][:12])
            continue
        stored += store.put(record["kind"], record["key"], entry)
    return stored
