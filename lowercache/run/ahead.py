"""Run ahead: while a script under ``lowercache run`` does its strict export, a copy of it goes on from a non-strict one and fills the cache.

ExecuTorch's aot_arm_compiler exports strictly (dynamo) by default, and a
strict export costs several times what the non-strict trace does (docs/run.md
has figures). The steps after it are keyed on their own inputs, and once the
quantized model the two reach is exported again, laid out as the script's
strict re-export is, they reach the partitions' TOSA lowering and Vela with
the same keys (the benchmark's models do).

So at the script's first strict export of a module of its own, the process
forks. The parent is the script and goes on as stock. The child, the
*runner*, takes that one export non-strict and then does what the script
does, on the machine's other core, storing what it computes. Its strict
re-export of the quantized model is a non-strict one laid out as dynamo's
(``reexport.laid_out_as_strict``, a fraction of dynamo's cost). When the
script reaches a step the runner has started, it waits for the runner's
entry instead of computing it again (while the runner's CPU time moves); a
step the runner has not started, the script computes itself.

Why it is exact: the runner stores entries only under the keys of its own
steps' inputs, atomically, as any process sharing the cache does, and the
script takes one only when its own step has that key, checked as any entry
is. The runner keeps the script's thread count: calibration's float results
depend on it, so a runner on one thread would reach other keys.

Why it leaves no trace but cache entries:

- before it runs another line of the script, every descriptor it inherited
  that can write or talk (standard streams, pipes, sockets, terminals, files
  open for writing) is pointed at ``/dev/null``;
- the kernel (Landlock) then lets it create or change files only under the
  cache directory and a scratch directory of its own, bind or connect no TCP
  port, and signal no process outside itself: a write elsewhere fails in
  the runner (and usually ends it), never reaching the file;
- it ends at a Unix socket or a new process (Python's audit events), and
  uses the local cache only, through connections of its own: the script's
  are closed before the fork (``store.close_for_fork``; SQLite's state must
  not cross a fork), and each side reopens its own;
- it exits (``os._exit``) at ``to_executorch``, at the script's end or
  failure, without running the script's or lowercache's exit handlers, and
  is killed when the script ends.

Without Landlock ABI 3 (not Linux, or a kernel older than 6.2), with one
core, no cache or a read-only one, another Python thread alive, or with
``run_ahead = false``, nothing runs ahead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import os
import select
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..record.recorder import PROCESSES

log = logging.getLogger("lowercache")

# Seconds the script waits for a runner whose CPU time does not move before it computes the step itself.
STALL_SECONDS = 1.0
# The runner's nice value, the lowest priority: it is speculative work, and takes only a core nothing else wants. Under the
# backstop (record/backstop.py) each path call of the script waits for the tracer process; at the script's priority the
# runner, busy on the other core, made the tracer wait for a time slice at each of them.
RUNNER_NICE = 19
# The runner's scratch directory, in the temporary directory: lowercache's own, never the script's output.
SCRATCH_PREFIX = "lowercache-runahead-"

_state: dict[str, Any] = {}  # "forked": a runner was tried here; "ahead": True in the runner
_forking = threading.local()


@contextlib.contextmanager
def _unheard() -> Any:
    """The command's recorder does not hear this thread in the block: the fork, and the runner's scratch directory."""
    _forking.on = True
    try:
        yield
    finally:
        _forking.on = False


def unrecorded() -> bool:
    """Whether the command's recorder must not hear this thread: it is forking the runner (or making or removing its
    scratch directory), or it is the runner."""
    return getattr(_forking, "on", False) or bool(_state.get("ahead"))


def runner_pid() -> int | None:
    """The runner this process forked, if any: lowercache's, not the script's (the backstop below Python sees it)."""
    return _state.get("runner")


def running_ahead() -> bool:
    """Whether this process is a runner."""
    return bool(_state.get("ahead"))


# -- Landlock, through its three system calls (the same numbers on every architecture) -------------------

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_PDEATHSIG = 38, 1
# Filesystem rights that change something (reading and executing stay open), by the ABI that added them.
_WRITE_FILE, _TRUNCATE = 1 << 1, 1 << 14
_FS_RIGHTS = {1: sum(1 << i for i in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12)), 2: 1 << 13, 3: _TRUNCATE}
_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect (ABI 4)
_SCOPES = (1 << 0) | (1 << 1)  # abstract Unix sockets, signals (ABI 6)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when there is none."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        found = _libc().syscall(ctypes.c_long(_CREATE_RULESET), None, ctypes.c_long(0),
                                ctypes.c_long(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(found), 0)


def confine(writable: list[str]) -> None:
    """Let this process (and what it starts) create or change files only under ``writable``, use no TCP and signal no one outside."""
    libc = _libc()
    abi = landlock_abi()
    if abi < 3:
        raise OSError("Landlock ABI 3 or later is needed")
    fs = sum(rights for version, rights in _FS_RIGHTS.items() if version <= abi)
    attr = _RulesetAttr(fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    ruleset = libc.syscall(ctypes.c_long(_CREATE_RULESET), ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr)),
                           ctypes.c_long(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path in [*writable, os.devnull]:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rights = fs if os.path.isdir(path) else fs & (_WRITE_FILE | _TRUNCATE)
                rule = _PathBeneath(rights, fd)
                if libc.syscall(ctypes.c_long(_ADD_RULE), ctypes.c_long(ruleset), ctypes.c_long(_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_long(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(ctypes.c_long(_RESTRICT_SELF), ctypes.c_long(ruleset), ctypes.c_long(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def silence_descriptors(keep: tuple[int, ...] = ()) -> None:
    """Point every inherited descriptor that can write or talk at /dev/null (files open only for reading stay)."""
    import fcntl

    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == null or fd in keep:
            continue
        try:
            mode = os.fstat(fd).st_mode
            reading = (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) == os.O_RDONLY
        except OSError:
            continue  # the listing's own descriptor, closed since
        if (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and reading:
            continue
        os.dup2(null, fd, inheritable=os.get_inheritable(fd))
    os.close(null)


# -- the parent's side -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Runner:
    """The parent's view of its runner: which step keys it has started and stored."""

    pid: int
    fd: int
    scratch: str
    started: set[str] = dataclasses.field(default_factory=set)
    stored: set[str] = dataclasses.field(default_factory=set)
    ended: bool = False
    _partial: bytes = b""

    def _drain(self) -> None:
        while not self.ended:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.ended = True
                return
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                text = line.decode("ascii", "replace")
                (self.started if text.startswith("+") else self.stored).add(text[1:])

    def _cpu_ticks(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            return None

    def wait(self, key: str) -> bool:
        """Wait while the runner computes ``key``; whether the store may now hold it (look again)."""
        self._drain()
        if key in self.stored:
            return True
        if key not in self.started or self.ended:
            return False
        ticks, since = self._cpu_ticks(), time.monotonic()
        while True:
            readable, _, _ = select.select([self.fd], [], [], 0.2)
            if readable:
                self._drain()
            if key in self.stored or self.ended:
                return True
            now = self._cpu_ticks()
            if now is None:
                return True
            if now != ticks:
                ticks, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_SECONDS:
                log.debug("run ahead: the runner made no progress; computing %s here", key)
                return False

    def computing(self, key: str) -> None:
        pass

    def finished(self, key: str) -> None:
        pass

    def stop(self) -> None:
        """Kill the runner, reap it and remove its scratch directory."""
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with _unheard():
            shutil.rmtree(self.scratch, ignore_errors=True)


# -- the runner's side -------------------------------------------------------------------------------------


class _Announcer:
    """The runner's half of the pipe: which step it starts computing and which it has stored."""

    def __init__(self, fd: int):
        self.fd = fd

    def wait(self, key: str) -> bool:
        return False

    def _say(self, line: str) -> None:
        try:
            os.write(self.fd, line.encode("ascii") + b"\n")
        except OSError:
            os._exit(0)  # the script has gone, or stopped reading: it will not wait for this runner

    def computing(self, key: str) -> None:
        self._say("+" + key)

    def finished(self, key: str) -> None:
        self._say("=" + key)


def _exit_now(*args: Any, **kwargs: Any) -> None:
    os._exit(0)


# What the runner never does for the script: Landlock keeps its files and TCP in, these (a Unix socket, a process) it ends on.
_ENDS_RUNNER = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", *PROCESSES})


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _ENDS_RUNNER:
        os._exit(0)


def _become_runner(session: Any, write_fd: int, scratch: str, parent: int) -> None:
    """Turn this forked child into a runner; exits the process if it cannot be one safely."""
    from ..cache import steps
    from ..cache.tiers import open_store
    from ..config import load_settings

    _state["ahead"] = True
    try:
        libc = _libc()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(0)
        os.nice(RUNNER_NICE)
        atexit.register(_exit_now)  # runs before every exit handler registered earlier: the script's and lowercache's
        silence_descriptors(keep=(write_fd,))
        cache_dir = os.path.realpath(session.store.directory)
        confine([cache_dir, scratch])
        tempfile.tempdir = scratch
        os.environ["TMPDIR"] = scratch
        _stop_at_to_executorch()
        sys.addaudithook(_audit)
        settings = dataclasses.replace(load_settings(), remote=None, cache_dir=Path(cache_dir))
        _state["inherited_store"] = session.store  # kept, never finalized here: its remote tier is the script's
        session.store = open_store(settings)
        steps.set_ahead(_Announcer(write_fd))
    except BaseException:  # noqa: BLE001 - a runner that cannot be made safely is none
        os._exit(0)


def _stop_at_to_executorch() -> None:
    """The runner has nothing to store after ``to_edge_transform_and_lower``: it exits where ``to_executorch`` starts."""
    module = sys.modules.get("executorch.exir.program._program")
    if module is not None:
        module.EdgeProgramManager.to_executorch = _exit_now


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fork(session: Any) -> bool:
    """Start a runner, once per process; True in the runner, False in the script (or when none was started)."""
    import fcntl

    from ..cache import steps
    from ..cache.store import close_for_fork
    from ..config import load_settings

    if _state.get("forked") or running_ahead():
        return False
    _state["forked"] = True
    store = getattr(session, "store", None)
    try:
        if (store is None or not store.writable or not load_settings().run_ahead or _cores() < 2
                or landlock_abi() < 3):
            return False
    except Exception:  # noqa: BLE001 - a setting that cannot be read: the command reports it elsewhere
        return False
    # No SQLite connection may cross the fork (store.close_for_fork): another thread's would stay open.
    if threading.active_count() > 1 or not close_for_fork():
        return False
    with _unheard():  # the scratch directory is lowercache's, never the script's output (TMPDIR may be in the project)
        scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 1 << 20)  # room for every announcement the script has not read yet
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # what the script printed so far is printed once, by the script
    try:
        with _unheard():
            pid = os.fork()
    except OSError as e:
        os.close(read_fd)
        os.close(write_fd)
        with _unheard():
            shutil.rmtree(scratch, ignore_errors=True)
        log.debug("run ahead: cannot fork (%s)", e)
        return False
    if pid == 0:
        os.close(read_fd)
        os.set_blocking(write_fd, False)  # a full pipe ends the runner (_say) rather than blocking it
        _become_runner(session, write_fd, scratch, parent)
        return True
    _state["runner"] = pid
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    runner = Runner(pid=pid, fd=read_fd, scratch=scratch)
    steps.set_ahead(runner)
    atexit.register(_stop, runner)
    return False


def _stop(runner: Runner) -> None:
    from ..cache import steps

    steps.set_ahead(None)
    runner.stop()
