"""The quick start's first runs in a brand-new home, as a person makes them (nothing set but ``HOME``: the cache, its
memos, the config and the server's socket are the defaults), from a checkout whose lowercache is installed editable:

1. at a CI-like terminal (``script``, ``COLUMNS=80 TERM=dumb CI=true``): starts the warm server, which lowers and records;
2. from a pipe (``| cat``): confirms that record, or is served from it once the idle server has confirmed it;
3. at a plain terminal: served from the record, without torch.

A record made at a terminal is the pipe's and the CI log's too (``environment.py``), and a background confirmation
settles it as the second run would, or leaves it for the second run: no run makes a second first record.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.helpers import ROOT
from tests.helpers.cli import stock_of_file
from tests.helpers.server import WAIT, alive, wait_until

TARGET = "ethos-u55-128"
MODEL = "examples/tiny_cnn.py:model"
OUT = "out/tiny_cnn"  # every run writes where the quick start says
CI_LIKE = {"COLUMNS": "80", "TERM": "dumb", "CI": "true"}
PLAIN_TERMINAL = {"TERM": "xterm-256color"}
# What the test runner's own environment says of its terminal, its settings and itself: none of it is a new home's.
_NOT_A_USERS = ("COLUMNS", "LINES", "TERM", "CI", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH")

# A factory that does what no record can capture (leaves a thread running) only where its output goes nowhere: in the
# server's background confirmation, whose stdout is /dev/null. The record's inputs are the same everywhere.
RESTLESS = """
import os, stat, threading, time
import torch


def model():
    if stat.S_ISCHR(os.fstat(1).st_mode):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval(), (torch.randn(1, 3, 16, 16),)
