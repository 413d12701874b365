"""``lowercache run`` through the warm server: the wrapped ``python`` runs in a forked child that stands in for a new process.

Each case runs the same command with ``--no-server`` (a new process, as
before) and through a real server, and compares what a user can see: exit
status, stdout, stderr, the files written and their modes. Where the child
cannot stand in (a file that would shadow a module the server imported),
the command runs as a new process and ``--explain`` says why; a command
under another start-up state gets a server started under it
(``tests/process/adversarial/test_startup.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


from tests.helpers.runserver import both, explain, project_with, run
from tests.helpers.server import WAIT, Server, alive, wait_until


PY = sys.executable

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    print("argv", sys.argv, __name__, __file__)
    print("path0", sys.path[0], "exe", sys.executable)
    print("threads", torch.get_num_threads())
    with open("out.txt", "w") as f:
        f.write("hello " + " ".join(sys.argv[1:]))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
    """
)

FAILING = textwrap.dedent(
    """
    import sys
    import helper_module
    print("read", repr(sys.stdin.read()))

    def inner():
        raise ValueError("boom")

    inner()
    """
)
# A file left open in a module: the interpreter's exit flushes it.
HELPER_MODULE = 'LEFT_OPEN = open("left_open.txt", "w")\nLEFT_OPEN.write("flushed at exit")\n'

TOOL = textwrap.dedent(
    """
    import sys, warnings
    warnings.warn("careful")
    print("tool", sys.argv[1:], __name__, __file__.endswith("tool.py"))
    """
)


def test_a_script_sees_and_leaves_what_a_new_process_would(server, tmp_path):
    project = project_with(tmp_path, {"script.py": SCRIPT})
    new, served = both(server, project, PY, "script.py", "a b", "c", outputs=("out.txt",))
    assert new == served
    status, stdout, stderr, files = served
    assert status == 3 and stderr == b"to stderr\n" and files["out.txt"] == (b"hello a b c", 0o640)
    assert f"path0 {project}".encode() in stdout and b"argv ['script.py', 'a b', 'c'] __main__" in stdout
    assert "latest run: ran: in a child of the warm server" in explain(server, project, PY, "script.py", "a b", "c")


def test_an_uncaught_exception_stdin_and_a_file_left_open(server, tmp_path):
    project = project_with(tmp_path, {"failing.py": FAILING, "helper_module.py": HELPER_MODULE})
    new, served = both(server, project, PY, "failing.py", outputs=("left_open.txt",), stdin=b"some input")
    assert new == served
    status, stdout, stderr, files = served
    assert status == 1 and stdout == b"read 'some input'\n" and files["left_open.txt"][0] == b"flushed at exit"
    assert stderr.decode().splitlines()[:2] == ["Traceback (most recent call last):", f'  File "{project}/failing.py", line 9, in <module>']
    assert "lowercache" not in stderr.decode()  # no frame of the code standing in for the interpreter


def test_a_script_that_reads_standard_input_is_not_recorded(server, tmp_path):
    project = project_with(tmp_path, {"echo.py": "import sys\nprint(sys.stdin.read().upper())\n"})
    result = run(server, project, PY, "echo.py", stdin=b"typed")
    assert result.returncode == 0 and result.stdout == b"TYPED\n"
    lines = explain(server, project, PY, "echo.py")
    assert "in a child of the warm server" in lines and "latest record: none: the command read standard input" in lines


FINALIZERS = textwrap.dedent(
    """
    import tempfile, weakref
    import torch  # its import registers finalizers of its own, as the server's did
    print("before the command, left to run at exit:", sum(f.atexit for f in weakref.finalize._registry if f.alive) > 0)

    class Held:
        pass

    held = Held()
    weakref.finalize(held, print, "the command's own finalizer ran")
    scratch = tempfile.TemporaryDirectory(dir=".")  # cleaned up at exit by its finalizer
    open(scratch.name + "/x", "w").close()
    """
)


