"""``lowercache run -- CMD``: start the command with the hook on its path, or replay it (the client side, no torch).

Like ccache in front of a compiler, ``lowercache run -- python export.py``
starts the script with ``lowercache/run/_site`` on PYTHONPATH, whose
``sitecustomize`` records the process and caches its lowering steps
(``run/hook.py``); an unchanged command is replayed from its record
(``run/replay.py``) without running it.
"""

from __future__ import annotations

import os

from ..config import Settings
from ..startup import HOOK_DIR


def command_env(settings: Settings) -> dict[str, str]:
    """The environment for the wrapped command: hook on the path, settings pinned."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HOOK_DIR, env.get("PYTHONPATH", "")) if p)
    env["LOWERCACHE_RUN"] = "1"
    env["LOWERCACHE_DIR"] = str(settings.cache_dir)
    env["LOWERCACHE_MAX_SIZE"] = str(settings.max_size)
    env["LOWERCACHE_DISABLE"] = "1" if settings.disable else "0"
    env["LOWERCACHE_READ_ONLY"] = "1" if settings.read_only else "0"
    env["LOWERCACHE_REMOTE_MODE"] = settings.remote_mode
    env["LOWERCACHE_REMOTE_REQUIRE_SIGNED"] = "1" if settings.remote_require_signed else "0"
    env["LOWERCACHE_SPEEDUPS"] = settings.speedups
    if settings.remote:
        env["LOWERCACHE_REMOTE"] = settings.remote
    if settings.remote_ttl:
        env["LOWERCACHE_REMOTE_TTL"] = str(settings.remote_ttl)
    return env


def run_command(argv: list[str], outs: list[str], cache_dir: str | None = None, remote: str | None = None,
                no_server: bool = False) -> int:
    """``lowercache run -- ARGV``: the command's exit code; for the CLI's ``run`` and its light path alike.

    LowercacheError names what is wrong with the settings, or a command that cannot start.
    """
    from ..client import check_speedups
    from ..config import load_settings
    from ..errors import LowercacheError
    from .replay import Command, run

    settings = load_settings(cache_dir=cache_dir, remote=remote, server=False if no_server else None)
    check_speedups(settings)  # an unknown name is the user's to fix, before anything runs
    try:
        code = run(Command(argv=list(argv), outs=list(outs)), settings, command_env(settings))
    except OSError as e:
        raise LowercacheError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell says it (Ctrl-C: 130)
