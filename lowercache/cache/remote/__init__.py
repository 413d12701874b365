"""The shared remote tier: Redis or S3 behind the local store.

CI runners and teammates share lowered results through a remote store. The
remote is less trusted and less reliable than the local disk, so everything
here is built around two rules:

- **A remote can lie.** Values travel in a sealed form (:func:`.seal.seal`): zstd
  compressed, bound to the key they were written under, checksummed, and with
  ``LOWERCACHE_HMAC_KEY`` set, signed with HMAC-SHA256. :func:`.seal.unseal` refuses
  anything that fails a check, and caps the decompressed size so a small
  value cannot expand into gigabytes. Values are bytes and JSON only; nothing
  read from a remote is unpickled or executed. Without a key a remote is
  used only when signatures are not required (``LOWERCACHE_REMOTE_REQUIRE_SIGNED=0``),
  and a client never overwrites a value it has not read or that another key
  signed, so one misconfigured client cannot spoil what others read.
- **A remote can fail.** :class:`.guarded.Guarded` puts a deadline on every call; the
  first fault turns the remote off for the rest of the process with one
  warning, and the build goes on with the local cache alone.

One module per layer, bottom up: :mod:`.seal` (the wire format and its
signature), :mod:`.backend` (the raw-bytes interface), :mod:`.redis` and
:mod:`.s3` (one file per backend), :mod:`.guarded` (sealing, modes, fault
isolation, counters; a backend from a URL) and :mod:`.tiered` (a guarded
remote behind a local :class:`~lowercache.cache.store.Store`). This package
names their public parts in one place; ``cache/tiers.py`` opens the store a
setting names.
"""

from .backend import DEFAULT_PREFIX, DEFAULT_TIMEOUT, Remote
from .guarded import DEFAULT_DEADLINE, MODES, THREAD_PREFIX, WRONG_KEY_MIN_REFUSALS, Guarded, RemoteTimeout, connect, open_remote
from .redis import RedisRemote
from .s3 import ENV_S3_ENDPOINT, S3Remote
from .seal import (
    ENV_HMAC_KEY,
    ENV_REQUIRE_SIGNED,
    MAX_ENTRY_SIZE,
    SEAL_MAGIC,
    BadContent,
    BadHeader,
    BadSignature,
    EntryTooLarge,
    RefusedEntry,
    Unsigned,
    WrongKey,
    digest_key,
    hmac_key_from_env,
    seal,
    unseal,
)
from .tiered import SHARED_RECORDS, SUPERSEDED_KINDS, TieredStore

__all__ = [
    "BadContent", "BadHeader", "BadSignature", "DEFAULT_DEADLINE", "DEFAULT_PREFIX", "DEFAULT_TIMEOUT", "ENV_HMAC_KEY",
    "ENV_REQUIRE_SIGNED", "ENV_S3_ENDPOINT", "EntryTooLarge", "Guarded", "MAX_ENTRY_SIZE", "MODES", "RedisRemote", "RefusedEntry",
    "Remote", "RemoteTimeout", "S3Remote", "SEAL_MAGIC", "SHARED_RECORDS", "SUPERSEDED_KINDS", "THREAD_PREFIX", "TieredStore",
    "Unsigned", "WRONG_KEY_MIN_REFUSALS", "WrongKey", "connect", "digest_key", "hmac_key_from_env", "open_remote", "seal", "unseal",
]
