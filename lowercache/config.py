"""Settings: flags, then environment, then config file, then defaults.

Precedence, highest first (as in ccache and sccache):
1. command-line flags or API arguments;
2. environment variables ``LOWERCACHE_DIR``, ``LOWERCACHE_MAX_SIZE``,
   ``LOWERCACHE_DISABLE``, ``LOWERCACHE_READ_ONLY``, ``LOWERCACHE_REMOTE``,
   ``LOWERCACHE_REMOTE_MODE``, ``LOWERCACHE_REMOTE_TTL``,
   ``LOWERCACHE_REMOTE_REQUIRE_SIGNED``, ``LOWERCACHE_SPEEDUPS``,
   ``LOWERCACHE_DIRECT``, ``LOWERCACHE_PORTABLE_RECORDS``, ``LOWERCACHE_CHECK``, and the
   warm server's ``LOWERCACHE_SERVER``, ``LOWERCACHE_SERVER_IDLE_TIMEOUT``,
   ``LOWERCACHE_SERVER_JOBS``, ``LOWERCACHE_SERVER_TIMEOUT``, ``LOWERCACHE_SERVER_CONFIRM``;
3. the config file: ``$LOWERCACHE_CONFIG``, else ``config.toml`` in the
   platform's user config directory (platformdirs: on Linux
   ``$XDG_CONFIG_HOME/lowercache``, ``~/.config/lowercache``), with keys
   ``cache_dir``, ``max_size``, ``disable``, ``read_only``, ``remote``,
   ``remote_mode``, ``remote_ttl`` (Redis only), ``remote_require_signed``,
   ``speedups``, ``direct``, ``portable_records``, ``check``, ``server``, ``server_idle_timeout``, ``server_jobs``,
   ``server_timeout``, ``server_confirm``.

The remote's signing secret, ``LOWERCACHE_HMAC_KEY``, is read from the
environment only, never from a file lowercache reads or writes.
4. defaults: the platform's user cache directory (on Linux
   ``$XDG_CACHE_HOME/lowercache``, ``~/.cache/lowercache``), 5G.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from .errors import LowercacheError

DEFAULT_MAX_SIZE = 5 * 2**30
# The most seconds a timeout setting takes (about 31 years): beyond it a deadline overflows the clock's float.
MAX_SECONDS = 10**9

_ENV = {
    "cache_dir": "LOWERCACHE_DIR",
    "max_size": "LOWERCACHE_MAX_SIZE",
    "disable": "LOWERCACHE_DISABLE",
    "read_only": "LOWERCACHE_READ_ONLY",
    "remote": "LOWERCACHE_REMOTE",
    "remote_mode": "LOWERCACHE_REMOTE_MODE",
    "remote_ttl": "LOWERCACHE_REMOTE_TTL",
    "remote_require_signed": "LOWERCACHE_REMOTE_REQUIRE_SIGNED",
    "speedups": "LOWERCACHE_SPEEDUPS",
    "direct": "LOWERCACHE_DIRECT",
    "portable_records": "LOWERCACHE_PORTABLE_RECORDS",
    "server": "LOWERCACHE_SERVER",
    "server_idle_timeout": "LOWERCACHE_SERVER_IDLE_TIMEOUT",
    "server_jobs": "LOWERCACHE_SERVER_JOBS",
    "server_timeout": "LOWERCACHE_SERVER_TIMEOUT",
    "server_confirm": "LOWERCACHE_SERVER_CONFIRM",
    "run_ahead": "LOWERCACHE_RUN_AHEAD",
    "check": "LOWERCACHE_CHECK",
}
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass
class Settings:
    cache_dir: Path
    max_size: int = DEFAULT_MAX_SIZE
    disable: bool = False
    read_only: bool = False
    remote: str | None = None  # redis://host:port/db or s3://bucket/prefix
    remote_mode: str = "read-write"  # read-only for untrusted jobs; write-only to refresh
    remote_ttl: int | None = None  # seconds a Redis entry lives (refreshed on every write)
    # Without LOWERCACHE_HMAC_KEY the remote is off unless this is false: unsigned use is a choice.
    remote_require_signed: bool = True
    speedups: str = "all"  # exact speed-ups to use: all, none, a,b or all,-a (lowercache.speedups.registry)
    direct: bool = True  # answer an unchanged `lower` from its direct-mode record, without torch (lowercache.direct)
    # A record answers in another directory once confirmed where it was made, not only once confirmed in a second one:
    # the user vouches that the lowering does not depend on where the project is (record/trust.py, ``elsewhere``).
    portable_records: bool = False
    # The warm server (lowercache.server): lower and verify go through it unless this is false.
    server: bool = True
    server_idle_timeout: int = 600  # seconds without a request before the server exits
    server_jobs: int = 0  # requests lowered at once, the rest queued; 0: the core count
    server_timeout: int = 3600  # seconds one request may run before its process is killed; 0: no limit
    # An idle server confirms the direct-mode records its requests made (server/loop.py); false: the next run does.
    server_confirm: bool = True
    # lowercache run: a copy of the script goes on non-strictly from its first strict export (run/ahead.py).
    run_ahead: bool = True
    check: str = ""  # lower: the numerics check after each lowering: "", "outputs" or "layers" (lowering/check/numerics.py, docs/numerics.md)
    origin: dict[str, str] = field(default_factory=dict)  # where each value came from


def parse_size(text: str | int) -> int:
    """``"5G"``, ``"500M"``, ``"1048576"`` -> bytes (binary units, as ccache)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if not m:
        raise LowercacheError(f"bad size {text!r}; use a number with an optional K, M, G or T suffix")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_bool(text: str | bool, name: str) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise LowercacheError(f"bad value {text!r} for {name}; use true or false")


