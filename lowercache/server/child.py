"""A request's forked child: it becomes the client (directory, environment, `sys.path`, process state, terminal),
then runs the command, a `python` command (`run`), or a background confirmation."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
import warnings
from typing import Any

from .. import process_state, terminal
from ..cache.toolchain import forget_parts
from ..record.recorder import refuse_listening
from ..run import pyexec
from .warm import Warm


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this child when the server dies, so a fallback never races an orphan."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _detach(parent: int, inherited: list[int]) -> None:
    """A forked child's first steps: a process group of its own, death with the server, default signals, none of its descriptors."""
    os.setpgid(0, 0)
    _die_with_parent(parent)
    for number in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in inherited:
        try:
            os.close(fd)
        except OSError:
            pass


def run_cli(message: dict[str, Any], parent: int, out_w: int, err_w: int, inherited: list[int], warm: Warm, started: int) -> int:
    """In the forked child: become the client's process, run the CLI, return its exit code. Never returns into the server.

    ``started`` gets ``S`` once the child has taken the client's place, or ``E``
    and why it could not (a process state it cannot take): the server then
    declines, and the client lowers in its own process.
    """
    _detach(parent, inherited)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in (devnull, out_w, err_w):
        os.close(fd)
    ttys = message.get("tty") or [False, False]
    encodings = message.get("encoding") or ["utf-8", "utf-8"]
    errors = message.get("errors") or ["strict", "backslashreplace"]
    size = (int(message.get("columns") or 0), int(message.get("lines") or 0))
    files = [[(dev, ino) for dev, ino in f] for f in message.get("files") or [[], []]]
    sys.stdout = terminal.Relayed(1, ttys[0], size, encodings[0], errors[0], line_buffering=ttys[0], files=files[0])
    sys.stderr = terminal.Relayed(2, ttys[1], size, encodings[1], errors[1], line_buffering=True, files=files[1])
    try:
        _become_client(message, warm)
        pyexec.reseed()  # as a new process: an unseeded factory draws afresh, so a confirmation can tell
    except BaseException as e:  # noqa: BLE001
        os.write(started, b"E" + _why_not_started(e, "the lowering").encode()[:4000])
        return 1
    os.write(started, b"S")
    os.close(started)
    try:
        from .. import cli
        from ..errors import new_command

        new_command(message.get("warned") or ())  # the server's own warnings were its own; the client's are said
        code: object = cli.run_in_process(list(message.get("argv") or []))
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    return code or 0


def confirm(message: dict[str, Any], parent: int, inherited: list[int], warm: Warm) -> int:
    """In the forked child: become the request's client again and settle its direct-mode record, as its re-run
    would (``direct.confirm``), without lowering. Nothing reaches the client; a fault goes to the server's log."""
    _detach(parent, inherited)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)
    try:
        _become_client(message, warm)
        pyexec.reseed()
        from ..errors import new_command
        from ..lowerer import confirm as confirm_record

        new_command()
        said = confirm_record([str(a) for a in message["argv"]])
    except BaseException as e:  # noqa: BLE001 - the record stays unconfirmed; the next run confirms it as before
        said = f"failed ({type(e).__name__}: {e})"
    print(f"lowercache server: background confirmation of {message.get('cwd')}: lower {' '.join(message['argv'][1:])}: {said}",
          file=sys.stderr, flush=True)
    return 0


def run_python(message: dict[str, Any], parent: int, fds: list[int], inherited: list[int], warm: Warm, started: int) -> int:
    """In the forked child: be the new ``python`` process ``lowercache run`` would have started (``run/pyexec.py``).

    ``started`` gets ``S`` just before the command's own code runs. A fault
    before that writes ``E`` and why, and the client runs the command as a
    new process instead: nothing of the command has run.
    """
    try:
        _detach(parent, inherited)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        invocation = pyexec.parse([str(a) for a in message["argv"]])
        assert invocation is not None and warm.base_path is not None  # checked by _cannot_exec before the fork
        pyexec.streams(invocation.unbuffered)
        _become_client(message, warm)
    except BaseException as e:  # noqa: BLE001
        os.write(started, b"E" + _why_not_started(e, "the command").encode()[:4000])
        return 1
    dump = None
    try:  # what lowercache/run/_site/sitecustomize.py does in a new process, with the server's imports' reads added to the record
        from ..errors import show_warnings_in_one_line
        from ..run.hook import activate_in_process
        from ..run.replay import record_in_process

        dump = record_in_process(at_exit=False, warm={"env": warm.read_env, "lookups": warm.lookups})
        show_warnings_in_one_line()
        activate_in_process()
    except Exception as e:  # noqa: BLE001 - as in a new process: never break the wrapped program
        print(f"lowercache: warning: caching is off for this process ({e})", file=sys.stderr)

    def back_out(why: str) -> None:
        """Nothing of the command has been seen: the server declines, and the client runs it as a new process."""
        os.write(started, b"D" + f"the command {why}".encode()[:4000])
        os._exit(0)

    def too_late(why: str) -> None:
        print(f"lowercache: warning: the command {why}; it ran in the server's child, which may differ from a new process (--no-server "
              "runs one), and is not recorded", file=sys.__stderr__, flush=True)
        refuse_listening(why)

    def now_started() -> None:
        os.write(started, b"S")  # the pipe stays open: the child may still back out (``ImportWatch``)
        pyexec.ImportWatch(back_out, too_late).install()

    return pyexec.run(invocation, [str(a) for a in message["argv"]], str(message["executable"]), warm.base_path,
                      warm.installed, dump, now_started)


def _why_not_started(error: BaseException, what: str) -> str:
    """Why a child could not start ``what``, in the words the client's warning (or ``run --explain``) shows."""
    if isinstance(error, process_state.Unadoptable):
        return f"the server's child cannot take the client's {error}"
    return f"the server's child could not start {what} ({type(error).__name__}: {error})"


def _become_client(message: dict[str, Any], warm: Warm) -> None:
    """The client's working directory, environment, import path, process state and thread count (its terminal is in the
    child's streams: ``terminal.py``).

    Raises :class:`process_state.Unadoptable` for a part of the client's
    process state this child cannot take (the request is then declined).
    """
    import torch

    os.chdir(message["cwd"])
    env = message.get("env") or {}
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})  # exactly the client's: its terminal is in its streams (terminal.py)
    if message.get("op") != "exec":  # a wrapped command's path and arguments are pyexec's
        sys.path[:] = [str(p) for p in message.get("path") or sys.path]
        sys.argv = ["lowercache", *map(str, message.get("argv") or [])]
    wanted = message["process"]
    process_state.adopt(wanted)
    torch.set_num_threads(_thread_count(process_state.thread_default(warm.threads, warm.cpus, len(wanted["cpus"]))))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("500")  # under memory pressure the kernel takes a request, not the server
    except OSError:
        pass
    # Keys are of the installed code there now: a module the warm-up did not import is imported from it (a change to one
    # it did import stops the server first: loop.py).
    forget_parts()
    # warnings the warm-up raised would count as already shown; a new process shows them again
    warnings.onceregistry.clear()
    warnings._filters_mutated()


def _thread_count(default: int) -> int:
    """What torch (an MKL build) starts with in a new process: MKL_NUM_THREADS, else OMP_NUM_THREADS, at most the default."""
    for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), default)
    return default
