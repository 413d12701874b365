"""A really small disk: a tmpfs mounted for a test (root only; the test is skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root and a kernel that allows it (the simulated tests above still run)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