def parse_check(value: str | bool | None, name: str) -> str:
    """The numerics check's mode: "" (off), "outputs" (true, 1, yes, on) or "layers" (outputs and per layer)."""
    if value is None or isinstance(value, bool):
        return "outputs" if value else ""
    text = str(value).strip().lower()
    if text in ("outputs", "layers"):
        return text
    try:
        return "outputs" if parse_bool(text, name) else ""
    except LowercacheError:
        raise LowercacheError(f"bad value {value!r} for {name}; use outputs or layers (or true, false)") from None


def check_with_min_snr(check: str, min_snr: object) -> str:
    """The check a run makes: a minimum SNR needs the outputs' SNRs, so it implies the outputs check."""
    return check or ("outputs" if min_snr is not None else "")


def config_path() -> Path:
    explicit = os.environ.get("LOWERCACHE_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    return platformdirs.user_config_path("lowercache", appauthor=False) / "config.toml"


def default_cache_dir() -> Path:
    """The platform's per-user cache directory (``~/.cache/lowercache`` on Linux, honouring ``XDG_CACHE_HOME``)."""
    return platformdirs.user_cache_path("lowercache", appauthor=False)


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    import tomllib  # only when there is a file: its import compiles regular expressions a direct-mode hit need not pay

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LowercacheError(f"cannot read config file {path}: {e}") from None
    unknown = set(data) - set(_ENV)
    if unknown:
        raise LowercacheError(f"unknown key(s) {', '.join(sorted(unknown))} in config file {path}")
    return data


def load_settings(**flags: Any) -> Settings:
    """Resolve every setting; ``flags`` with value None fall through to the next source."""
    path = config_path()
    file_values = _read_config_file(path)
    resolved: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, env in _ENV.items():
        if flags.get(name) is not None:
            resolved[name], origin[name] = flags[name], "flag"
        elif os.environ.get(env):
            resolved[name], origin[name] = os.environ[env], f"env {env}"
        elif name in file_values:
            resolved[name], origin[name] = file_values[name], f"file {path}"
        else:
            origin[name] = "default"
    return Settings(
        cache_dir=Path(resolved.get("cache_dir") or default_cache_dir()).expanduser(),
        max_size=parse_size(resolved.get("max_size", DEFAULT_MAX_SIZE)),
        disable=parse_bool(resolved.get("disable", False), "disable"),
        read_only=parse_bool(resolved.get("read_only", False), "read_only"),
        remote=str(resolved["remote"]) if resolved.get("remote") else None,
        remote_mode=_remote_mode(resolved.get("remote_mode", "read-write")),
        remote_ttl=_seconds(resolved.get("remote_ttl")),
        remote_require_signed=parse_bool(resolved.get("remote_require_signed", True), "remote_require_signed"),
        speedups=str(resolved.get("speedups", "all")),
        direct=parse_bool(resolved.get("direct", True), "direct"),
        portable_records=parse_bool(resolved.get("portable_records", False), "portable_records"),
        server=parse_bool(resolved.get("server", True), "server"),
        server_idle_timeout=_seconds_setting(resolved.get("server_idle_timeout", 600), "server_idle_timeout"),
        server_jobs=_whole(resolved.get("server_jobs", 0), "server_jobs") or os.cpu_count() or 1,
        server_timeout=_seconds_setting(resolved.get("server_timeout", 3600), "server_timeout"),
        server_confirm=parse_bool(resolved.get("server_confirm", True), "server_confirm"),
        run_ahead=parse_bool(resolved.get("run_ahead", True), "run_ahead"),
        check=parse_check(resolved.get("check", False), "check"),
        origin=origin,
    )


def _seconds(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LowercacheError(f"bad remote TTL {value!r}; use a whole number of seconds") from None


def _whole(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise LowercacheError(f"bad value {value!r} for {name}; use a whole number, 0 or more")
    return number


def _seconds_setting(value: Any, name: str) -> int:
    """A timeout in whole seconds, bounded: a huge one would overflow the server's deadline arithmetic."""
    number = _whole(value, name)
    if number > MAX_SECONDS:
        raise LowercacheError(f"bad value {value!r} for {name}; use a whole number of seconds from 0 to {MAX_SECONDS}")
    return number


def _remote_mode(value: str) -> str:
    modes = ("read-write", "read-only", "write-only")
    if value not in modes:
        raise LowercacheError(f"bad remote mode {value!r}; use one of {', '.join(modes)}")
    return value


def describe(settings: Settings) -> list[tuple[str, str, str]]:
    """``(name, value, origin)`` for every setting, values as a person reads them (sizes in binary units)."""
    rows = []
    for name in _ENV:
        value = getattr(settings, name)
        if name == "max_size":
            shown = format_size(value)
        elif value is None or value == "":
            shown = "-"
        else:
            shown = str(value).lower() if isinstance(value, bool) else str(value)
        rows.append((name, shown, settings.origin.get(name, "default")))
    return rows


def format_size(size: int) -> str:
    """Bytes as ``5G``, ``512M``, ``1.5G``: the form ``parse_size`` reads back."""
    for unit in ("T", "G", "M", "K"):
        scale = _UNITS[unit.lower()]
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + unit
    return str(size)
