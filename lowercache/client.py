"""The client of the warm lowering server (:mod:`lowercache.server`): imports no torch.

A new ``lowercache lower`` process spends seconds importing torch and
ExecuTorch's Arm backend before the cache is even asked. The client sends the
command line instead to a server that has them imported and warmed up, which
runs it in a child forked for the request, and relays the child's output and
exit code. The first client that needs a server starts one (as sccache does);
a server whose identity (versions, lowercache's sources, python, server
settings) differs from the client's is replaced, not reused. When no server
can be reached, or it dies mid-request, the client says so in one warning
line and the command runs in this process.

Safety: a Unix socket in a directory only its owner can enter, JSON lines
both ways (never pickle), and each side checks the other's uid (SO_PEERCRED).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from . import startup, sweep
from .process_state import capture as capture_process_state
from .config import Settings, load_settings
from .errors import LowercacheError, interrupted, warnings_shown

# Commands that import torch, so a warm server pays; the rest are cheap and stay in the client.
SERVED = ("lower", "verify")
SOCKET_NAME = "server.sock"
WARMING = "warming"  # beside the socket while the server warms up for a family: its pid (loop.py, Server._warm)
MAX_LINE = 64 * 2**20  # a reply frame bigger than this is a broken server, not output
START_TIMEOUT = 300.0  # imports and warm-up are slow on a loaded machine
HELLO_TIMEOUT = 10.0  # seconds a server may take to answer hello, status or stop (it answers in milliseconds)
# While a request runs the server sends a heartbeat frame every HEARTBEAT seconds; a client that hears nothing for
# SILENT_LIMIT, or finds the server's process stopped (SIGSTOP, a debugger), says it is not responding.
HEARTBEAT = 2.0
SILENT_LIMIT = 30.0
_POLL = 1.0  # seconds between looks at the server's process while waiting for it
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class ServerUnavailable(Exception):
    """No server can be reached or started; the command runs in this process."""


class Declined(Exception):
    """The server's interpreter would answer this request otherwise than the client's own (``startup.why_not``)."""


class ServerLost(Exception):
    """The server went away during a request."""


class ServerRefused(ServerLost):
    """The server answered with an error instead of running the request (a request it could not take)."""


class ServerNotResponding(ServerUnavailable):
    """The server's process is stopped, or sent nothing within its deadline."""


def warn(message: str) -> None:
    """One warning line, as lowercache's logger prints them."""
    print(f"lowercache: warning: {message}", file=sys.stderr, flush=True)


def socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/lowercache``, else ``<tmp>/lowercache-<uid>``: per user, never shared."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "lowercache"
    return Path(tempfile.gettempdir()) / f"lowercache-{os.getuid()}"


def private_dir() -> Path:
    """The socket directory, created 0700; refused unless it is a real directory of ours that nobody else can enter."""
    path = socket_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ServerUnavailable(f"cannot use {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ServerUnavailable(
            f"{path} is not a directory only you can enter (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})"
        )
    sock = path / SOCKET_NAME
    if len(os.fsencode(sock)) > 107:
        raise ServerUnavailable(f"socket path {sock} is too long for a Unix socket")
    return path


def package_digest() -> str:
    """Digest of every lowercache source file: a server running other code (the CLI or the server included) is stale."""
    from .cache.toolchain import source_digest

    return source_digest(_PACKAGE_DIR)


def identity(settings: Settings) -> dict[str, Any]:
    """What a server must share with its client to answer it as a new process would; found without importing torch."""
    from .cache.toolchain import version

    return {
        "lowercache": version("lowercache"),
        "lowercache_src": package_digest(),
        "torch": version("torch"),
        "executorch": version("executorch"),
        "startup": startup.state(),
        "idle_timeout": settings.server_idle_timeout,
        "jobs": settings.server_jobs,
    }


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    return _peer(sock)[1]


