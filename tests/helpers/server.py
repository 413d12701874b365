"""Real lowering servers for the process tests: a socket directory, a cache and an editable project of their own.

Most tests share one server per module (starting one costs 10-20 s of imports and warm-up); those about a server's
life start their own. The server runs a snapshot of lowercache's sources taken once per session: its identity
includes their digest, and an edit to the checkout while the tests run would make every server stale.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from . import ROOT, references

TARGET = "ethos-u55-128"
WAIT = 600  # seconds any one command may take on a loaded 2-core machine

MODEL = """
import os, sys, time
import torch
from helper import Block


def switch(name):
    # a test's switch, a file in the working directory: a variable would start a server under another environment
    try:
        with open(name) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def model():
    torch.manual_seed(0)
    marker = switch("marker")
    if marker:
        with open(marker, "w") as f:
            f.write(f"{os.getpid()} {torch.get_num_threads()}")
    behaviour = switch("behaviour")
    if behaviour == "raise":
        raise ValueError("boom")
    if behaviour == "abort":
        os.abort()
    if behaviour == "hang":
        time.sleep(600)
    if behaviour == "slow":
        time.sleep(8)
    return Block().eval(), (torch.randn(1, 3, 16, 16),)
"""

HELPER = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return torch.relu(self.conv(x))
"""


_SNAPSHOT: list[Path] = []


def snapshot() -> Path:
    """A copy of lowercache's sources taken once per session: the server's identity includes their digest, and an
    edit to the checkout while the tests run (other work in the same tree) would make every server stale."""
    if not _SNAPSHOT:
        root = Path(tempfile.mkdtemp(prefix="lowercache-src-"))
        shutil.copytree(ROOT / "lowercache", root / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
        _SNAPSHOT.append(root)
    return _SNAPSHOT[0]


def base_env(run: Path, cache: Path, **extra: str) -> dict[str, str]:
    """The default environment (no thread-count variable), a server allowed, the given socket directory and cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(XDG_RUNTIME_DIR=str(run), LOWERCACHE_SERVER="1", LOWERCACHE_DIR=str(cache), PYTHONPATH=str(snapshot()), **extra)
    return env


def remove_snapshot() -> None:
    while _SNAPSHOT:
        shutil.rmtree(_SNAPSHOT.pop(), ignore_errors=True)


def lc(*args: str, env: dict[str, str], cwd: Path, timeout: float = WAIT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def status(env: dict[str, str], cwd: Path) -> dict[str, str]:
    """``lowercache server status`` as name -> value; empty when no server runs."""
    result = lc("server", "status", env=env, cwd=cwd, timeout=60)
    if result.returncode:
        assert "no server running" in result.stdout
        return {}
    rows = {line[:10].strip(): line[11:] for line in result.stdout.splitlines() if line.strip()}
    rows["pid"] = re.search(r"pid (\d+)", rows["server"]).group(1)
    rows["served"] = re.search(r"(\d+) served", rows["requests"]).group(1)
    return rows


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"  # a zombie has exited


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


class Server:
    """A socket directory of its own, a cache, a project directory with an editable model; stopped at the end."""

    def __init__(self, root: Path, **extra: str) -> None:
        self.run = Path(tempfile.mkdtemp(prefix="lcs", dir="/tmp"))  # short: a socket path holds at most 107 bytes
        self.project = root / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        (self.project / "model.py").write_text(MODEL)
        (self.project / "helper.py").write_text(HELPER)
        self.env = base_env(self.run, root / "cache", **extra)

    def __call__(self, *args: str, timeout: float = WAIT, **extra: str) -> subprocess.CompletedProcess:
        return lc(*args, env={**self.env, **extra}, cwd=self.project, timeout=timeout)

    @contextlib.contextmanager
    def switched(self, **switches: str) -> Iterator[None]:
        """The model's switches (``behaviour``: raise, abort, hang, slow; ``marker``: a file it writes its pid and thread
        count to) on for the block's commands: files in the project, as a variable would replace the server."""
        for name, value in switches.items():
            (self.project / name).write_text(value)
        try:
            yield
        finally:
            for name in switches:
                (self.project / name).unlink(missing_ok=True)

    def start(self) -> int:
        result = self("server", "start")
        assert result.returncode == 0, result.stderr[-2000:]
        return int(re.search(r"pid (\d+)", result.stdout).group(1))

    def status(self, **extra: str) -> dict[str, str]:
        return status({**self.env, **extra}, self.project)

    def close(self) -> None:
        """Stop the server that answers here, if any: ``server stop`` names it (one command, not a status first)."""
        result = self("server", "stop", timeout=120)
        assert result.returncode == 0, result.stderr
        stopped = re.search(r"pid (\d+)", result.stdout)
        if stopped:
            pid = int(stopped.group(1))
            if not wait_until(lambda: not alive(pid), 60):
                os.kill(pid, signal.SIGKILL)
        else:
            assert "no server running" in result.stdout, result.stdout
        shutil.rmtree(self.run, ignore_errors=True)


def fresh(server: Server, base: Path, *args: str | Path, cwd: Path | None = None, trees: tuple[Path, ...] = (),
          **extra: str) -> subprocess.CompletedProcess:
    """``lowercache ARGS --no-cache --no-server`` (``-o DIR`` among ``args``) in a new process, in the server's
    environment with no server by variable too: the fresh reference. Run once per test run for the same project,
    environment and lowercache (``helpers/references.py``); ``base``: the test's own directory. Of its outputs, the
    ``.pte`` is kept. ``trees``: what the model reads outside the working directory (a model file elsewhere)."""
    args = tuple(map(str, args))
    out = Path(args[args.index("-o") + 1])
    cwd = cwd or server.project
    return references.run(
        [sys.executable, "-m", "lowercache.cli", *args, "--no-cache", "--no-server"], cwd=cwd,
        env={**server.env, "LOWERCACHE_SERVER": "0", **extra}, outputs=[(cwd / out) / "model.pte"],
        places={base: "<tmp>", server.run: "<run>", snapshot(): "<src>"}, trees=(cwd, *trees), timeout=WAIT,
    )


def steady(text: str) -> str:
    """Output with the seconds taken out: they differ from run to run."""
    return re.sub(r"\d+\.\d+", "N", text)
