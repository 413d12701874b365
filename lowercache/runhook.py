"""``lowercache run``: cache an existing export script's Arm steps without editing it.

Like ccache in front of a compiler, ``lowercache run -- python export.py``
starts the script with ``lowercache/_run`` on PYTHONPATH. Its
``sitecustomize`` installs an import hook, so that when the script imports
ExecuTorch's Arm backend, the TOSA preprocess and Vela steps are wrapped and
record into one session for the process. Nothing is imported until the
script itself imports the Arm backend. The same ``sitecustomize`` starts the
command-level recorder (``replay.py``) that lets a later unchanged run be
replayed without running the script.
"""

from __future__ import annotations

import atexit
import importlib.abc
import logging
import os
import sys
from typing import Any

from .config import Settings
from .startup import HOOK_DIR


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
    from .client import check_speedups
    from .config import load_settings
    from .errors import LowercacheError
    from .replay import Command, run

    settings = load_settings(cache_dir=cache_dir, remote=remote, server=False if no_server else None)
    check_speedups(settings)  # an unknown name is the user's to fix, before anything runs
    try:
        code = run(Command(argv=list(argv), outs=list(outs)), settings, command_env(settings))
    except OSError as e:
        raise LowercacheError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell says it (Ctrl-C: 130)


_ARM = "executorch.backends.arm"


def _is_arm(name: str) -> bool:
    return name == _ARM or name.startswith(_ARM + ".")


def _arm_initializing(finished: str) -> bool:
    """Whether an Arm module other than ``finished`` is still executing (imported half way)."""
    return any(
        name != finished and _is_arm(name) and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls back once a watched module, and the Arm import it was part of, has finished executing.

    A hook module can finish while the Arm module that imported it is still
    executing (a script that imports ``tosa.partitioner`` first imports
    ``tosa.backend`` half way through it); installing then would import the
    half-made partitioner and fail the script. So every Arm module is
    followed while a watched one is outstanding, and the callback waits
    until no Arm module is half imported.
    """

    def __init__(self, watched: tuple[str, ...], callback: Any):
        self.watched = set(watched)
        self.pending: list[str] = []
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if not (self.watched or self.pending) or not _is_arm(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(module, _original=original_exec):
                    _original(module)
                    self._finished(module.__name__)

                loader.exec_module = exec_module
                return spec
        return None

    def _finished(self, name: str) -> None:
        if name in self.watched:
            self.watched.discard(name)
            self.pending.append(name)
        if self.pending and not _arm_initializing(name):
            ready, self.pending = self.pending, []
            for module_name in ready:
                try:
                    self.callback(module_name)
                except Exception as e:  # never fail the script's import because of the cache
                    logging.getLogger("lowercache").warning("caching is off for this process (%s)", e)
                    return


_session: list[Any] = []


def _process_session() -> Any:
    if not _session:
        from .api import open_store
        from .config import load_settings
        from .cache.steps import Session

        store = open_store(load_settings())
        session = Session(store)
        _session.append(session)
        if store is not None:
            atexit.register(store.close)
            atexit.register(session.flush_counts)
    return _session[0]


def activate_in_process() -> None:
    """Arrange for the Arm hook modules to be wrapped when (or if) they are imported."""
    from .lowering.hookpoints import HOOK_MODULES

    def on_import(name: str) -> None:
        from .lowering import arm
        from .cache import steps

        from .config import load_settings
        from .speedups import registry

        from .lowering import reexport

        registry.select(load_settings().speedups)
        steps.set_fallback(_process_session)
        arm.install_permanently(name)
        if not reexport.script_patch.originals:
            reexport.script_patch.enable()  # the script's own re-export after convert_pt2e, as a step

    already = [m for m in HOOK_MODULES if m in sys.modules]
    for name in already:
        on_import(name)
    sys.meta_path.insert(0, _AfterImport(tuple(m for m in HOOK_MODULES if m not in already), on_import))