def test_the_commands_finalizers_run_at_exit_and_the_servers_do_not(server, tmp_path):
    """A child's exit runs the finalizers the command made, as a new process's exit does; those the server made before
    the fork (torch.library's in-memory registrations, 0.04 s per command) are the server's and do not run."""
    project = project_with(tmp_path, {"final.py": FINALIZERS})
    new, served = both(server, project, PY, "final.py")
    assert new[0] == served[0] == 0 and new[2] == served[2]
    assert served[1] == b"before the command, left to run at exit: False\nthe command's own finalizer ran\n"
    assert new[1] == b"before the command, left to run at exit: True\nthe command's own finalizer ran\n"
    assert [p.name for p in project.iterdir()] == ["final.py"]  # each run's temporary directory was removed at its exit
    assert "in a child of the warm server" in explain(server, project, PY, "final.py")


def test_python_dash_m(server, tmp_path):
    project = project_with(tmp_path, {"pkg/__init__.py": "", "pkg/tool.py": TOOL})
    new, served = both(server, project, PY, "-m", "pkg.tool", "x")
    assert new == served
    assert served[0] == 0 and served[1] == b"tool ['x'] __main__ True\n" and b"UserWarning: careful" in served[2]
    assert "in a child of the warm server" in explain(server, project, PY, "-m", "pkg.tool", "x")


def test_unseeded_generators_are_seeded_per_run_as_in_new_processes(server, tmp_path):
    """Forked children would all inherit the server's generator state; a new process seeds torch's from the OS."""
    project = project_with(tmp_path, {"draw.py": "import random, torch\nprint(torch.randn(4).tolist(), random.random())\n"})
    draws = {run(server, project, PY, "draw.py").stdout for _ in range(2)}
    assert len(draws) == 2
    assert "in a child of the warm server" in explain(server, project, PY, "draw.py")


def test_a_file_that_would_shadow_a_module_the_server_imported_runs_a_new_process(server, tmp_path):
    """sympy is imported by the server (torch imports it); in a new process the script's own sympy.py wins."""
    project = project_with(tmp_path, {"uses.py": "import sympy\nprint(sympy.MINE)\n", "sympy.py": "MINE = 'the user module'\n"})
    result = run(server, project, PY, "uses.py")
    assert result.returncode == 0 and result.stdout == b"the user module\n", result.stderr
    assert "sympy.py would shadow a module the server imported" in explain(server, project, PY, "uses.py")


def test_a_variable_set_before_importing_torch_runs_a_new_process(server, tmp_path):
    """``OMP_NUM_THREADS`` set at the top of a script, then ``import torch``: a new process starts torch with one thread.
    The server's child imported torch before the fork, so it backs out, nothing of the command seen yet, and the command
    runs as a new process. Set after the import, the variable changes nothing in either, and the child stands in."""
    first = 'import os\nos.environ["OMP_NUM_THREADS"] = "1"\nimport torch\nprint("threads", torch.get_num_threads())\n'
    after = 'import os, torch\nos.environ["OMP_NUM_THREADS"] = "1"\nprint("threads", torch.get_num_threads())\n'
    project = project_with(tmp_path, {"first.py": first, "after.py": after})
    new, served = both(server, project, PY, "first.py")
    assert new == served and served[:3] == (0, b"threads 1\n", b""), served
    assert ("latest run: ran: as a new process (the command sets OMP_NUM_THREADS before it imports torch"
            in explain(server, project, PY, "first.py"))
    new, served = both(server, project, PY, "after.py")
    assert new == served and served[0] == 0, served
    assert "in a child of the warm server" in explain(server, project, PY, "after.py")


def test_a_path_put_first_before_importing_a_module_the_server_imported_runs_a_new_process(server, tmp_path):
    """``sys.path.insert(0, "vendor")`` then ``import tabulate`` (which the server imported): a new process imports the
    vendored copy, so the child backs out; appended after site-packages, the installed copy wins in both."""
    first = 'import sys\nsys.path.insert(0, "vendor")\nimport tabulate\nprint(getattr(tabulate, "MINE", "installed"))\n'
    last = first.replace("sys.path.insert(0, ", "sys.path.append(")
    project = project_with(tmp_path, {"first.py": first, "last.py": last, "vendor/tabulate.py": "MINE = 'vendored'\n"})
    new, served = both(server, project, PY, "first.py")
    assert new == served and served[:3] == (0, b"vendored\n", b""), served
    assert "as a new process (the command puts " in explain(server, project, PY, "first.py")
    new, served = both(server, project, PY, "last.py")
    assert new == served and served[:3] == (0, b"installed\n", b""), served
    assert "in a child of the warm server" in explain(server, project, PY, "last.py")