def _peer(sock: socket.socket) -> tuple[int, int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def process_state(pid: int) -> tuple[str, int, int] | None:
    """A process's state letter, parent pid and, once it is a zombie, its wait status (``/proc/PID/stat``); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[49]) if len(fields) > 49 else 0


def _check_alive(pid: int, silent: float, limit: float) -> None:
    """ServerNotResponding when the server's process is stopped, or has said nothing for ``limit`` seconds (up to
    ``START_TIMEOUT`` while it says it is warming up for a family: it answers once that is done)."""
    state = process_state(pid)
    if state is not None and state[0] in ("T", "t"):
        raise ServerNotResponding(f"the lowering server (pid {pid}) is not responding (its process is stopped)")
    if silent > limit and not (silent < START_TIMEOUT and warming(pid)):
        raise ServerNotResponding(f"the lowering server (pid {pid}) is not responding (nothing from it for {limit:.0f} s)")


def warming(pid: int) -> bool:
    """Whether the server ``pid`` says it is warming up for a family between requests (its ``WARMING`` file)."""
    try:
        return (socket_dir() / WARMING).read_text() == str(pid)
    except (OSError, UnicodeDecodeError):
        return False


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def frames(sock: socket.socket, on_interrupt: Callable[[], None] | None = None, limit: float = SILENT_LIMIT) -> Iterator[dict[str, Any]]:
    """JSON objects, one a line, until the other end closes; ``on_interrupt``: called on Ctrl-C while waiting, which goes on.

    Raises ServerNotResponding when the server's process is stopped or sends
    nothing for ``limit`` seconds (a running request gets a heartbeat every
    ``HEARTBEAT`` seconds), so a paused or hung server never hangs the client.
    """
    buffer = b""
    server = _peer(sock)[0]
    sock.settimeout(_POLL)
    heard = time.monotonic()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            _check_alive(server, time.monotonic() - heard, limit)
            continue
        except KeyboardInterrupt:
            if on_interrupt is None:
                raise
            on_interrupt()
            continue
        heard = time.monotonic()
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ServerLost("a reply that is not a JSON object")
            yield message
        if len(buffer) > MAX_LINE:
            raise ServerLost("a reply line over the size limit")


def _connect(path: Path, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
        if peer_uid(sock) != os.getuid():
            raise ServerUnavailable(f"the server at {path} belongs to another user")
    except BaseException:
        sock.close()
        raise
    return sock


def ask(message: dict[str, Any], timeout: float = HELLO_TIMEOUT) -> dict[str, Any] | None:
    """One request, one reply; None when no server answers, ServerNotResponding when one is there but stopped or silent."""
    path = private_dir() / SOCKET_NAME
    _check_socket_path(path)
    try:
        sock = _connect(path, timeout)
    except OSError:
        return None
    with sock:
        try:
            send(sock, message)
            return next(frames(sock, limit=timeout), None)
        except (OSError, ValueError, ServerLost):
            return None


def _check_socket_path(path: Path) -> None:
    """ServerUnavailable when a directory holds the socket path: a server would warm up for seconds, then fail to bind."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):  # another file there a server replaces; a directory it cannot
        raise ServerUnavailable(f"{path} is a directory, so no server can listen there; remove it to use the server")


