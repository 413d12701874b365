"""The backstop below Python: a file only native code reads is an input too (``lowercache/record/backstop.py``).

``torch.from_file`` and C code called through ``ctypes`` read files no audit
hook hears. Each case keeps such a file away from the model (another
directory, a suffix the sweep does not know), lets direct mode (in the
client's process and in the server's child) or ``run``'s replay record and
confirm, edits the file, and compares what is served with a fresh run in a
new process. Where no tracer can attach (the process is already traced), the
record is untrusted and ``explain`` says why.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.server import WAIT, fresh

PY = sys.executable
TARGET = "tosa-fp"

# Weights through torch.from_file, a scale through libc's fopen/fread: neither raises an audit event.
MODEL = textwrap.dedent(
    """
    import ctypes, os
    import torch

    HERE = os.path.dirname(os.path.abspath(__file__))

    def _scale():
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        stream = libc.fopen(os.path.join(HERE, "..", "conf", "scale.prm").encode(), b"rb")
        data = ctypes.create_string_buffer(4)
        libc.fread(data, 1, 4, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        return ctypes.c_float.from_buffer_copy(data.raw).value

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            weights = torch.from_file(os.path.join(HERE, "..", "assets", "w.blob2"), size=4, dtype=torch.float32)
            self.w = torch.nn.Parameter(weights.clone() * _scale())

        def forward(self, x):
            return torch.relu(x * self.w)

    def model():
        return M().eval(), (torch.ones(1, 4),)
    """
)
SCRIPT = textwrap.dedent(
    """
    import ctypes
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    stream = libc.fopen(b"../conf/scale.prm", b"rb")
    data = ctypes.create_string_buffer(4)
    libc.fread(data, 1, 4, ctypes.c_void_p(stream))
    open("out.txt", "w").write(repr(ctypes.c_float.from_buffer_copy(data.raw).value))
    """
)


def project(root: Path) -> Path:
    (root / "models").mkdir(parents=True)
    (root / "models" / "m.py").write_text(MODEL)
    (root / "tools").mkdir()
    (root / "tools" / "script.py").write_text(SCRIPT)
    (root / "assets").mkdir()
    (root / "conf").mkdir()
    edit(root, 1.0, 2.0)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def edit(root: Path, first: float, scale: float) -> None:
    """New bytes, same sizes: a stat check alone may not see it within a second, the content does."""
    (root / "assets" / "w.blob2").write_bytes(struct.pack("4f", first, 2.0, 3.0, 4.0))
    (root / "conf" / "scale.prm").write_bytes(struct.pack("f", scale))


def lower(server, root: Path, out: Path, *flags: str, **env: str) -> tuple[bytes, str]:
    result = subprocess.run([PY, "-m", "lowercache.cli", "lower", "models/m.py:model", "-t", TARGET, "-o", str(out), *flags],
                            cwd=root, env={**server.env, **env}, capture_output=True, text=True, timeout=WAIT)
    assert result.returncode == 0, result.stderr[-3000:]
    return (out / "model.pte").read_bytes(), result.stderr


def fresh_pte(server, root: Path, base: Path, out: str) -> bytes:
    """The project lowered afresh in a new process (``--no-cache --no-server``), shared across the run's tests."""
    result = fresh(server, base, "lower", "models/m.py:model", "-t", TARGET, "-o", base / out, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return (base / out / "model.pte").read_bytes()


def explain(server, root: Path) -> str:
    return subprocess.run([PY, "-m", "lowercache.cli", "explain", "models/m.py:model", "-t", TARGET], cwd=root, env=server.env,
                          capture_output=True, text=True, timeout=WAIT).stdout


@pytest.mark.parametrize("where", ["in-process", "server"])
def test_direct_mode_serves_fresh_bytes_after_a_file_only_native_code_read_changes(own, tmp_path, where):
    server = own()
    if where == "in-process":
        server.env["LOWERCACHE_SERVER"] = "0"
    root = project(tmp_path / "p")
    before = fresh_pte(server, root, tmp_path, "fresh0")
    for run in range(3):
        served, stderr = lower(server, root, tmp_path / f"a{run}")
        assert served == before, run
    assert "direct mode: served from the record" in stderr
    edit(root, 9.0, 2.0)  # the weights, read by torch.from_file
    weights = fresh_pte(server, root, tmp_path, "fresh1")
    assert weights != before
    assert lower(server, root, tmp_path / "b")[0] == weights
    assert "direct mode, latest lookup: not used: assets/w.blob2 changed" in explain(server, root)
    edit(root, 9.0, 5.0)  # the scale, read by libc's fread
    scaled = fresh_pte(server, root, tmp_path, "fresh2")
    assert scaled != weights
    for run in range(3):
        assert lower(server, root, tmp_path / f"c{run}")[0] == scaled, run
    assert "direct mode, latest lookup: hit" in explain(server, root)


def test_run_replays_only_while_a_file_only_native_code_read_is_unchanged(own, tmp_path):
    server = own()
    server.env["LOWERCACHE_SERVER"] = "0"
    root = project(tmp_path / "p")

    def wrapped() -> str:
        result = subprocess.run([PY, "-m", "lowercache.cli", "run", "--", PY, "script.py"], cwd=root / "tools", env=server.env,
                                capture_output=True, text=True, timeout=WAIT)
        assert result.returncode == 0, result.stderr[-3000:]
        return (root / "tools" / "out.txt").read_text()

    for run in range(3):
        assert wrapped() == "2.0"
    said = subprocess.run([PY, "-m", "lowercache.cli", "run", "--explain", "--", PY, "script.py"], cwd=root / "tools",
                          env=server.env, capture_output=True, text=True, timeout=WAIT).stdout
    assert "latest lookup: hit" in said, said
    edit(root, 1.0, 7.0)
    for run in range(3):
        assert wrapped() == "7.0", run


# A parent that traces the command (as a debugger or strace would): no second tracer can attach to it.
TRACED = textwrap.dedent(
    """
    import ctypes, os, signal, sys
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.fork()
    if pid == 0:
        libc.ptrace(0, 0, None, None)  # PTRACE_TRACEME
        os.execv(sys.argv[1], sys.argv[1:])
    while True:
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            sys.exit(os.WEXITSTATUS(status))
        if os.WIFSIGNALED(status):
            sys.exit(128 + os.WTERMSIG(status))
        sig = os.WSTOPSIG(status)
        libc.ptrace(7, pid, None, ctypes.c_void_p(0 if sig == signal.SIGTRAP else sig))  # PTRACE_CONT
    """
)


def test_a_record_no_tracer_could_watch_is_not_trusted(own, tmp_path):
    server = own()
    server.env["LOWERCACHE_SERVER"] = "0"
    root = project(tmp_path / "p")
    before = fresh_pte(server, root, tmp_path, "fresh0")
    traced = [PY, "-c", TRACED, PY, "-m", "lowercache.cli", "lower", "models/m.py:model", "-t", TARGET]
    for run in range(3):
        result = subprocess.run([*traced, "-o", str(tmp_path / f"t{run}")], cwd=root, env=server.env, capture_output=True,
                                text=True, timeout=WAIT)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / f"t{run}" / "model.pte").read_bytes() == before
        assert "served from the record" not in result.stderr
    said = explain(server, root)
    assert "direct mode, latest record: untrusted: the factory could not be watched below Python (no tracer can attach" in said, said


WRITER = MODEL.replace("def model():\n", """def model():
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose(ctypes.c_void_p(libc.fopen(os.path.join(HERE, "..", "conf", "native.trace").encode(), b"wb")))
""")


def test_a_write_only_native_code_made_makes_the_record_untrusted_naming_it(own, tmp_path):
    """A hit would skip the write: the record is untrusted, and explain names the file."""
    server = own()
    server.env["LOWERCACHE_SERVER"] = "0"
    (tmp_path / "scratch").mkdir()
    server.env["TMPDIR"] = str(tmp_path / "scratch")  # the project is under /tmp, where writes would be scratch
    root = project(tmp_path / "p")
    (root / "models" / "m.py").write_text(WRITER)
    lower(server, root, tmp_path / "a")
    assert (root / "conf" / "native.trace").exists()
    said = explain(server, root)
    assert f"direct mode, latest record: untrusted: the factory wrote {root / 'conf' / 'native.trace'}" in said, said
