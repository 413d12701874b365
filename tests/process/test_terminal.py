"""As a person runs it: at a real terminal (a pseudo-terminal with a size, no ``COLUMNS`` exported), from a pipe, in a
CI log, through the warm server; what they see, and that an unchanged lowering is a direct hit wherever it runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lowercache.bench import process as bench_process

from tests.helpers.cli import TINY
from tests.helpers.server import TARGET, Server, fresh

# What CI runners and log-friendly setups export; each only changes how output looks.
CI_LIKE = {"CI": "true", "GITHUB_ACTIONS": "true", "COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}


def at_a_terminal(server: Server, *args: str, timeout: float = 600, **extra: str) -> tuple[int, str]:
    """The command with a 100x30 pseudo-terminal as its stdin, stdout and stderr (the benchmark's harness): its exit
    code and everything it showed."""
    env = {**{k: v for k, v in server.env.items() if k not in ("COLUMNS", "LINES")}, "TERM": "xterm-256color", **extra}
    code, shown, _ = bench_process.at_a_terminal([sys.executable, "-m", "lowercache.cli", *args], env, server.project,
                                                  timeout, size=(100, 30))
    return code, shown


def from_a_pipe(server: Server, *args: str, **extra: str) -> tuple[int, str]:
    result = server(*args, **extra)
    return result.returncode, result.stderr


def lowered(server: Server, out: Path, how, **extra: str) -> tuple[dict, bytes, str]:
    """``lower`` of the project's model, at a terminal or from a pipe: its manifest, its .pte and what it showed."""
    code, shown = how(server, "lower", "model.py:model", "-t", TARGET, "-o", str(out), **extra)
    assert code == 0, shown[-3000:]
    return json.loads((out / "manifest.json").read_text()), (out / "model.pte").read_bytes(), shown


def stock(server: Server, base: Path, out: Path, **extra: str) -> bytes:
    """A fresh lowering in a new process: no cache, no server, no record. Shared across the run
    (``helpers/references.py``): five tests lower the same server project first."""
    result = fresh(server, base, "lower", "model.py:model", "-t", TARGET, "-o", out, **extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return (out / "model.pte").read_bytes()


def test_the_first_lower_says_it_starts_the_server_and_shows_progress_from_it(own, tmp_path):
    server = own()
    code, shown = at_a_terminal(server, "lower", TINY, "-t", "ethos-u55-128", "-o", str(tmp_path / "out"))
    assert code == 0, shown[-3000:]
    starting = shown.find("starting the lowering server")
    table = shown.find("where the time went")
    assert 0 <= starting < table, shown[:2000]
    # the spinner, drawn by the server's child on the client's terminal, counts the phases as they run, by the names the
    # table ends with (a phase shorter than one refresh may be skipped: any of them shows it drew)
    between = shown[starting:table]
    counted = {name.strip() for name in re.findall(r"\[\d/7\] ([a-zA-Z_ ]+?)(?::|\s\s|\x1b|$)", between)}
    assert counted & {"export", "quantize", "to_edge", "cache lookup", "to_executorch"}, between[:2000]
    rows = {name for name in ("load the model", "export", "import the Arm backend", "cache lookup", "quantize", "to_edge", "to_executorch")
            if re.search(rf"│ {name} +│", shown[table:])}
    assert counted <= rows, (counted, shown[table:])
    assert "\x1b[" in between  # drawn as on a terminal
    assert server.status()  # it went through the server


def test_a_log_gets_a_line_per_phase_with_its_time_and_the_table_adds_them_up(tmp_path):
    """From a pipe: ``lowercache: [4/7] import the Arm backend: 0.00 s`` as each phase ends; the table's rows are those
    phases with those seconds, and its total is their sum."""
    result = subprocess.run([sys.executable, "-m", "lowercache.cli", "lower", TINY, "-t", TARGET, "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "LOWERCACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"^lowercache: \[(\d)/(\d)\] ([a-zA-Z_ ]+): (\d+\.\d\d) s$", result.stderr, re.M)
    assert [int(i) for i, _, _, _ in lines] == list(range(1, 8)) and {n for _, n, _, _ in lines} == {"7"}, result.stderr
    rows = re.findall(r"^│ ([a-zA-Z_ ]+?) +│ +(\d+\.\d\d) │", result.stderr, re.M)
    assert [(name, seconds) for _, _, name, seconds in lines] == rows, result.stderr
    total = re.search(r"^total (\d+\.\d\d) s", result.stderr, re.M)
    assert total is not None and abs(float(total.group(1)) - sum(float(s) for _, s in rows)) < 0.011 * len(rows)


def test_terminal_pipe_and_ci_log_runs_share_one_record_and_the_third_run_on_is_a_direct_hit(own, tmp_path):
    """A terminal, then a pipe (``| tee``), then a terminal again, then CI-like variables: one record answers them all."""
    server = own()
    expected = stock(server, tmp_path, tmp_path / "stock")
    runs = [(at_a_terminal, {}), (from_a_pipe, {}), (at_a_terminal, {}), (from_a_pipe, CI_LIKE), (at_a_terminal, CI_LIKE),
            (at_a_terminal, {}), (from_a_pipe, {})]
    for i, (how, extra) in enumerate(runs):
        manifest, pte, shown = lowered(server, tmp_path / f"out{i}", how, **extra)
        assert pte == expected, (i, how.__name__, extra)
        if i < 2:  # the first two ran in the server's child: a record, then its confirmation
            assert manifest["direct"]["record"] == ["unconfirmed", "confirmed"][i], manifest["direct"]
            assert int(server.status()["served"]) == i + 1
        else:
            assert manifest["direct"].get("outcome") == "hit", (i, how.__name__, extra, shown[-2000:])
            assert re.search(r"served from the record, no factory run \(\d+\.\d\d s\)", shown), shown[-2000:]
    assert int(server.status()["served"]) == 2


def into_a_log(server: Server, *args: str, **extra: str) -> tuple[int, str]:
    """The command with its stdout and stderr written to ``build.log`` beside the model (``> build.log 2>&1``)."""
    log = server.project / "build.log"
    with open(log, "wb") as f:
        code = subprocess.run([sys.executable, "-m", "lowercache.cli", *args], cwd=server.project, env={**server.env, **extra},
                              stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
    return code, log.read_text()


def through_tee(server: Server, *args: str, **extra: str) -> tuple[int, str]:
    """The command's stdout and stderr piped to ``tee build.log`` beside the model (``2>&1 | tee build.log``): the
    exit code is tee's, so the caller checks what the command wrote."""
    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "lowercache.cli", *args))
    code = subprocess.run(["sh", "-c", f"{command} 2>&1 | tee build.log >/dev/null"], cwd=server.project,
                          env={**server.env, **extra}, stdin=subprocess.DEVNULL, timeout=600).returncode
    return code, (server.project / "build.log").read_text()


@pytest.mark.parametrize("how, flags", [(into_a_log, ()), (into_a_log, ("--no-server",)), (through_tee, ()),
                                        (through_tee, ("--no-server",))])
def test_output_into_a_log_beside_the_model_is_no_input(own, tmp_path, how, flags):
    """``lowercache lower ... > build.log 2>&1`` (or ``| tee build.log``) in the model's directory: the log changes while
    the command runs, yet it is the command's output, never the factory's input; the third run on is a direct hit."""
    server = own()
    expected = stock(server, tmp_path, tmp_path / "stock")
    for i in range(4):
        code, shown = how(server, "lower", "model.py:model", "-t", TARGET, "-o", str(tmp_path / f"out{i}"), *flags)
        assert code == 0, shown[-3000:]
        assert (tmp_path / f"out{i}" / "model.pte").read_bytes() == expected
        direct = json.loads((tmp_path / f"out{i}" / "manifest.json").read_text())["direct"]
        if i >= 2:
            assert direct.get("outcome") == "hit", (i, direct, shown[-2000:])


def test_presentation_variables_never_turn_a_request_away_from_the_server(own, tmp_path):
    """``COLUMNS=80`` and the like go through the same warm server: no warning, no lowering in the client's process."""
    server = own()
    pid = server.start()
    for i, extra in enumerate([{"COLUMNS": "80"}, CI_LIKE, {"FORCE_COLOR": "1", "LINES": "10", "SHLVL": "7"}]):
        result = server("lower", "model.py:model", "-t", TARGET, "-o", tmp_path / f"out{i}", "--no-direct", **extra)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "warning" not in result.stderr, result.stderr[-2000:]
        status = server.status()
        assert (int(status["pid"]), int(status["served"])) == (pid, i + 1)
    code, shown = at_a_terminal(server, "lower", "model.py:model", "-t", TARGET, "-o", str(tmp_path / "tty"), "--no-direct",
                                **CI_LIKE)
    assert code == 0 and "warning" not in shown, shown[-2000:]
    assert int(server.status()["served"]) == 4


NATIVE_MODEL = """
import ctypes
import torch

libc = ctypes.CDLL(None)
libc.getenv.restype, libc.getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]


def model():
    width = int(libc.getenv(b"NATIVE_WIDTH") or b"8")  # as C code reads a variable: no os.environ, nothing Python hears
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()).eval(), (torch.randn(1, width),)
"""


def test_a_variable_only_native_code_reads_is_an_input_of_the_record_and_of_the_server(own, tmp_path):
    server = own()
    (server.project / "model.py").write_text(NATIVE_MODEL)
    plain, wide = stock(server, tmp_path, tmp_path / "plain"), stock(server, tmp_path, tmp_path / "wide", NATIVE_WIDTH="16")
    assert plain != wide
    for i in range(3):
        manifest, pte, _ = lowered(server, tmp_path / f"p{i}", from_a_pipe)
        assert pte == plain
    assert manifest["direct"].get("outcome") == "hit"
    pid = int(server.status()["pid"])
    manifest, pte, shown = lowered(server, tmp_path / "w", from_a_pipe, NATIVE_WIDTH="16")
    assert pte == wide and manifest["direct"].get("outcome") != "hit"
    assert "warning" not in shown, shown[-2000:]  # not turned away: a server started under the client's environment ran it
    assert int(server.status(NATIVE_WIDTH="16")["pid"]) != pid
    explained = server("explain", "model.py:model", "-t", TARGET, NATIVE_WIDTH="16").stdout
    assert "environment variable NATIVE_WIDTH differs from the record's" in explained, explained


@pytest.mark.quick
def test_a_hit_says_the_commands_own_time_from_its_start():
    """Not the time since the record was looked up, which leaves out the interpreter's start and the imports."""
    code = "import time; time.sleep(0.5); from lowercache.direct import command_seconds; print(command_seconds())"
    took = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout)
    assert took >= 0.5
