"""The shared remote tier: Redis or S3 behind the local store.

CI runners and teammates share lowered results through a remote store. The
remote is less trusted and less reliable than the local disk, so everything
here is built around two rules:

- **A remote can lie.** Values travel in a sealed form (:func:`seal`): zstd
  compressed, bound to the key they were written under, checksummed, and with
  ``LOWERCACHE_HMAC_KEY`` set, signed with HMAC-SHA256. :func:`unseal` refuses
  anything that fails a check, and caps the decompressed size so a small
  value cannot expand into gigabytes. Values are bytes and JSON only; nothing
  read from a remote is unpickled or executed. Without a key a remote is
  used only when signatures are not required (``LOWERCACHE_REMOTE_REQUIRE_SIGNED=0``),
  and a client never overwrites a value it has not read or that another key
  signed, so one misconfigured client cannot spoil what others read.
- **A remote can fail.** :class:`Guarded` puts a deadline on every call; the
  first fault turns the remote off for the rest of the process with one
  warning, and the build goes on with the local cache alone.

Layers, bottom up: :class:`Remote` moves raw bytes (:class:`RedisRemote`,
:class:`S3Remote`, made by :func:`open_remote` from a URL); :class:`Guarded`
adds sealing, modes, fault isolation and counters; :class:`TieredStore` puts a
guarded remote behind a local :class:`~lowercache.cache.store.Store`.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import struct
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import zstandard

from ..errors import LowercacheError
from .digests import digest
from .records import ActionRecord, CorruptEntry, Entry, parse
from .store import Store

# Every call to a remote runs in a thread named so: its network use is the cache's own (direct mode and run's recorder tell it apart).
THREAD_PREFIX = "lowercache-remote "
log = logging.getLogger("lowercache")

ENV_REMOTE = "LOWERCACHE_REMOTE"
ENV_HMAC_KEY = "LOWERCACHE_HMAC_KEY"
ENV_REQUIRE_SIGNED = "LOWERCACHE_REMOTE_REQUIRE_SIGNED"
ENV_S3_ENDPOINT = "LOWERCACHE_S3_ENDPOINT"

DEFAULT_PREFIX = "lowercache/"
DEFAULT_TIMEOUT = 5.0
"""Seconds a remote may take to connect, or to send the next bytes of a reply."""
DEFAULT_DEADLINE = 60.0
"""Seconds a whole remote call may take. A backstop for what socket timeouts
miss (a DNS lookup, a server that drips one byte at a time); generous so that
a large upload on a slow link is not cut short."""

MAX_ENTRY_SIZE = 2 * 2**30
"""Largest value :func:`unseal` will decompress, against zip bombs."""

MODES = ("read-write", "read-only", "write-only")

T = TypeVar("T")


# -- wire format ---------------------------------------------------------------

SEAL_MAGIC = b"LCR1"
_SIGNED = 0x01
_KNOWN_FLAGS = _SIGNED
_HEADER = struct.Struct(">4sB16s16sQ")  # magic, flags, key digest, content digest, size
_MAC_LEN = hashlib.sha256().digest_size
_UNBOUND = bytes(16)
_ZSTD_LEVEL = 3
# zstd can grow incompressible input a little; a value bigger than this cannot
# be a sealed entry that passes the size cap, so it is refused unread.
_MAX_WIRE_SIZE = MAX_ENTRY_SIZE + MAX_ENTRY_SIZE // 64 + _HEADER.size + _MAC_LEN


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


# -- backends --------------------------------------------------------------------


class Remote(ABC):
    """A remote key-value store of raw bytes.

    Backends do no checking and no error handling: they raise on any fault and
    leave the policy to :class:`Guarded`. Keys are lowercache's own
    (``action/<kind>/<hex>``, ``blob/<hex>``); a backend files them under its
    prefix.
    """

    name: str
    max_value_size: int = _MAX_WIRE_SIZE
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


class RedisRemote(Remote):
    """Redis (or a Redis-compatible server), with an optional TTL on every write.

    Retries are off: a fault should turn the remote off at once rather than
    stall the build through a backoff schedule.
    """

    max_value_size = 512 * 2**20  # Redis's default proto-max-bulk-len

    def __init__(
        self,
        url: str,
        ttl_seconds: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        prefix: str = DEFAULT_PREFIX,
    ):
        _parse_redis_url(url)
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds <= 0):
            raise LowercacheError(f"bad remote TTL {ttl_seconds!r}; use a whole number of seconds above 0")
        redis = _import("redis", "a redis:// remote")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.name = _redact(url)
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except ValueError as e:
            raise LowercacheError(f"bad remote URL {self.name}: {e}") from None

    def get(self, key: str) -> bytes | None:
        return self._client.get(self.prefix + key)

    def put(self, key: str, data: bytes) -> None:
        self._client.set(self.prefix + key, data, ex=self.ttl_seconds)

    def add(self, key: str, data: bytes) -> bool:
        """``SET NX``; a value already there gets its TTL renewed, as a write would."""
        if self._client.set(self.prefix + key, data, ex=self.ttl_seconds, nx=True):
            return True
        if self.ttl_seconds is not None:
            self._client.expire(self.prefix + key, self.ttl_seconds)
        return False

    def close(self) -> None:
        self._client.close()


class S3Remote(Remote):
    """An S3 bucket, or any S3-compatible store (MinIO, Ceph, moto).

    The endpoint comes from ``endpoint_url``, else ``LOWERCACHE_S3_ENDPOINT``,
    else boto3's own settings (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
    config files); credentials and region come from boto3's usual chain. S3
    has no per-object TTL: expire old entries with a bucket lifecycle rule.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, endpoint_url: str | None = None):
        self.bucket, self.prefix = _parse_s3_url(url)
        self.name = f"s3://{self.bucket}/{self.prefix}"
        boto3 = _import("boto3", "an s3:// remote")
        from botocore.config import Config

        endpoint_url = endpoint_url or os.environ.get(ENV_S3_ENDPOINT) or None
        config = Config(
            connect_timeout=timeout,
            read_timeout=timeout,
            retries={"total_max_attempts": 1},
            # Custom endpoints are usually one host without per-bucket DNS names.
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        try:
            self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        except Exception as e:  # botocore raises many types for bad settings
            raise LowercacheError(f"cannot set up remote {self.name}: {e}") from None
        self._conditional = True  # until the store says it has no conditional writes

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            if length is not None and length > self.max_value_size:
                raise EntryTooLarge(f"object is {length} bytes, too large to be an entry")
            return body.read()
        finally:
            body.close()

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def add(self, key: str, data: bytes) -> bool:
        """A conditional write (``If-None-Match: *``); a HEAD first on stores without one."""
        from botocore.exceptions import ClientError

        if self._conditional:
            try:
                self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                    return False
                if code not in ("NotImplemented", "501"):
                    raise
                self._conditional = False
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return False
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404", "NotFound"):
                raise
        self.put(key, data)
        return True

    def close(self) -> None:
        self._client.close()


def open_remote(url: str, **options: Any) -> Remote:
    """The backend for ``url``: ``redis://[user:pass@]host[:port][/db]``, ``rediss://...``
    (TLS), or ``s3://bucket[/prefix]``.

    ``options`` go to the backend; those set to None are dropped so callers
    can pass unset settings straight through. A malformed or unsupported URL,
    or an option the backend lacks, is a :class:`LowercacheError`.
    """
    options = {k: v for k, v in options.items() if v is not None}
    scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    backends: dict[str, type[Remote]] = {"redis": RedisRemote, "rediss": RedisRemote, "s3": S3Remote}
    backend = backends.get(scheme)
    if backend is None:
        raise LowercacheError(
            f"unsupported remote URL {_redact(str(url))!r}; use redis://host:port/db or s3://bucket/prefix"
        )
    unknown = set(options) - set(inspect.signature(backend).parameters)
    if unknown:
        raise LowercacheError(f"{scheme}:// remotes take no option(s) {', '.join(sorted(unknown))}")
    return backend(url, **options)


def _parse_redis_url(url: str) -> None:
    """Reject what redis-py would misread or only fail on at the first call."""
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    problem = None
    if not parts.hostname:
        problem = "no host"
    elif not port_ok:
        problem = "a bad port"
    elif not re.fullmatch(r"/?|/\d+", parts.path):
        problem = "a database that is not a number"
    if problem:
        raise LowercacheError(f"bad remote URL {_redact(url)!r}: {problem}; use redis://host:port/db")


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def _parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)``; the prefix ends with ``/`` and defaults to ``lowercache/``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or parts.query or parts.fragment or "@" in parts.netloc or ":" in parts.netloc:
        raise LowercacheError(f"bad remote URL {_redact(url)!r}; use s3://bucket/prefix")
    if not _BUCKET.fullmatch(parts.netloc):
        raise LowercacheError(f"bad remote URL {_redact(url)!r}: {parts.netloc!r} is not an S3 bucket name")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else DEFAULT_PREFIX


