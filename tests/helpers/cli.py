"""The CLI in a subprocess, and stock's bytes for the bundled tiny example."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from lowercache import environment

from . import ROOT, direct
from .oracle import stock_pte

TINY = f"{ROOT}/examples/tiny_cnn.py:model"


def cli(*args, cache_dir, cwd=None, env=None):
    """The CLI in a new process with the test's environment, its cache directory and ``env`` (``command_env``)."""
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=command_env({"LOWERCACHE_DIR": str(cache_dir), **(env or {})}),
        timeout=900,
    )


def command_env(env: dict[str, str]) -> dict[str, str]:
    """A CLI process's environment: the test's, then ``env``. Through the worker's warm server when the module opts in
    (``through_server``), ``env`` holds only lowercache's settings and names the cache directory (the worker's default
    one is shared), and the test changed no variable a server's start-up took in: its ``lower`` and ``verify`` then
    cost a fork, as a user's do (``helpers/direct.py``)."""
    via = direct.server_env(env)
    if via and "LOWERCACHE_DIR" in env and not _changed_by_test():
        return direct.cli_env(Path(env["LOWERCACHE_DIR"]), {**via, **env})
    return {**os.environ, **env}


def _changed_by_test() -> list[str]:
    """The variables a process takes in that differ from the worker's start, but for lowercache's own and the default
    cache's (``cli_env`` sets both) and those torch sets when this process exports (``TORCHINDUCTOR_CACHE_DIR``)."""
    now, start = environment.inputs(os.environ), environment.inputs(direct.BASE_ENV)
    return [name for name in {*now, *start} - {"XDG_CACHE_HOME"}
            if now.get(name) != start.get(name) and not name.startswith("TORCHINDUCTOR_")]


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("lowercache: error:")]


def warnings_of(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("lowercache: warning:")]


def stock_tiny(target):
    """Stock bytes of examples/tiny_cnn.py (its own module, not models.tiny_cnn)."""
    return stock_tiny_with(target)


def stock_tiny_with(target, **vela_options):
    """Stock bytes of examples/tiny_cnn.py with EthosUCompileSpec's Vela options."""
    return stock_of_file(ROOT / "examples" / "tiny_cnn.py", "model", target, "tiny_example", **vela_options)


def stock_of_file(path, factory, target, module_name, **vela_options):
    """Stock bytes of the model ``factory`` in the file ``path`` makes, the file loaded as ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net, example = getattr(module, factory)()
    return stock_pte(net, example, target, **vela_options)

