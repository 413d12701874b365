"""The wire form of a remote value: zstd compressed, bound to its key, checksummed, signed with HMAC-SHA256 when a key is set.

A remote can lie, so :func:`unseal` refuses anything that fails a check and
caps the decompressed size, so a small value cannot expand into gigabytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import zstandard

from ..digests import digest
from ..records import CorruptEntry

ENV_HMAC_KEY = "LOWERCACHE_HMAC_KEY"
ENV_REQUIRE_SIGNED = "LOWERCACHE_REMOTE_REQUIRE_SIGNED"

MAX_ENTRY_SIZE = 2 * 2**30
"""Largest value :func:`unseal` will decompress, against zip bombs."""

SEAL_MAGIC = b"LCR1"
_SIGNED = 0x01
_KNOWN_FLAGS = _SIGNED
_HEADER = struct.Struct(">4sB16s16sQ")  # magic, flags, key digest, content digest, size
_MAC_LEN = hashlib.sha256().digest_size
_UNBOUND = bytes(16)
_ZSTD_LEVEL = 3
# zstd can grow incompressible input a little; a value bigger than this cannot
# be a sealed entry that passes the size cap, so it is refused unread.
MAX_WIRE_SIZE = MAX_ENTRY_SIZE + MAX_ENTRY_SIZE // 64 + _HEADER.size + _MAC_LEN


class RefusedEntry(CorruptEntry):
    """A remote value failed a check. It is ignored, never used."""


class BadHeader(RefusedEntry):
    """Not a sealed lowercache value (wrong magic, truncated, unknown flags)."""


class BadSignature(RefusedEntry):
    """Signed with another key, or altered after signing."""


class Unsigned(BadSignature):
    """Not signed, while a key is configured: written by a client without the key (or forged)."""


class WrongKey(RefusedEntry):
    """A value sealed for another key, e.g. copied from one key to another."""


class EntryTooLarge(RefusedEntry):
    """The value would decompress beyond the size cap."""


class BadContent(RefusedEntry):
    """The compressed bytes do not decompress to the data that was sealed."""


def digest_key(key: str) -> str:
    """The digest a sealed value carries to bind it to its key (32 hex characters).

    SHA-256, not the faster xxh3, so that with a signing key nobody can find
    two keys that share a digest and replay a signed value under the other.
    """
    return hashlib.sha256(key.encode()).digest()[:16].hex()


def seal(data: bytes, hmac_key: bytes | None, key_digest: str | None = None) -> bytes:
    """Wire form of ``data``: header, optional HMAC, zstd frame.

    Layout (all integers big-endian)::

        magic            4  b"LCR1"
        flags            1  bit 0: signed
        key digest      16  digest_key(key), or zeros when not bound to a key
        content digest  16  xxh3-128 of the uncompressed data
        size             8  uncompressed length
        hmac            32  HMAC-SHA256(hmac_key, header + zstd frame); only if signed
        zstd frame     ...

    The HMAC covers the header too, so the key binding and size are signed.
    """
    bound = bytes.fromhex(key_digest) if key_digest is not None else _UNBOUND
    if len(bound) != 16:
        raise ValueError("key_digest must be 32 hex characters; use digest_key()")
    flags = _SIGNED if hmac_key else 0
    header = _HEADER.pack(SEAL_MAGIC, flags, bound, bytes.fromhex(digest(data)), len(data))
    compressed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data)
    mac = hmac.new(hmac_key, header + compressed, hashlib.sha256).digest() if hmac_key else b""
    return header + mac + compressed


def unseal(
    blob: bytes,
    hmac_key: bytes | None,
    expected_key_digest: str | None,
    max_size: int = MAX_ENTRY_SIZE,
) -> bytes:
    """The data sealed in ``blob``, or a :class:`RefusedEntry` subclass.

    Checks run cheapest and most telling first, and the signature is checked
    before any decompression, so an unsigned forgery costs one HMAC. Without a
    configured key a signed value is accepted (there is nothing to check it
    against); the content checks still apply.
    """
    if len(blob) < _HEADER.size:
        raise BadHeader("value is truncated")
    header = bytes(blob[: _HEADER.size])
    magic, flags, bound, content_digest, size = _HEADER.unpack(header)
    if magic != SEAL_MAGIC:
        raise BadHeader("value is not a sealed lowercache entry")
    if flags & ~_KNOWN_FLAGS:
        raise BadHeader(f"value has unknown flags {flags:#04x}")
    body = memoryview(blob)[_HEADER.size :]
    if flags & _SIGNED:
        if len(body) < _MAC_LEN:
            raise BadHeader("value is truncated")
        mac, body = bytes(body[:_MAC_LEN]), body[_MAC_LEN:]
        if hmac_key and not hmac.compare_digest(mac, hmac.new(hmac_key, header + body, hashlib.sha256).digest()):
            raise BadSignature("signature does not match (another LOWERCACHE_HMAC_KEY, or altered bytes)")
    elif hmac_key:
        raise Unsigned("value is not signed but LOWERCACHE_HMAC_KEY is set")
    if expected_key_digest is not None and bound.hex() != expected_key_digest:
        raise WrongKey("value was written for another key")
    if size > max_size:
        raise EntryTooLarge(f"value would decompress to {size} bytes, over the {max_size}-byte cap")
    data = _decompress_at_most(body, size)
    if digest(data) != content_digest.hex():
        raise BadContent("content does not match its checksum")
    return data


def _decompress_at_most(frame: memoryview, size: int) -> bytes:
    """Decompress exactly ``size`` bytes, reading one more to catch a lying header."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(frame)
        chunks, got = [], 0
        while got <= size:
            chunk = reader.read(size + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except zstandard.ZstdError as e:
        raise BadContent(f"value does not decompress: {e}") from None
    if got != size:
        raise BadContent(f"value decompresses to {'more' if got > size else 'fewer'} bytes than its header says")
    return b"".join(chunks)




def hmac_key_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The signing key from ``LOWERCACHE_HMAC_KEY`` (its UTF-8 bytes), or None if unset or empty."""
    value = (os.environ if environ is None else environ).get(ENV_HMAC_KEY, "")
    return value.encode() if value else None

