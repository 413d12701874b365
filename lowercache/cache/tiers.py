"""The store a :class:`~lowercache.config.Settings` names: local, or local then a remote tier (imports no torch)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..config import Settings
from ..errors import LowercacheError
from .store import Store

_held: list[tuple[Settings, Any]] = []  # stores opened by :func:`held`, innermost last


@contextlib.contextmanager
def held(settings: Settings) -> Iterator[None]:
    """Open the store once for a command whose parts each open it (the lowering, then its record): within, ``open_store``
    of equal settings lends that store, and closing it is left to the end. Opening costs a probe write and two
    databases, and in a recording process each of their system calls stops for the backstop's tracer."""
    store = open_store(settings)
    _held.append((settings, store))
    try:
        yield
    finally:
        _held.pop()
        if store is not None:
            store.close()


class _Lent:
    """A held store as :func:`open_store` lends it: all of it but ``close``, which :func:`held` does."""

    def __init__(self, store: Any):
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def close(self) -> None:
        pass


def open_store(settings: Settings) -> Store | None:
    """The store the settings name (local, or local then remote), or None when caching is disabled."""
    if settings.disable:
        return None
    for holding, store in reversed(_held):
        if holding == settings and store is not None:
            return _Lent(store)  # type: ignore[return-value]
    local = Store(settings.cache_dir, max_size=settings.max_size, read_only=settings.read_only)
    if not settings.remote:
        return local
    from .remote import TieredStore, connect, hmac_key_from_env

    mode = settings.remote_mode
    if settings.read_only:  # read-only means every tier, as in ccache
        if mode == "write-only":
            return local  # a remote that may be neither read nor written
        mode = "read-only"
    try:
        ttl = {"ttl_seconds": settings.remote_ttl} if settings.remote_ttl else {}
        remote = connect(
            settings.remote,
            mode=mode,
            hmac_key=hmac_key_from_env(),
            require_signed=settings.remote_require_signed,
            **ttl,
        )
    except LowercacheError:
        local.close()
        raise
    return TieredStore(local, remote)
