"""The store a :class:`~lowercache.config.Settings` names: local, or local then a remote tier (imports no torch)."""

from __future__ import annotations

from ..config import Settings
from ..errors import LowercacheError
from .store import Store


def open_store(settings: Settings) -> Store | None:
    """The store the settings name (local, or local then remote), or None when caching is disabled."""
    if settings.disable:
        return None
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
