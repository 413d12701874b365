"""The CLI in a subprocess, and stock's bytes for the bundled tiny example."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from . import ROOT
from .oracle import stock_pte

TINY = f"{ROOT}/examples/tiny_cnn.py:model"


def cli(*args, cache_dir, cwd=None, env=None):
    full_env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=900,
    )


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("lowercache: error:")]


def warnings_of(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("lowercache: warning:")]


def stock_tiny(target):
    """Stock bytes of examples/tiny_cnn.py (its own module, not models.tiny_cnn)."""
    return stock_tiny_with(target)


def stock_tiny_with(target, **vela_options):
    """Stock bytes of examples/tiny_cnn.py with EthosUCompileSpec's Vela options."""
    spec = importlib.util.spec_from_file_location("tiny_example", ROOT / "examples" / "tiny_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net, example = module.model()
    return stock_pte(net, example, target, **vela_options)

