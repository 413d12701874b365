"""Each test's own settings: no developer config file, cache, remote or server (``conftest.py`` applies them per test;
a module's fixture, which runs before them, applies them itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

CLEARED = (
    "LOWERCACHE_DIR",
    "LOWERCACHE_MAX_SIZE",
    "LOWERCACHE_DISABLE",
    "LOWERCACHE_READ_ONLY",
    "LOWERCACHE_REMOTE",
    "LOWERCACHE_REMOTE_MODE",
    "LOWERCACHE_REMOTE_TTL",
    "LOWERCACHE_REMOTE_REQUIRE_SIGNED",
    "LOWERCACHE_HMAC_KEY",
    "LOWERCACHE_S3_ENDPOINT",
    "LOWERCACHE_SPEEDUPS",
    "LOWERCACHE_CHECK",
)


def isolate(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Settings of a test's own below ``root``: the variables a user may have set are cleared."""
    for var in CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOWERCACHE_CONFIG", str(root / "no-config.toml"))
    monkeypatch.setenv("LOWERCACHE_SERVER", "0")  # each test runs in its own processes; tests/process/test_server.py starts servers
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "xdg-cache"))