"""


class Home:
    """A new home: a checkout of the example with lowercache's sources in it (``pip install -e .``), and no cache yet."""

    def __init__(self, root: Path) -> None:
        self.home = root / "home"
        self.project = self.home / "lowercache"
        (self.project / ".git").mkdir(parents=True)
        (self.project / "examples").mkdir()
        shutil.copy(ROOT / "examples" / "tiny_cnn.py", self.project / "examples")
        shutil.copytree(ROOT / "lowercache", self.project / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
        self.run = Path(tempfile.mkdtemp(prefix="lch", dir="/tmp"))  # short: a socket path holds at most 107 bytes
        kept = {k: v for k, v in os.environ.items() if not k.startswith(("LOWERCACHE_", "XDG_", "PYTEST_")) and k not in _NOT_A_USERS}
        self.env = {**kept, "HOME": str(self.home), "XDG_RUNTIME_DIR": str(self.run), "PYTHONPATH": str(self.project)}
        script = Path(sys.executable).with_name("lowercache")
        self.command = [str(script)] if script.exists() else [sys.executable, "-m", "lowercache.cli"]
        self.model = MODEL

    @property
    def log(self) -> Path:
        return self.run / "lowercache" / "server.log"

    def shell(self, line: str, **extra: str) -> tuple[int, str]:
        """The shell command ``line`` at a pseudo-terminal of its own, as ``script`` gives one: its exit code and what it showed."""
        env = {**self.env, **extra}
        result = subprocess.run(["script", "-qec", line, "/dev/null"], cwd=self.project, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=WAIT)
        return result.returncode, result.stdout.decode("utf-8", "replace")

    def lower(self, line: str, out: str, **extra: str) -> tuple[dict, bytes, str]:
        """The quick start's ``lower`` into ``out``, spelled by ``line`` (``{lower}`` stands for the command): its
        manifest, its .pte and what it showed."""
        lower = shlex.join([*self.command, "lower", self.model, "--target", TARGET, "--out", out])
        code, shown = self.shell(line.format(lower=lower), **extra)
        assert code == 0, shown[-3000:] + self.said()
        return json.loads((self.project / out / "manifest.json").read_text()), (self.project / out / "model.pte").read_bytes(), shown

    def stock(self) -> bytes:
        """What stock ExecuTorch makes of the model, in this process: the bytes every run must give."""
        path, _, factory = self.model.partition(":")
        return stock_of_file(self.project / path, factory, TARGET, "new_home_model")

    def said(self) -> str:
        """What the server's log and ``explain`` say of the record, for a failed assertion."""
        explained = subprocess.run([*self.command, "explain", self.model, "-t", TARGET], cwd=self.project, env=self.env,
                                   capture_output=True, text=True, timeout=WAIT).stdout
        log = self.log.read_text(errors="replace") if self.log.exists() else "(no server log)"
        return f"\n--- explain:\n{explained}\n--- server log:\n{log[-3000:]}"

    def confirmations(self) -> list[str]:
        """What each background confirmation the server ran said (its log's lines)."""
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        command = f"lower {self.model} --target {TARGET} --out {OUT}: "
        return [line.split(command, 1)[1] for line in log.splitlines() if "background confirmation of" in line and command in line]

    def close(self) -> None:
        log = self.log.read_text(errors="replace") if self.log.exists() else ""
        listening = re.search(r"^lowercache server (\d+) listening", log, re.M)
        subprocess.run([*self.command, "server", "stop"], cwd=self.project, env=self.env, capture_output=True, timeout=120)
        if listening is not None:
            pid = int(listening.group(1))
            if not wait_until(lambda: not alive(pid), 60):
                os.kill(pid, 9)
        shutil.rmtree(self.run, ignore_errors=True)


@pytest.fixture
def home(tmp_path) -> Iterator[Home]:
    if shutil.which("script") is None:
        pytest.skip("util-linux's script is not installed")
    made = Home(tmp_path)
    yield made
    made.close()


def three_runs(home: Home, background: str | None, second: Callable[[dict], bool]) -> None:
    """Runs 1 to 3 of the new home, every .pte stock's. ``background``: between runs 1 and 2, wait until the server's
    background run of run 1's record has ended saying this (None: run 2 at once); ``second``: what run 2's
    ``manifest.json`` must say of direct mode."""
    manifest, pte, shown = home.lower("{lower}", OUT, **CI_LIKE)  # the new home's first command: a server starts, records
    assert "starting the lowering server" in shown, shown[-3000:]
    assert pte == home.stock()
    assert manifest["direct"]["record"] == "unconfirmed", manifest["direct"]
    assert manifest["direct"]["reason"].startswith("recorded;"), manifest["direct"]
    if background is not None:
        assert wait_until(lambda: home.confirmations(), WAIT), home.said()
        assert home.confirmations()[0].startswith(background), home.said()
    manifest, again, shown = home.lower("{lower} | cat", OUT, **PLAIN_TERMINAL)
    assert again == pte
    assert second(manifest["direct"]), (manifest["direct"], shown[-3000:] + home.said())
    manifest, again, shown = home.lower("{lower}", OUT, **PLAIN_TERMINAL)  # served, without torch
    assert manifest["direct"].get("outcome") == "hit", shown[-3000:] + home.said()
    assert manifest["direct"]["torch_imported"] is False
    assert again == pte


def test_the_pipe_right_after_the_first_run_confirms_its_record(home):
    """Run 2 comes at once: it confirms run 1's record (or, had the server confirmed it first, is served from it);
    never a record of its own, as if run 1 had left none."""
    three_runs(home, None, lambda direct: direct.get("record") == "confirmed" or direct.get("outcome") == "hit")


def test_the_pipe_after_the_server_confirmed_in_the_background_is_served(home):
    """The idle server confirms run 1's record before run 2 comes (the person read the output first): run 2 is served
    from the record, as is run 3."""
    three_runs(home, "confirmed: ", lambda direct: direct.get("outcome") == "hit")


def test_a_refusal_only_the_background_run_meets_leaves_the_record_for_the_next_run(home):
    """The background run is no command's (its output goes to /dev/null, long after the command): what it alone did that
    no record can capture leaves run 1's record unconfirmed, not untrusted. Run 2 then confirms it, where it would
    record afresh ("recorded", no change named: the first runs of a new home once went so), and run 3 is served."""
    (home.project / "examples" / "restless.py").write_text(RESTLESS)
    home.model = "examples/restless.py:model"
    three_runs(home, "unconfirmed: the factory left a thread running", lambda direct: direct.get("record") == "confirmed")