@contextlib.contextmanager
def _start_lock(directory: Path, timeout: float) -> Iterator[None]:
    """One client at a time starts or replaces the server."""
    with open(directory / "start.lock", "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerUnavailable("timed out waiting for another client starting the server") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _gone(pid: int) -> bool:
    """Whether the process has exited: no such process, or a zombie. The server's parent, the ``server start`` that
    spawned it, is gone, so the init process reaps it: one that reaps late (a container's) kept ``server stop``
    waiting seconds after the server had exited, or its whole timeout where nothing reaps."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] == "Z"
    except (OSError, IndexError):  # no /proc (macOS): alive, as kill says; reaped meanwhile: the next look says so
        return False


def ensure_server(settings: Settings) -> dict[str, Any]:
    """A running server with the client's identity: the one there, or a new one (replacing a stale one). Its hello reply."""
    want = identity(settings)
    directory = private_dir()
    hello = ask({"op": "hello"})
    if hello is not None and hello.get("identity") == want:
        return hello
    with _start_lock(directory, START_TIMEOUT):
        hello = ask({"op": "hello"})
        if hello is not None and hello.get("identity") == want:
            return hello
        if hello is not None:
            ask({"op": "stop"})  # it frees the socket path at once and finishes its accepted requests on its own
        return _spawn(directory, want)


def warm_server(targets: list[str]) -> list[str]:
    """Have the running server warm the families of ``targets`` now (seconds each); the families it is warm for."""
    reply = ask({"op": "warm", "targets": list(targets)}, timeout=START_TIMEOUT)
    if reply is None or "warm" not in reply:
        raise ServerUnavailable(f"the server did not warm up for {', '.join(targets)}: {(reply or {}).get('error', 'no reply')}")
    return list(reply["warm"])


def _tracer() -> int:
    """The pid of the process tracing this one (a debugger, ``strace``, a recording's backstop), 0 when none."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _spawn(directory: Path, want: dict[str, Any]) -> dict[str, Any]:
    """Start ``lowercache.server`` detached, with this lowercache on its path; wait until it answers.

    Not from a traced process: the server would stay traced (and, under a recording's backstop, filtered) for its
    whole life, and no record its children make could be watched below Python.
    """
    tracer = _tracer()
    if tracer:
        raise ServerUnavailable(f"this process is traced (by pid {tracer}), and a server started from it would be too")
    if sys.stderr.isatty():  # at a terminal, say what the wait is (a CI log gets the command's own lines only)
        print("lowercache: starting the lowering server (torch and the Arm backend are imported once: 10-30 s)",
              file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    log = directory / "server.log"
    code = f"import sys; sys.path.insert(0, {os.path.dirname(_PACKAGE_DIR)!r}); from lowercache.server import main; main()"
    with open(log, "w") as f:
        process = subprocess.Popen(
            [sys.executable, *startup.interpreter_args(), "-c", code], stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd="/", env=env, start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        hello = ask({"op": "hello"})
        if hello is not None and hello.get("pid") == process.pid:
            if hello.get("identity") != want:
                raise ServerUnavailable("the server started with another identity (lowercache changed during start-up?)")
            return hello
        status = process.poll()
        if status is not None:
            raise ServerUnavailable(f"the server exited during start-up with status {status}; see {log}")
        time.sleep(0.1)
    process.kill()
    raise ServerUnavailable(f"the server did not start within {START_TIMEOUT:.0f} s; see {log}")


def stop_server(timeout: float = 30.0) -> dict[str, Any] | None:
    """Ask the server to stop (it finishes accepted requests) and wait for it to exit; its reply, or None if none ran."""
    reply = ask({"op": "stop"})
    if reply is not None and isinstance(reply.get("pid"), int):
        reply["exited"] = _wait_gone(reply["pid"], timeout)
    return reply


def _terminal() -> dict[str, Any]:
    """What the child needs to print as this process would: encodings, terminal kind and size."""
    ttys = [sys.stdout.isatty(), sys.stderr.isatty()]
    size = shutil.get_terminal_size((0, 0)) if any(ttys) else os.terminal_size((0, 0))
    return {
        "tty": ttys,
        "columns": size.columns,
        "lines": size.lines,
        "encoding": [sys.stdout.encoding, sys.stderr.encoding],
        "errors": [sys.stdout.errors, sys.stderr.errors],
        "files": [[list(f) for f in files][:sweep.MAX_STREAM_FILES] for files in sweep.streams_written()],
    }


class _Running:
    """A request the server runs: the child it forked for it (its first frame says which), and whether Ctrl-C was passed on."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.server = _peer(sock)[0]
        self.child = 0
        self.interrupted = False

    def interrupt(self) -> None:
        """Ctrl-C: the child, in another session, gets SIGINT as a new process would (its own clean-up then runs)."""
        if self.interrupted:
            raise KeyboardInterrupt  # a second Ctrl-C: give up; the server kills the child when the connection closes
        self.interrupted = True
        try:
            send(self.sock, {"op": "signal"})
        except OSError:
            raise KeyboardInterrupt from None

    def own_child(self) -> tuple[str, int, int] | None:
        """The child's state, when it is still the server's child (not a reused pid)."""
        state = process_state(self.child) if self.child else None
        return state if state is not None and state[1] == self.server else None

    def kill_child(self) -> None:
        """A server that stopped responding cannot reap or kill its child: this client does, before running the command itself."""
        if self.own_child() is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.child, signal.SIGKILL)


def _relay(running: _Running) -> int:
    """Write the child's output where this process would have, and return its exit code."""
    streams = {1: sys.stdout, 2: sys.stderr}
    for frame in frames(running.sock, on_interrupt=running.interrupt):
        if "b64" in frame:
            stream = streams.get(frame.get("fd"), sys.stderr)
            data = base64.b64decode(frame["b64"])
            raw = getattr(stream, "buffer", None)
            if raw is None:  # a stream replaced by text-only (a test's capture)
                stream.write(data.decode(stream.encoding or "utf-8", "replace"))
            else:
                stream.flush()
                raw.write(data)
                raw.flush()
        elif "child" in frame:
            running.child = int(frame["child"])
        elif "exit" in frame:
            if frame.get("error"):
                print(f"lowercache: error: {frame['error']}", file=sys.stderr, flush=True)
            return int(frame["exit"])
        elif "stale" in frame:
            raise ServerUnavailable("stale")
        elif "declined" in frame:
            raise Declined(str(frame["declined"]))
        elif "error" in frame:
            raise ServerRefused(str(frame["error"]))
    raise ServerLost("the server closed the connection")


def exec_through_server(argv: list[str], env: dict[str, str], executable: str, fds: list[int],
                        settings: Settings) -> tuple[int | None, str]:
    """Run a ``python`` command in a child of the warm server, writing to ``fds`` (its descriptors 0-2); for ``lowercache run``.

    Returns the command's exit status (negative for a signal, as
    ``subprocess`` gives it), or None and why when it has to run as a new
    process: no server, or one that cannot stand in for a new interpreter
    here (``startup.why_not``). Ctrl-C is passed on to the command.
    """
    if not settings.server or not hasattr(socket, "SO_PEERCRED"):
        return None, "the server is off"
    request = {"op": "exec", "argv": argv, "cwd": os.getcwd(), "env": env, "executable": executable,
               "process": capture_process_state(), "timeout": None}
    sock = _connected(settings, request, "running the command as a new process")
    if sock is None:
        return None, "no server"
    with sock:
        running = _Running(sock)
        try:
            line = json.dumps(request).encode() + b"\n"
            sent = socket.send_fds(sock, [line], fds)
            if sent < len(line):
                sock.sendall(line[sent:])
            # the command runs in another session: a Ctrl-C here is passed on to it
            frame: dict[str, Any] | None = {"child": 0}
            replies = frames(sock, on_interrupt=lambda: send(sock, {"op": "signal"}))
            while frame is not None and set(frame) <= {"child", "alive"}:
                running.child = int(frame.get("child") or running.child)
                frame = next(replies, None)
            if frame is None:
                raise ServerLost("the server closed the connection")
        except ServerNotResponding as e:
            if not running.child:  # not forked: nothing of the command ran
                warn(f"{e}; running the command as a new process")
                return None, "the server is not responding"
            warn(f"{e}; waiting for the command it started (pid {running.child})")
            return _wait_orphaned(running), ""
        except (ServerLost, OSError, ValueError) as e:
            warn(f"the lowering server stopped during the command ({e}); running it as a new process")
            return None, "the server stopped"
    if "declined" in frame:
        return None, str(frame["declined"])
    if "exit" in frame:
        return int(frame["exit"]), ""
    if "error" in frame:
        return None, f"the server refused it ({frame['error']})"
    return None, "the server was being replaced"


def _wait_orphaned(running: _Running) -> int:
    """The status of a command whose server stopped responding: read from ``/proc`` once its process is a zombie.

    The command may have done part of its work, so it is never run again:
    its own status is the answer (Ctrl-C reaches it directly).
    """
    while True:
        try:
            state = running.own_child()
            if state is None:
                return 1  # reaped: the server woke, but this connection is given up; its status is lost
            if state[0] == "Z":
                return os.waitstatus_to_exitcode(state[2])
            time.sleep(0.1)
        except KeyboardInterrupt:
            with contextlib.suppress(OSError):
                os.killpg(running.child, signal.SIGINT)


def _connected(settings: Settings, request: dict[str, Any], fallback: str) -> socket.socket | None:
    """A connection to a current server (started if need be), its identity put in ``request``; None, with a warning, if none."""
    try:
        hello = ensure_server(settings)
        request["identity"] = hello["identity"]
        return _connect(private_dir() / SOCKET_NAME, 10.0)
    except ServerNotResponding as e:
        warn(f"{e}; {fallback}")
        return None
    except Exception as e:  # noqa: BLE001  (whatever keeps the server away, the command still runs)
        warn(f"no lowering server ({e}); {fallback}")
        return None


def check_speedups(settings: Settings) -> None:
    """LowercacheError unless the speedups setting names only known speed-ups (a server given another fails its start)."""
    if settings.speedups != "all":  # the default, without importing the registry
        from .speedups.registry import parse

        parse(settings.speedups)


def run_through_server(args: list[str]) -> int | None:
    """Run the command line in a child of the warm server; its exit code, or None to run it in this process."""
    options = args[: args.index("--") if "--" in args else len(args)]
    if "--no-server" in options or "--help" in options:  # help never needs the server (it would start one)
        return None
    if not hasattr(socket, "SO_PEERCRED"):
        return None  # no way to check the peer's uid (not Linux): no server
    try:
        settings = load_settings()
    except LowercacheError:
        return None  # the in-process path reports a bad setting in its one line
    if not settings.server:
        return None
    try:
        check_speedups(settings)
    except LowercacheError:
        return None  # the in-process path reports it in its one line
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    request = {
        "op": "run",
        "argv": args,
        "cwd": cwd,
        "env": dict(os.environ),
        "path": list(sys.path),
        "process": capture_process_state(),
        "timeout": settings.server_timeout,
        "confirm": settings.server_confirm,
        "warned": warnings_shown(),  # by direct mode's lookup here: the child does not say them again
        **_terminal(),
    }
    for attempt in range(2):
        try:
            sock = _connected(settings, request, "running in this process")
        except KeyboardInterrupt:
            return interrupted()
        if sock is None:
            return None
        with sock:
            running = _Running(sock)
            try:
                send(sock, request)
                return _relay(running)
            except ServerNotResponding as e:  # a lowering writes its output atomically: running it again here is safe
                running.kill_child()
                warn(f"{e}; running in this process")
                return None
            except ServerUnavailable:
                continue  # replaced between hello and request: once more
            except Declined as e:
                warn(f"the lowering server cannot stand in for this interpreter ({e}); running in this process")
                return None
            except KeyboardInterrupt:  # a second Ctrl-C: the server kills the request's process when this connection closes
                return interrupted()
            except ServerRefused as e:
                warn(f"the lowering server refused the request ({e}); running in this process")
                return None
            except (ServerLost, OSError, ValueError) as e:
                warn(f"the lowering server stopped during the request ({e}); running in this process")
                return None
    warn("the lowering server kept being replaced; running in this process")
    return None