def test_warnings_made_errors_before_importing_executorch_run_a_new_process(server, tmp_path):
    """``warnings.simplefilter("error")`` and then ExecuTorch's Arm partitioner: its import warns (a DeprecationWarning
    of ExecuTorch 1.5.1's), so a new process fails; the child's imports ran before the fork, so it backs out."""
    script = 'import warnings\nwarnings.simplefilter("error")\nimport executorch.backends.arm.tosa.partitioner\nprint("imported")\n'
    project = project_with(tmp_path, {"strict.py": script})
    new, served = both(server, project, PY, "strict.py")
    assert (new[0], new[1]) == (served[0], served[1]), served
    assert new[2].splitlines()[-1] == served[2].splitlines()[-1], served
    assert "as a new process (the command turns warnings into errors" in explain(server, project, PY, "strict.py")


def test_a_variable_set_before_importing_torch_after_output_is_a_warning_and_no_record(server, tmp_path):
    """Once the command has written output, the child can no longer back out unseen: it says so and records nothing."""
    script = 'print("starting", flush=True)\nimport os\nos.environ["MY_SETTING"] = "x"\nimport torch\nprint("done")\n'
    project = project_with(tmp_path, {"late.py": script})
    for _ in range(2):
        result = run(server, project, PY, "late.py")
        assert result.returncode == 0 and result.stdout == b"starting\ndone\n", result
        assert b"warning: the command sets MY_SETTING before it imports torch" in result.stderr, result.stderr
    lines = explain(server, project, PY, "late.py")
    assert "in a child of the warm server" in lines and "latest record: none: the command sets MY_SETTING" in lines, lines


def test_ctrl_c_reaches_the_command(server, tmp_path):
    project = project_with(tmp_path, {"wait.py": textwrap.dedent(
        """
        import sys, time
        print("waiting", flush=True)
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(5)
        """)})
    client = subprocess.Popen([sys.executable, "-m", "lowercache.cli", "run", "--", PY, "wait.py"], cwd=project,
                              env=server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert client.stdout.readline() == b"waiting\n"
    time.sleep(0.5)
    os.killpg(client.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the foreground group
    stdout, _ = client.communicate(timeout=60)
    assert client.returncode == 5 and stdout == b"interrupted\n"
    assert "in a child of the warm server" in explain(server, project, PY, "wait.py")


def test_aot_arm_compiler_through_the_server_writes_the_plain_bytes_and_is_recorded(server, tmp_path):
    """ExecuTorch's own script in a child of the server: the plain command's .pte, recorded there, confirmed, replayed; an edit too."""
    from tests.helpers import aot
    from tests.helpers.aot import AOT, PTE

    project, expected = aot.project(tmp_path)
    for outcome in ("recorded", "confirmed", "replayed"):
        result = run(server, project, PY, *AOT)
        assert result.returncode == 0, result.stderr[-2000:]
        assert (project / PTE).read_bytes() == expected, outcome
        assert b"NPU operators" in result.stdout
        if outcome == "recorded":
            assert "in a child of the warm server" in explain(server, project, PY, *AOT)
    assert "latest lookup: hit" in explain(server, project, PY, *AOT)

    aot.write_model(project, "torch.sigmoid")
    edited = aot.plain(project)
    assert edited != expected
    assert run(server, project, PY, *AOT).returncode == 0
    assert (project / PTE).read_bytes() == edited
    lines = explain(server, project, PY, *AOT)
    assert "model.py changed" in lines and "in a child of the warm server" in lines


def test_executorchs_arm_op_tests_with_a_server_have_the_plain_outcomes(server, tmp_path):
    """``python -m pytest`` with a server running: pytest sets ``PYTEST_VERSION`` before its plugins import torch, so the
    child backs out before pytest has printed anything and the tests run as a new process, with the plain outcomes."""
    from tests.helpers import optests
    from tests.helpers.optests import OPS, PYTEST, outcomes

    expected = optests.plain(tmp_path)
    for _ in ("cold", "warm"):
        result = run(server, Path(OPS), *PYTEST)
        assert (result.returncode, outcomes(result)) == (expected.status, expected.outcomes)
        assert ("latest run: ran: as a new process (the command sets PYTEST_VERSION before it imports torch"
                in explain(server, Path(OPS), *PYTEST))


def test_a_child_that_fails_before_the_command_starts_is_declined(server, tmp_path, monkeypatch):
    """A fault in the child before the command's code runs: the server says so, the client runs a new process, nothing ran twice."""
    import json
    import socket

    from lowercache import client, process_state

    project = project_with(tmp_path, {"marker.py": "open('ran', 'w').close()\n"})
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(server.run))
    identity = client.ask({"op": "hello"})["identity"]
    directory = os.open(project, os.O_RDONLY)  # as standard input: the child cannot make a stream of it
    read_end, write_end = os.pipe()
    request = {"op": "exec", "argv": [PY, "marker.py"], "cwd": str(project), "env": dict(server.env), "executable": PY,
               "process": process_state.capture(), "timeout": None, "identity": identity}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(client.private_dir() / client.SOCKET_NAME))
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [directory, write_end, write_end])
        for fd in (directory, write_end):
            os.close(fd)
        replies = sock.makefile("rb")
        reply = {"child": 0}
        while set(reply) <= {"child", "alive"}:  # the child's pid and heartbeats come first
            reply = json.loads(replies.readline())
    os.close(read_end)
    assert "declined" in reply and "could not start the command (IsADirectoryError" in reply["declined"], reply
    assert not (project / "ran").exists()


