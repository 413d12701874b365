"""``lowercache watch``, end to end: a real watch process and a real server in a temporary socket directory, real edits.

One watch session carries the expensive scenario (a model edit, an edit of
an imported module, a syntax error mid-edit, Ctrl-C); the server it starts
is shared with the other tests and stopped at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from lowercache import estimates
from tests.helpers import ROOT

TARGET = "ethos-u55-128"
WAIT = 300  # seconds any one lowering may take on a loaded 2-core machine

MODEL = """
import torch
from lowercache.bench.models import tiny_cnn
from helper import wrap


class Head(torch.nn.Module):
    def __init__(self, body, width):
        super().__init__()
        self.body = body
        self.fc = torch.nn.Linear(10, width) if width else torch.nn.Identity()

    def forward(self, x):
        return self.fc(self.body(x))


def model():
    module, inputs = tiny_cnn()
    torch.manual_seed(0)
    return wrap(Head(module, 0)).eval(), inputs
"""
# The edit: a wider classifier after the CNN, which Vela must spend cycles and flash on.
MODEL_EDITED = MODEL.replace("Head(module, 0)", "Head(module, 64)")
HELPER = """
import torch


class Wrapped(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.relu(self.inner(x))


def wrap(module):
    return module
"""
# The same size, saved with the same mtime: Python's bytecode check (source mtime in seconds, and size) cannot tell.
HELPER_EDITED = HELPER.replace("return module", "return Wrapped(module)")
HELPER += "#" * (len(HELPER_EDITED) - len(HELPER) - 1) + "\n"


class Session:
    """A socket directory, a cache, a project, and the lowercache sources as they were when the tests began
    (the server's identity includes their digest: an edit elsewhere in the tree would make it stale)."""

    def __init__(self, root: Path) -> None:
        self.run = Path(tempfile.mkdtemp(prefix="lcw", dir="/tmp"))  # short: a socket path holds at most 107 bytes
        self.sources = root / "src"
        shutil.copytree(ROOT / "lowercache", self.sources / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
        self.project = root / "project"
        self.project.mkdir()
        (self.project / "model.py").write_text(MODEL)
        (self.project / "helper.py").write_text(HELPER)
        # bytecode written, as on a user's machine: an edit the bytecode check cannot see must still be lowered fresh
        drop = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOWERCACHE_SERVER", "PYTHONDONTWRITEBYTECODE")
        self.env = {k: v for k, v in os.environ.items() if k not in drop}
        self.env.update(XDG_RUNTIME_DIR=str(self.run), LOWERCACHE_DIR=str(root / "cache"), PYTHONPATH=str(self.sources))

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "lowercache.cli", *args]

    def __call__(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), env={**self.env, **extra}, cwd=self.project, capture_output=True, text=True, timeout=WAIT)

    def close(self) -> None:
        self("server", "stop")
        shutil.rmtree(self.run, ignore_errors=True)


class Watch:
    """A ``lowercache watch`` process whose output is collected line by line, waited on with a deadline."""

    def __init__(self, session: Session, *args: str) -> None:
        self.process = subprocess.Popen(
            session.command("watch", *args), env=session.env, cwd=session.project,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self, start: int = 0) -> str:
        return "\n".join(self.lines[start:])

    def wait_for(self, pattern: str, start: int = 0, timeout: float = WAIT) -> str:
        """The output from line ``start`` on, once a line from there matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(start, len(self.lines)):
                if re.search(pattern, self.lines[i]):
                    return self.text(start)
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text()}")

    def round(self, start: int) -> str:
        """One lowering round's output: from ``start`` to the 'watching' line after it."""
        return self.wait_for(r"\] watching \d+ files?", start)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=60)
        self.reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("watch"))
    yield s
    s.close()


