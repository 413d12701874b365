"""Digests of bytes and JSON, without torch: the store, the remote and direct mode use them before torch is imported."""

from __future__ import annotations

import json
import os
from typing import Any

import xxhash


def digest(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of raw bytes, as 32 hex characters."""
    return xxhash.xxh3_128_hexdigest(data)


def digest_json(value: Any) -> str:
    """Digest of a JSON-able value in canonical form (sorted keys, no spaces)."""
    return digest(canonical_json(value).encode())


def stat_key(st: os.stat_result) -> list[int]:
    """What a file's stat says of its identity and age: size, mtime, ctime (an edit in place that keeps size and mtime
    still moves it), inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