def test_a_process_the_command_leaves_running_outlives_it_as_it_would_a_new_process(server, tmp_path):
    script = ("import subprocess\n"
              "p = subprocess.Popen(['sleep', '30'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              "open('pid', 'w').write(str(p.pid))\n")
    project = project_with(tmp_path, {"leaves.py": script})
    assert run(server, project, PY, "leaves.py").returncode == 0
    pid = int((project / "pid").read_text())
    try:
        assert alive(pid)
        assert "in a child of the warm server" in explain(server, project, PY, "leaves.py")
    finally:
        os.kill(pid, signal.SIGKILL)


SLOW = """import os, time
open("started", "w").close()
while not os.path.exists("release"):
    time.sleep(0.05)
"""


def test_a_wrapped_command_does_not_wait_for_a_lowering_slot(tmp_path):
    """server_jobs bounds lowerings; a script run by hand would not queue behind another, so a wrapped one does not either."""
    own = Server(tmp_path / "jobs1", LOWERCACHE_SERVER_JOBS="1")
    try:
        own.start()
        project = project_with(tmp_path, {"slow.py": SLOW, "quick.py": "print('done')\n"})
        slow = subprocess.Popen([sys.executable, "-m", "lowercache.cli", "run", "--", PY, "slow.py"], cwd=project, env=own.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_until(lambda: (project / "started").exists(), WAIT)
            # The slow one runs until released: a quick one queued behind it would never end (a timeout, not a pass).
            quick = run(own, project, PY, "quick.py")
            assert quick.stdout == b"done\n" and slow.poll() is None
            assert "in a child of the warm server" in explain(own, project, PY, "quick.py")
        finally:
            (project / "release").touch()
        assert slow.wait(timeout=120) == 0
    finally:
        own.close()


def test_an_unknown_speed_up_is_one_line_and_leaves_the_server_alone(server, tmp_path):
    """``LOWERCACHE_SPEEDUPS`` naming no speed-up is the user's to fix: one line, exit 2, nothing run, and no server
    replaced by one that cannot start (the client used to try, warn, and run the command anyway)."""
    project = project_with(tmp_path, {"script.py": SCRIPT})
    before = server.status()["pid"]
    result = run(server, project, PY, "script.py", LOWERCACHE_SPEEDUPS="all,-nosuch")
    assert result.returncode == 2 and result.stdout == b""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(b"lowercache: error: unknown speed-up 'nosuch'")
    assert not (project / "out.txt").exists()
    lowered = server("lower", "model.py:model", "-t", "tosa-int", "-o", str(tmp_path / "out"), LOWERCACHE_SPEEDUPS="nosuch")
    assert lowered.returncode == 2 and len(lowered.stderr.splitlines()) == 1
    assert lowered.stderr.startswith("lowercache: error: unknown speed-up 'nosuch'") and not (tmp_path / "out").exists()
    assert server.status()["pid"] == before
