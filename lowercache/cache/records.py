"""The action record: the one format of a cached entry, in every tier.

An entry is stored as an *action record*, a small JSON object naming the
entry's output blobs by digest (Bazel's action cache), plus the blobs
themselves. The local store, the remote tiers and the archive all write the
record with :meth:`ActionRecord.to_bytes` and read it with :func:`parse`, so
a record one tier would refuse is refused by all of them, the same way: a
:class:`CorruptEntry`, which the caller treats as a miss and one warning.

The reader is strict because a record comes from a shared directory, a
remote or an archive that anyone with access may have written: every field
is checked for type and shape, and nothing is unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from .digests import digest

FIELDS = frozenset({"kind", "key", "meta", "blobs", "cost"})
MAX_META_DEPTH = 64
"""Deepest nesting of lists and objects a record's metadata may have (today's steps use under 10)."""
MAX_NAME_LENGTH = 1024
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what a C reader of the JSON could hold (file sizes, inodes, ns)
_HEX32 = re.compile(r"[0-9a-f]{32}")


class CorruptEntry(Exception):
    """An entry failed its integrity check or is malformed."""


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


class _HasOutput(Protocol):
    meta: dict[str, Any]
    blobs: dict[str, bytes]
    cost: float


@dataclass(frozen=True)
class ActionRecord:
    """What a tier stores under ``action/<kind>/<key>``: the entry's metadata and its blobs by digest.

    Constructing one checks it, so a record that exists is one :func:`parse`
    would accept: a step whose metadata is not plain JSON is not stored
    rather than stored and refused at every later read.
    """

    kind: str
    key: str
    meta: dict[str, Any]
    blobs: dict[str, str]  # blob name -> xxh3-128 digest of its bytes
    cost: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", _check_record(self.kind, self.key, self.meta, self.blobs, self.cost))

    @classmethod
    def of(cls, kind: str, key: str, entry: _HasOutput) -> ActionRecord:
        """The record of ``entry``; :class:`CorruptEntry` when it could not be read back."""
        return cls(kind, key, entry.meta, {name: digest(data) for name, data in entry.blobs.items()}, entry.cost)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "meta": self.meta, "blobs": self.blobs, "cost": self.cost}

    def to_bytes(self) -> bytes:
        """The stored form; the same bytes every earlier release wrote, so existing entries still read."""
        return json.dumps(self.to_json(), sort_keys=True).encode()

    def entry(self, blobs: dict[str, bytes]) -> Entry:
        """The entry, given the bytes of this record's blobs by name."""
        return Entry(meta=self.meta, blobs=blobs, cost=self.cost)


def parse(raw: Any, kind: str, key: str) -> ActionRecord:
    """The record stored for ``kind``/``key``, checked field by field; :class:`CorruptEntry` for anything else."""
    if not isinstance(raw, (bytes, bytearray)):
        raise CorruptEntry("record is not bytes")
    try:
        value = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptEntry(f"record is not JSON ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise CorruptEntry("record is not a JSON object")
    if set(value) != FIELDS:
        extra, missing = ", ".join(sorted(set(value) - FIELDS))[:60], ", ".join(sorted(FIELDS - set(value)))
        raise CorruptEntry(f"record has the wrong fields (extra: {extra or '-'}; missing: {missing or '-'})")
    if value["kind"] != kind or value["key"] != key:
        raise CorruptEntry("record is filed under the wrong key")
    return ActionRecord(kind, key, value["meta"], value["blobs"], value["cost"])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects with a name twice are refused: readers differ on which value wins."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("a name appears twice in an object")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_record(kind: Any, key: Any, meta: Any, blobs: Any, cost: Any) -> float:
    """Check every field; returns the cost as a float."""
    if not isinstance(kind, str) or not kind or not isinstance(key, str) or not key:
        raise CorruptEntry("record's kind or key is not a string")
    if not isinstance(blobs, dict):
        raise CorruptEntry("record's blobs are not an object")
    for name, blob_digest in blobs.items():
        if not _plain_name(name):
            raise CorruptEntry(f"record names a blob {str(name)[:40]!r}, not a plain relative name")
        if not isinstance(blob_digest, str) or not _HEX32.fullmatch(blob_digest):
            raise CorruptEntry("record has a blob digest that is not 32 lowercase hex digits")
    if not isinstance(meta, dict):
        raise CorruptEntry("record's metadata is not an object")
    _check_plain(meta, 0)
    if not _number(cost):
        raise CorruptEntry("record's cost is not a number")
    try:
        seconds = float(cost)
    except OverflowError:
        raise CorruptEntry("record's cost is out of range") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise CorruptEntry("record's cost is not a finite number of seconds")
    return seconds


def _plain_name(name: Any) -> bool:
    """A relative name of plain segments (``model.pte``, ``output/x.csv``): nothing that climbs out of a directory."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH or "\0" in name or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _check_plain(value: Any, depth: int) -> None:
    """``value`` is JSON of plain types: objects, lists, strings, bounded integers, finite floats, booleans, null.

    A loop over each container's items, exact types first: a stored program's
    metadata has thousands of values, checked at every hit. Subclasses (an
    enum, a numpy float) only come from a writer, and are written as their base.
    """
    if isinstance(value, dict):
        if not all(isinstance(name, str) for name in value):
            raise CorruptEntry("record's metadata has a name that is not a string")
        items = value.values()
    elif isinstance(value, (list, tuple)):  # a tuple is written as a list: only a writer can hand one in
        items = value
    else:
        raise CorruptEntry(f"record's metadata holds a {type(value).__name__}")
    if depth >= MAX_META_DEPTH:
        raise CorruptEntry("record's metadata is nested too deeply")
    for item in items:
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if not _INT_MIN <= item <= _INT_MAX:
                raise CorruptEntry("record's metadata holds an integer out of range")
        elif kind is float:
            if not math.isfinite(item):
                raise CorruptEntry("record's metadata holds a number that is not finite")
        elif isinstance(item, (dict, list, tuple)):
            _check_plain(item, depth + 1)
        elif isinstance(item, int):  # a subclass (an enum): checked as the int it is written as
            _check_plain([int(item)], depth)
        elif isinstance(item, float):  # a numpy float, say
            _check_plain([float(item)], depth)
        elif not isinstance(item, str):
            raise CorruptEntry(f"record's metadata holds a {kind.__name__}")
