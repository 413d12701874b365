"""The only way lowercache talks to a remote: sealed, bounded by a deadline, and off at the first fault.

A remote can fail: the first fault turns it off for the rest of the process
with one warning, and the build goes on with the local cache alone.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from ...errors import LowercacheError
from ..records import CorruptEntry
from .backend import Remote, redact
from .redis import RedisRemote
from .s3 import S3Remote
from .seal import ENV_HMAC_KEY, ENV_REQUIRE_SIGNED, MAX_ENTRY_SIZE, BadSignature, RefusedEntry, Unsigned, digest_key, seal, unseal

# Every call to a remote runs in a thread named so: its network use is the cache's own (direct mode and run's recorder tell it apart).
THREAD_PREFIX = "lowercache-remote "
log = logging.getLogger("lowercache")

DEFAULT_DEADLINE = 60.0
"""Seconds a whole remote call may take. A backstop for what socket timeouts
miss (a DNS lookup, a server that drips one byte at a time); generous so that
a large upload on a slow link is not cut short."""

MODES = ("read-write", "read-only", "write-only")

T = TypeVar("T")


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
            f"unsupported remote URL {redact(str(url))!r}; use redis://host:port/db or s3://bucket/prefix"
        )
    unknown = set(options) - set(inspect.signature(backend).parameters)
    if unknown:
        raise LowercacheError(f"{scheme}:// remotes take no option(s) {', '.join(sorted(unknown))}")
    return backend(url, **options)


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