def _redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return parts._replace(netloc=user + netloc).geturl()


def _import(module: str, purpose: str) -> Any:
    """Import a backend's client library only when that backend is used."""
    try:
        return __import__(module)
    except ImportError:
        raise LowercacheError(f"{purpose} needs the Python package {module!r}; pip install {module}") from None


def hmac_key_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The signing key from ``LOWERCACHE_HMAC_KEY`` (its UTF-8 bytes), or None if unset or empty."""
    value = (os.environ if environ is None else environ).get(ENV_HMAC_KEY, "")
    return value.encode() if value else None


# -- fault isolation, sealing, modes -----------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise LowercacheError(f"bad remote mode {mode!r}; use one of {', '.join(MODES)}")


class RemoteTimeout(TimeoutError):
    """A remote call passed its deadline."""


_MAX_REFUSAL_WARNINGS = 10

WRONG_KEY_MIN_REFUSALS = 3
"""Signature mismatches before a client may conclude that its own key is wrong
(and more mismatches than verified reads are needed too): one or two altered
entries are tampering, most of them is another key."""


class Guarded:
    """The only way lowercache talks to a remote: sealed, bounded, and fail-safe.

    - ``put`` seals (compress, bind to key, sign); ``get`` unseals and returns
      None, with a warning, for a value that fails a check.
    - ``mode``: ``read-write``; ``read-only`` for untrusted jobs (never
      writes); ``write-only`` to refresh entries (never reads).
    - The first fault (error, timeout, deadline) turns the remote off for the
      rest of the process and logs one warning; from then on calls return at
      once. A bad value is not a fault: it is refused and the remote stays on.
    - ``require_signed`` without a key turns the remote off at its first use,
      with one warning: nothing read from it could be checked. Without a key
      and without ``require_signed``, the first value used unchecked is
      reported once.
    - A key others' entries keep failing (:data:`WRONG_KEY_MIN_REFUSALS`
      signature mismatches, more than the entries it verified) is probably
      wrong: the client stops writing, says so once, and reads on.
    - Outside ``write-only`` mode a write never replaces a value this client
      has not read, nor one whose signature did not match (both may be valid
      under another key); it replaces values it verified or found damaged in
      a way no key explains. ``write-only`` replaces everything (a refresh).

    Counters: ``hits``, ``misses``, ``writes``, ``bytes_read`` and
    ``bytes_written`` (wire bytes), ``errors`` (faults and refused values),
    ``refused`` (refused values only), ``mismatched`` (refused for a
    signature that does not match), ``verified`` (hits whose signature was checked).
    """

    def __init__(
        self,
        remote: Remote,
        mode: str = "read-write",
        hmac_key: bytes | None = None,
        deadline: float = DEFAULT_DEADLINE,
        max_entry_size: int = MAX_ENTRY_SIZE,
        require_signed: bool = False,
    ):
        _check_mode(mode)
        self.remote = remote
        self.mode = mode
        self.hmac_key = hmac_key or None
        self.require_signed = require_signed
        self.deadline = deadline
        self.max_entry_size = max_entry_size
        self.off = False
        self.off_reason: str | None = None
        self.key_probably_wrong = False
        self.hits = self.misses = self.writes = 0
        self.bytes_read = self.bytes_written = 0
        self.errors = self.refused = 0
        self.mismatched = self.verified = 0
        self._replaceable: set[str] = set()  # keys read this run whose value may be overwritten
        self._foreign: set[str] = set()  # keys whose signature did not match: never overwritten
        self._warned_unsigned = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.remote.name

    @property
    def can_read(self) -> bool:
        return not self.off and self.mode != "write-only"

    @property
    def can_write(self) -> bool:
        return not self.off and self.mode != "read-only" and not self.key_probably_wrong

    def get(self, key: str) -> bytes | None:
        """The data stored for ``key``, or None on a miss, a refused value, or a fault."""
        self._check_keyed()
        if not self.can_read:
            return None
        try:
            blob = self._call(f"get {key}", self.remote.get, key)
        except RefusedEntry as e:
            self._refuse(key, e)
            return None
        except Exception as e:
            self._turn_off(e)
            return None
        if blob is None:
            self._count(misses=1)
            return None
        try:
            data = unseal(blob, self.hmac_key, digest_key(key), self.max_entry_size)
        except RefusedEntry as e:
            self._refuse(key, e)
            return None
        with self._lock:
            self._replaceable.add(key)
            first_unchecked = self.hmac_key is None and not self._warned_unsigned
            self._warned_unsigned = self._warned_unsigned or first_unchecked
        if first_unchecked:
            log.warning(
                "using entries from remote %s unchecked: %s is not set, so whoever can write to the remote "
                "can change what this build produces",
                self.name,
                ENV_HMAC_KEY,
            )
        self._count(hits=1, bytes_read=len(blob), verified=1 if self.hmac_key else 0)
        return data

    def put(self, key: str, data: bytes) -> bool:
        """Seal and store ``data``; False when not stored (mode, off, too large, fault, another key's value).

        True also when a value this client may not replace is already there.
        """
        self._check_keyed()
        if not self.can_write:
            return False
        if key in self._foreign:
            log.debug("not writing %s to remote %s: it holds a value signed with another key", key, self.name)
            return False
        blob = seal(data, self.hmac_key, digest_key(key))
        if len(blob) > self.remote.max_value_size:
            log.debug("not writing %s to remote %s: %d bytes is over its limit", key, self.name, len(blob))
            return False
        replace = self.mode == "write-only" or key in self._replaceable
        try:
            if replace:
                self._call(f"put {key}", self.remote.put, key, blob)
            elif not self._call(f"add {key}", self.remote.add, key, blob):
                return True  # a value is there already; not ours to replace
        except Exception as e:
            self._turn_off(e)
            return False
        self._count(writes=1, bytes_written=len(blob))
        return True

    def refuse(self, key: str, error: CorruptEntry) -> None:
        """Count a value that unsealed but whose content failed a check above the seal (a malformed
        record) as refused rather than a hit: one warning, a miss, and replaceable by a recomputed value."""
        with self._lock:
            self.hits -= 1
            self.verified -= 1 if self.hmac_key else 0
        self._refuse(key, error if isinstance(error, RefusedEntry) else RefusedEntry(str(error)))

    def stats(self) -> dict[str, Any]:
        """Counters and state, for ``lowercache stats`` and run records."""
        return {
            "name": self.name,
            "mode": self.mode,
            "off": self.off,
            "off_reason": self.off_reason,
            "signed": self.hmac_key is not None,
            "require_signed": self.require_signed,
            "key_probably_wrong": self.key_probably_wrong,
            "hits": self.hits,
            "misses": self.misses,
            "writes": self.writes,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "errors": self.errors,
            "refused": self.refused,
            "mismatched": self.mismatched,
            "verified": self.verified,
        }

    def close(self) -> None:
        """Release the backend's connections, bounded like any other call."""
        try:
            self._call("close", self.remote.close)
        except Exception as e:
            log.debug("closing remote %s failed: %s", self.name, e)

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in a daemon thread and wait at most ``deadline`` seconds.

        A daemon thread, not an executor: a call stuck past its deadline must
        not keep the interpreter from exiting. Once a call times out the
        remote is off, so at most one thread is ever left behind.
        """
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = fn(*args)
            except Exception as e:
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"{THREAD_PREFIX}{what}", daemon=True).start()
        if not done.wait(self.deadline):
            raise RemoteTimeout(f"{what} took over {self.deadline:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _check_keyed(self) -> None:
        """Turn the remote off, at its first use, when signatures are required and there is no key.

        At first use rather than at construction, so that opening a store
        only to check the settings warns nothing.
        """
        if self.require_signed and self.hmac_key is None and not self.off:
            self._switch_off(
                f"signatures are required but {ENV_HMAC_KEY} is not set, so its entries cannot be checked "
                f"(set the key, or {ENV_REQUIRE_SIGNED}=0 to use the remote unsigned)"
            )

    def _turn_off(self, error: Exception) -> None:
        self._switch_off(" ".join(f"{type(error).__name__}: {error}".split())[:300].rstrip("."))

    def _switch_off(self, reason: str) -> None:
        with self._lock:
            self.errors += 1
            if self.off:
                return
            self.off, self.off_reason = True, reason
        log.warning("remote %s is off: %s; continuing with the local cache", self.name, reason)

    def _refuse(self, key: str, error: RefusedEntry) -> None:
        mismatch = isinstance(error, BadSignature) and not isinstance(error, Unsigned)
        with self._lock:
            self.errors += 1
            self.refused += 1
            self.misses += 1
            count = self.refused
            if mismatch:
                self.mismatched += 1
                self._foreign.add(key)
            else:
                self._replaceable.add(key)  # damage no key explains: a recomputed value may heal it
            suspect = (
                mismatch
                and not self.key_probably_wrong
                and self.mismatched >= WRONG_KEY_MIN_REFUSALS
                and self.mismatched > self.verified
            )
            self.key_probably_wrong = self.key_probably_wrong or suspect
        if count <= _MAX_REFUSAL_WARNINGS:
            log.warning("ignoring remote entry %s from %s: %s", key, self.name, error)
        if count == _MAX_REFUSAL_WARNINGS:
            log.warning("further refused entries from %s are counted but not reported", self.name)
        if suspect:
            log.warning(
                "%s is probably wrong for remote %s: %d of %d signed entries read failed their signature check; "
                "not writing to it for the rest of this run",
                ENV_HMAC_KEY,
                self.name,
                self.mismatched,
                self.mismatched + self.verified,
            )

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for counter, amount in amounts.items():
                setattr(self, counter, getattr(self, counter) + amount)


def connect(
    url: str,
    mode: str = "read-write",
    hmac_key: bytes | None = None,
    deadline: float = DEFAULT_DEADLINE,
    require_signed: bool = False,
    **options: Any,
) -> Guarded:
    """``Guarded(open_remote(url, **options), ...)``: the usual way to get a remote."""
    _check_mode(mode)
    return Guarded(open_remote(url, **options), mode=mode, hmac_key=hmac_key, deadline=deadline, require_signed=require_signed)


# -- the tiered store ----------------------------------------------------------------

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