def test_watch_relowers_on_edits_reports_vela_deltas_survives_a_syntax_error_and_stops_on_ctrl_c(session):
    project = session.project
    watch = Watch(session, "model.py:model", "-t", TARGET, "-o", "out", "--interval", "0.2")
    try:
        first = watch.round(0)
        assert re.search(rf"{TARGET}: lowered in \d+\.\d\d s \(whole lowering: miss; ", first), first  # in a user's words
        assert "Vela estimate:" in first and "cycles/inference" in first
        assert re.search(r"watching [2-9] files", first), first  # the model file and helper.py, from direct mode's record
        cycles = int(re.search(r"cycles/inference ([\d,]+)", first).group(1).replace(",", ""))

        mark = len(watch.lines)
        (project / "model.py").write_text(MODEL_EDITED)
        second = watch.round(mark)
        assert "changed: model.py" in second and f"{TARGET}: lowered in" in second, second
        assert "(against the previous lowering)" in second
        delta = re.search(r"cycles/inference ([\d,]+) -> ([\d,]+) \(\+", second)
        assert delta and int(delta.group(1).replace(",", "")) == cycles, second
        assert re.search(r"off-chip flash [\d.]+ -> [\d.]+ KiB \(\+", second), second
        assert re.search(r"layers: \d+ changed of \d+", second) and "+ " in second, second  # the new classifier's layers

        mark = len(watch.lines)
        before = os.stat(project / "helper.py")
        (project / "helper.py").write_text(HELPER_EDITED)
        os.utime(project / "helper.py", ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(project / "helper.py").st_size == before.st_size
        third = watch.round(mark)
        assert "changed: helper.py" in third and f"{TARGET}: lowered in" in third, third
        relowered = (project / "out" / "model.pte").read_bytes()

        mark = len(watch.lines)
        (project / "model.py").write_text(MODEL_EDITED + "\ndef broken(:\n")
        fourth = watch.round(mark)
        errors = [line for line in watch.lines[mark:] if "lowercache: error:" in line]
        assert len(errors) == 1 and "SyntaxError" in errors[0], fourth
        assert "Traceback" not in fourth and watch.process.poll() is None

        mark = len(watch.lines)
        (project / "model.py").write_text(MODEL_EDITED)
        fifth = watch.round(mark)
        assert f"{TARGET}: served from the cache in" in fifth or f"{TARGET}: served from the direct-mode record" in fifth, fifth
        assert watch.stop() == 0
        assert "stopped watching" in watch.text(mark) and "Traceback" not in watch.text()
    finally:
        watch.kill()

    fresh = session("lower", "model.py:model", "-t", TARGET, "-o", "fresh", "--no-cache", "--no-server")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert (project / "fresh" / "model.pte").read_bytes() == relowered


def test_several_targets_write_one_directory_each_and_no_server_starts_none(session):
    run = Path(tempfile.mkdtemp(prefix="lcn", dir="/tmp"))
    try:
        result = session("watch", "model.py:model", "-t", TARGET, "-t", "tosa-int", "-o", "multi", "--no-server", "--max-runs", "1",
                         XDG_RUNTIME_DIR=str(run))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert not (run / "lowercache" / "server.sock").exists()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    for target in (TARGET, "tosa-int"):
        assert (session.project / "multi" / target / "model.pte").is_file()
    assert f"-> multi/{TARGET}" in result.stdout and "-> multi/tosa-int" in result.stdout
    assert result.stdout.count("Vela estimate") == 1  # TOSA has no Vela estimate


def test_bad_input_is_one_line_and_exit_2(session):
    for args, message in (
        (("model.py:model", "-t", "ethos-u99", "-o", "out"), "unknown target"),
        (("missing.py:model", "-t", TARGET, "-o", "out"), "model file not found"),
    ):
        result = session("watch", *args)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr


@pytest.mark.quick
def test_vela_inserted_layers_are_matched_by_operator_not_by_their_running_number():
    def partition(*layers: tuple[str, str, float]) -> estimates.Partition:
        return estimates.Partition(0, {"cycles_total": "10"}, 0, 3, [estimates.Layer(n, op, c) for n, op, c in layers])

    before = estimates.Estimate(TARGET, [partition(("#57", "Transpose", 980), ("conv", "Conv2D", 3628))])
    after = estimates.Estimate(TARGET, [partition(("#203", "Transpose", 980), ("conv", "Conv2D", 4000), ("fc", "FullyConnected", 50))])
    lines = estimates.describe(after, before)
    layer_lines = "\n".join(lines[lines.index(next(line for line in lines if line.startswith("layers"))):])
    assert "#203" not in layer_lines and "conv Conv2D cycles 3,628 -> 4,000 (+372)" in layer_lines
    assert "+ fc FullyConnected 50 cycles (new)" in layer_lines
