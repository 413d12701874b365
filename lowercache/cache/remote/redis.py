"""The Redis backend (or any Redis-compatible server): ``redis://`` and ``rediss://`` URLs."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from ...errors import LowercacheError
from .backend import DEFAULT_PREFIX, DEFAULT_TIMEOUT, Remote, import_client, redact


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
        redis = import_client("redis", "a redis:// remote")
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.name = redact(url)
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
        raise LowercacheError(f"bad remote URL {redact(url)!r}: {problem}; use redis://host:port/db")
