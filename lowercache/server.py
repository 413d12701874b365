"""The warm lowering server: torch, ExecuTorch's Arm backend, the quantizer and Vela imported and warmed up once.

Started by the first client that needs it (:mod:`lowercache.client`), or by
``lowercache server start``. Each request runs in a child forked from the
warm process: the child takes the client's working directory, environment,
``sys.path`` and terminal, runs the CLI exactly as a new process would
(:func:`lowercache.cli.commands.run_in_process`), and its stdout and stderr are
relayed to the client as JSON frames. The server never imports user code, so
every child imports the model file (and the modules it imports) fresh. A
child that crashes, hangs past the request timeout or is killed for memory
takes only its request with it.

One thread, one selector: forking from a process whose other threads may
hold locks can hang the child, and torch's intra-op pool is kept at one
thread in the server for the same reason (each child gets the client's
thread count back).
"""

from __future__ import annotations

import base64
import codecs
import collections
import contextlib
import ctypes
import errno
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import client, direct, environment, process_state, startup, terminal
from .cache.digests import stat_key
from .config import MAX_SECONDS, load_settings
from .run import pyexec

_PR_SET_PDEATHSIG = 1
# Seconds without a request before the server confirms new direct-mode records in the background (``_confirm_next``),
# and how many ``lower`` commands it keeps to confirm.
CONFIRM_AFTER = 1.0
MAX_UNCONFIRMED = 64


class _Request:
    """One client connection: its request, and the child running it."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.inbox = b""
        self.outbox = bytearray()
        self.message: dict[str, Any] | None = None
        self.pid = 0
        self.pidfd = -1
        self.pipes: dict[int, int] = {}  # read end -> the client's fd it carries (1 or 2)
        self.deadline: float | None = None
        self.timed_out = False
        self.close_when_sent = False
        self.gone = False
        self.fds: list[int] = []  # an exec request's descriptors 0-2, passed by the client (SCM_RIGHTS)
        self.started = -1  # the child writes S here once the command starts, or E and why it could not

    @property
    def execs(self) -> bool:
        """A wrapped ``python`` command (``lowercache run``), not a lowercache command line."""
        return bool(self.message) and self.message.get("op") == "exec"

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this child when the server dies, so a fallback never races an orphan."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _signal_error(status: int) -> str:
    number = -status
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    why = " (out of memory?)" if number == signal.SIGKILL else ""
    return f"the lowering process was killed by {name}{why}; the server is still up"

# What each request may hold: a field's check returns why a value is refused, or None. Every request is checked against
# this before any of it is used, so no value a client can send (a wrong type, a huge number, a NUL) reaches code that
# could fail on it in the server; only hello, status and stop take no fields.
_MAX_ITEMS = 1 << 16  # argv, sys.path and environment entries: far beyond any command line (ARG_MAX is 2 MiB)
_MAX_COLUMNS = 1 << 16


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and "\0" not in value else "a string without NUL"


def _texts(count: int | None = None) -> Any:
    def check(value: Any) -> str | None:
        if not isinstance(value, list) or len(value) > _MAX_ITEMS or (count is not None and len(value) != count):
            return f"a list of {count or 'at most ' + str(_MAX_ITEMS)} strings"
        return next((_text(v) for v in value if _text(v) is not None), None)

    return check


def _absolute(value: Any) -> str | None:
    return _text(value) or (None if value.startswith("/") else "an absolute path")


def _environment(value: Any) -> str | None:
    if not isinstance(value, dict) or len(value) > _MAX_ITEMS:
        return "an object of strings"
    for name, text in value.items():
        if not name or "=" in name or _text(name) or _text(text):
            return "an object of strings, names without '=' or NUL"
    return None


def _whole(low: int, high: int) -> Any:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        return None if ok else f"a whole number from {low} to {high}"

    return check


def _timeout(value: Any) -> str | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_SECONDS
    return None if ok else f"null or a number of seconds from 0 to {MAX_SECONDS}"


def _codecs(lookup: Any) -> Any:
    def check(value: Any) -> str | None:  # null: the stream had none (a replaced stream), the child takes the default
        if not isinstance(value, list) or len(value) != 2 or not all(v is None or isinstance(v, str) for v in value):
            return "two names Python knows (or null)"
        try:
            for name in value:
                if name is not None:
                    lookup(name)
        except (LookupError, ValueError):  # ValueError: a NUL in the name
            return "two names Python knows (or null)"
        return None

    return check


def _flags(value: Any) -> str | None:
    return None if isinstance(value, list) and len(value) == 2 and all(isinstance(v, bool) for v in value) else "two booleans"


def _identity(value: Any) -> str | None:
    return None if isinstance(value, dict) else "an object"


_COMMON = {"argv": _texts(), "cwd": _absolute, "env": _environment, "timeout": _timeout, "identity": _identity,
           "process": process_state.check}
_FIELDS: dict[str, dict[str, Any]] = {
    "hello": {},
    "status": {},
    "stop": {},
    "run": {**_COMMON, "path": _texts(), "tty": _flags, "columns": _whole(0, _MAX_COLUMNS), "lines": _whole(0, _MAX_COLUMNS),
            "encoding": _codecs(codecs.lookup), "errors": _codecs(codecs.lookup_error)},
    "exec": {**_COMMON, "executable": _absolute},
}
_REQUIRED = {"run": ("argv", "cwd", "env", "path", "process"), "exec": ("argv", "cwd", "env", "executable", "process")}


def request_error(message: Any) -> str | None:
    """Why ``message`` is not a request this server takes (one line naming the field), or None when every field is sound."""
    if not isinstance(message, dict):
        return "a request that is not a JSON object"
    op = message.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        return f"unknown request {str(op)[:40]!r}"
    fields = _FIELDS[op]
    for name, value in message.items():
        if name == "op":
            continue
        if name not in fields:
            return f"{op} request: unknown field {str(name)[:40]!r}"
        why = fields[name](value)
        if why is not None:
            return f"{op} request: field {name!r} must be {why}"
    missing = [name for name in _REQUIRED.get(op, ()) if name not in message]
    return f"{op} request: missing field(s) {', '.join(missing)}" if missing else None



class Server:
    """The accept loop, the children and the queue."""

    def __init__(self, listener: socket.socket, identity: dict[str, Any], warm: Warm, idle_timeout: float, jobs: int) -> None:
        self.listener = listener
        self.path = listener.getsockname()
        self.inode = os.stat(self.path).st_ino
        self.identity = identity
        self.warm = warm
        self.idle_timeout = idle_timeout
        self.jobs = max(1, jobs)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.requests: dict[int, _Request] = {}  # by the connection's fd
        self.queue: collections.deque[_Request] = collections.deque()
        self.running: dict[int, _Request] = {}  # by pid
        self.started = time.time()
        self.last_active = time.monotonic()
        self.beat = time.monotonic()
        self.served = 0
        self.failed = 0
        self.stopping = False
        self.listening = True
        self.unconfirmed: collections.OrderedDict[tuple[str, ...], dict[str, Any]] = collections.OrderedDict()  # lower requests
        self.confirming: tuple[int, dict[str, Any]] | None = None  # the child confirming one in the background, and its request
        self.confirmed = 0  # background confirmations run to the end

    # the loop

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        while True:
            for key, mask in self.selector.select(self._wait()):
                request = None if key.fileobj is self.listener else key.data[1]
                try:
                    if request is None:
                        self._accept()
                    elif key.data[0] == "conn":
                        self._on_conn(request, mask)
                    elif key.data[0] == "pipe":
                        self._on_pipe(request, key.fd)
                    else:
                        self._reap(request)
                except Exception as e:  # noqa: BLE001 - one request's fault ends that request, never the server
                    self._contain(request, e)
            try:
                self._housekeeping()
            except Exception as e:  # noqa: BLE001
                self._contain(None, e)
            if self.stopping and not self.running and not self.queue:
                break
        self.selector.close()

    def _contain(self, request: _Request | None, error: Exception) -> None:
        """A fault in the server's own handling: logged to server.log; the request it hit ends with an error reply."""
        print(f"lowercache server: a request failed in the server: {type(error).__name__}: {error}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        if request is None:
            return
        self.failed += 1
        with contextlib.suppress(Exception):
            if request in self.queue:
                self.queue.remove(request)
            if request.pid and request.pid in self.running:
                self._kill(request)  # reaped by its pidfd as usual; the client falls back to running the command itself
            request.outbox.clear()
            self._reply(request, {"error": f"the server failed on this request ({type(error).__name__})"})
            request.gone = True  # nothing more is sent on this connection; the reply above still drains
            return
        with contextlib.suppress(Exception):
            self._close(request)

    def _wait(self) -> float:
        if self.running and any(r.pidfd < 0 for r in self.running.values()):
            return 0.02  # no pidfd on this kernel: poll the children
        deadlines = [r.deadline - time.monotonic() for r in self.running.values() if r.deadline is not None]
        return max(0.0, min([1.0, *deadlines]))

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self.beat >= client.HEARTBEAT:  # a client waiting on a request hears the server is alive (and not paused)
            self.beat = now
            for request in list(self.requests.values()):
                if request.message is not None and request.message["op"] in ("run", "exec") and not request.close_when_sent:
                    self._send(request, {"alive": 1})
        self._confirm_reaped()
        if self.listening and self.unconfirmed and self.confirming is None and not self.running and not self.queue \
                and now - self.last_active >= CONFIRM_AFTER:
            self._confirm_next()
        for request in list(self.running.values()):
            if request.pidfd < 0:
                self._reap(request)
            if request.deadline is not None and now > request.deadline and not request.timed_out:
                request.timed_out = True
                self._kill(request)
        self._start_queued()
        if self.listening and not self.running and not self.queue and now - self.last_active > self.idle_timeout:
            self.stop()
        if self.listening:
            try:
                moved = os.stat(self.path).st_ino != self.inode
            except OSError:
                moved = True
            if moved:  # the socket was removed or taken over: nobody can reach this server any more
                self.stop(unlink=False)

    def stop(self, unlink: bool = True) -> None:
        """Accept nothing more, free the socket path at once, finish what was accepted, then exit."""
        self.stopping = True
        self._confirm_yield(keep=False)
        if not self.listening:
            return
        self.listening = False
        self.selector.unregister(self.listener)
        if unlink:
            try:
                if os.stat(self.path).st_ino == self.inode:
                    os.unlink(self.path)
            except OSError:
                pass
        self.listener.close()

    # connections

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if client.peer_uid(conn) != os.getuid():
            conn.close()  # another user's process: no reply at all
            return
        conn.setblocking(False)
        request = _Request(conn)
        self.requests[conn.fileno()] = request
        self.selector.register(conn, selectors.EVENT_READ, ("conn", request))

    def _on_conn(self, request: _Request, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(request)
        if mask & selectors.EVENT_READ and not request.gone:
            try:
                chunk, fds, _, _ = socket.recv_fds(request.conn, 1 << 16, 3)
            except BlockingIOError:
                return
            except OSError:
                chunk, fds = b"", []
            request.fds += fds
            if not chunk:
                self._client_gone(request)
                return
            request.inbox += chunk
            if request.message is not None:
                self._signal(request)  # a running request only watches for the client leaving, or its Ctrl-C
                return
            if b"\n" in request.inbox:
                line, request.inbox = request.inbox.split(b"\n", 1)
                self._handle(request, line)
            elif len(request.inbox) > client.MAX_LINE:
                self._close(request)

    def _handle(self, request: _Request, line: bytes) -> None:
        try:
            message = json.loads(line)
            why = request_error(message)
        except ValueError:
            why = "a request that is not JSON"
        except RecursionError:
            why = "a request nested too deep"
        if why is not None:
            self._reply(request, {"error": why})
            return
        assert isinstance(message, dict)
        op = message["op"]
        request.message = message
        if op == "hello":  # a client about to send a request: counts as activity
            self.last_active = time.monotonic()
            self._reply(request, {"pid": os.getpid(), "identity": self.identity})
        elif op == "status":
            self._reply(request, self.status())
        elif op == "stop":
            self.stop()  # the socket path is free before the reply: a replacement may bind it at once
            self._reply(request, {"pid": os.getpid(), "stopping": True, "running": len(self.running), "queued": len(self.queue)})
        else:  # run or exec
            changed = self.warm.changed_file() if message.get("identity") == self.identity and not self.stopping else None
            if message.get("identity") != self.identity or self.stopping or changed is not None:
                if changed is not None:
                    print(f"lowercache server: {changed} changed since it was imported; stopping", file=sys.stderr, flush=True)
                    self.stop()  # the client starts a server that imports what is there now
                self._reply(request, {"stale": True})
                return
            why = self._cannot_exec(request) if op == "exec" else self._cannot_run(request)
            if why is not None:
                self._reply(request, {"declined": why})
                return
            self.last_active = time.monotonic()
            self._confirm_yield()  # a request comes first: the background confirmation starts again when idle
            if op == "exec":  # a new process would not wait for a slot either: server_jobs bounds lowerings
                self._fork(request)
                return
            self.queue.append(request)
            self._start_queued()

    def _cannot_exec(self, request: _Request) -> str | None:
        """Why this child could not stand in for the new ``python`` process the client would start, or None."""
        message = request.message or {}
        invocation = pyexec.parse(message["argv"])
        if invocation is None:
            return "not a command this server can run"
        if len(request.fds) != 3:
            return "the client's standard streams did not arrive"
        if self.warm.base_path is None:
            return "this server's module search path is not a new interpreter's"
        return pyexec.why_not(invocation, message["cwd"], message["env"], self.warm.start_env, self.warm.imported)

    def _cannot_run(self, request: _Request) -> str | None:
        """Why a child would run this ``lower`` or ``verify`` otherwise than the client's own interpreter, or None.

        The rule is ``lowercache run``'s (``startup.why_not``): a variable that
        is an input and differs (the client's identity already holds them, so
        it replaced a server started under others), or a directory on the
        client's module search path holding a file that would shadow a module
        the server imported or looked for.
        """
        message = request.message or {}  # checked against the schema (request_error) before it got here
        return startup.why_not(message["env"], self.warm.start_env, message["path"], message["cwd"], self.warm.imported)

    def _signal(self, request: _Request) -> None:
        """A running request's client asks for SIGINT (its Ctrl-C) to reach the child, as it would a new process."""
        lines = request.inbox.split(b"\n")
        request.inbox = lines.pop()
        if len(request.inbox) > client.MAX_LINE:
            self._client_gone(request)
            return
        for line in lines:
            try:
                asked = json.loads(line)
            except ValueError:
                continue
            if not (isinstance(asked, dict) and asked.get("op") == "signal"):
                continue
            if request.pid:
                try:
                    os.killpg(request.pid, signal.SIGINT)
                except OSError:
                    pass

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "identity": self.identity,
            "uptime": time.time() - self.started,
            "requests": self.served,
            "failed": self.failed,
            "running": len(self.running),
            "queued": len(self.queue),
            "jobs": self.jobs,
            "rss": _rss_bytes(),
            "idle_timeout": self.idle_timeout,
            "idle": time.monotonic() - self.last_active if not self.running else 0.0,
            "unconfirmed": len(self.unconfirmed) + (self.confirming is not None),
            "confirmed": self.confirmed,
            "socket": self.path,
        }

    def _send(self, request: _Request, message: dict[str, Any]) -> None:
        if request.gone:
            return
        request.outbox += json.dumps(message, separators=(",", ":")).encode() + b"\n"
        self._flush(request)

    def _reply(self, request: _Request, message: dict[str, Any]) -> None:
        request.close_when_sent = True
        self._send(request, message)

    def _flush(self, request: _Request) -> None:
        try:
            while request.outbox:
                sent = request.conn.send(request.outbox)
                del request.outbox[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self._client_gone(request)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if request.outbox else 0)
        self.selector.modify(request.conn, events, ("conn", request))
        if not request.outbox and request.close_when_sent:
            self._close(request)

    def _client_gone(self, request: _Request) -> None:
        """The client left (Ctrl-C, killed): its queued request is dropped, its running child killed."""
        request.gone = True
        if request in self.queue:
            self.queue.remove(request)
        if request.pid:
            self._kill(request)
        self._close(request)

    def _close(self, request: _Request) -> None:
        request.close_fds()
        fd = request.conn.fileno()
        if fd >= 0 and self.requests.pop(fd, None) is not None:
            self.selector.unregister(request.conn)
            request.conn.close()

    # children

    def _start_queued(self) -> None:
        while self.queue and sum(not r.execs for r in self.running.values()) < self.jobs:
            self._fork(self.queue.popleft())

    def _fork(self, request: _Request) -> None:
        """A child for the request: a lowercache command (its output relayed as frames) or, for exec, a ``python`` command
        writing straight to the client's own descriptors."""
        out_r, out_w = os.pipe() if not request.execs else (-1, -1)
        err_r, err_w = os.pipe() if not request.execs else (-1, -1)
        started_r, started_w = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                own = [self.listener.fileno(), self.selector.fileno(), out_r, err_r, started_r]
                own += [r.conn.fileno() for r in self.requests.values()]
                own += [fd for r in self.requests.values() if r is not request for fd in r.fds]
                own += [fd for r in self.running.values() for fd in (*r.pipes, r.pidfd, r.started)]
                inherited = [fd for fd in own if fd >= 0]
                if request.execs:
                    code = _exec_child(request.message or {}, parent, request.fds, inherited, self.warm, started_w)
                else:
                    code = _child(request.message or {}, parent, out_w, err_w, inherited, self.warm, started_w)
            finally:
                os._exit(code)
        try:
            os.setpgid(pid, pid)  # as the child does itself: whichever runs first, a kill reaches the whole group
        except OSError:
            pass
        request.close_fds()  # the child has them: the client sees end of file once the command and what it started are gone
        request.pid = pid
        os.close(started_w)
        request.started = started_r
        if not request.execs:
            os.close(out_w)
            os.close(err_w)
            request.pipes = {out_r: 1, err_r: 2}
        timeout = request.message.get("timeout") if request.message else None
        request.deadline = time.monotonic() + timeout if isinstance(timeout, (int, float)) and timeout > 0 else None
        self.running[pid] = request
        for fd in request.pipes:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", request))
        try:
            request.pidfd = os.pidfd_open(pid)
            self.selector.register(request.pidfd, selectors.EVENT_READ, ("pid", request))
        except (AttributeError, OSError):
            request.pidfd = -1
        self._send(request, {"child": pid})  # a client whose server stops responding can then stop or wait for the child itself

    def _on_pipe(self, request: _Request, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._send(request, {"fd": request.pipes[fd], "b64": base64.b64encode(data).decode()})
        else:
            self._close_pipe(request, fd)

    def _drain(self, request: _Request, fd: int) -> None:
        """Read what is in the pipe now, then close it (a process the request left behind may hold it open)."""
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            self._send(request, {"fd": request.pipes[fd], "b64": base64.b64encode(data).decode()})
        self._close_pipe(request, fd)

    def _close_pipe(self, request: _Request, fd: int) -> None:
        if request.pipes.pop(fd, None) is not None:
            self.selector.unregister(fd)
            os.close(fd)

    def _kill(self, request: _Request) -> None:
        for kill in (os.killpg, os.kill):
            try:
                kill(request.pid, signal.SIGKILL)
            except OSError:
                pass

    def _reap(self, request: _Request) -> None:
        try:
            pid, status = os.waitpid(request.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = request.pid, 0
        if pid == 0:
            return
        if not request.execs:  # a wrapped command's own background processes outlive it, as they would a new process
            try:
                os.killpg(request.pid, signal.SIGKILL)  # whatever the request started and left behind
            except OSError:
                pass
        for fd in list(request.pipes):  # the child is gone: all it wrote is in the pipe
            self._drain(request, fd)
        if request.pidfd >= 0:
            self.selector.unregister(request.pidfd)
            os.close(request.pidfd)
            request.pidfd = -1
        del self.running[request.pid]
        self.served += 1
        self.last_active = time.monotonic()
        code = os.waitstatus_to_exitcode(status)
        said = self._started(request)
        if said is not None and not said.startswith(b"S"):
            reply = {"declined": said[1:].decode("utf-8", "replace") if said else f"the server's child could not start the command (status {code})"}
        elif request.execs:
            reply = {"exit": code}
        elif request.timed_out:
            reply = {"exit": 1, "error": f"the lowering took longer than the request timeout ({request.message.get('timeout')} s, LOWERCACHE_SERVER_TIMEOUT) and was stopped"}
        elif code < 0:
            reply = {"exit": 1, "error": _signal_error(code)}
        else:
            reply = {"exit": code}
        if reply.get("exit", 1):
            self.failed += 1
        elif not request.execs:
            self._confirm_later(request.message or {})
        self._reply(request, reply)
        self._start_queued()

    # background confirmation: a new direct-mode record is used once a re-run with the same inputs gave the same flow key;
    # an idle server re-runs the factory and the export of a ``lower`` it served (``direct.confirm``), so the next is a hit

    def _confirm_later(self, message: dict[str, Any]) -> None:
        """A ``lower`` that ran here may have left a new record: confirm it when the server is idle."""
        argv = [str(a) for a in message.get("argv") or []]
        if not argv or direct.parse_lower(argv) is None:
            return
        key = (str(message.get("cwd")), *argv)
        self.unconfirmed.pop(key, None)
        self.unconfirmed[key] = message
        while len(self.unconfirmed) > MAX_UNCONFIRMED:
            self.unconfirmed.popitem(last=False)

    def _confirm_next(self) -> None:
        key, message = self.unconfirmed.popitem(last=False)
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                own = [self.listener.fileno(), self.selector.fileno(), *(r.conn.fileno() for r in self.requests.values())]
                code = _confirm_child(message, parent, [fd for fd in own if fd >= 0], self.warm)
            finally:
                os._exit(code)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        self.confirming = (pid, message)

    def _confirm_reaped(self) -> None:
        if self.confirming is None:
            return
        try:
            pid, _ = os.waitpid(self.confirming[0], os.WNOHANG)
        except ChildProcessError:
            pid = self.confirming[0]
        if pid:
            self.confirming = None
            self.confirmed += 1

    def _confirm_yield(self, keep: bool = True) -> None:
        """Stop a background confirmation (a request arrived, or the server stops); ``keep``: run it again when idle."""
        if self.confirming is None:
            return
        pid, message = self.confirming
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        self.confirming = None
        if keep:
            self._confirm_later(message)
            self.unconfirmed.move_to_end((str(message.get("cwd")), *[str(a) for a in message.get("argv") or []]), last=False)


    def _started(self, request: _Request) -> bytes | None:
        """What the child said before the command's own code ran: ``S`` (it started), ``E`` and why not, or ``b""``
        (it died first). None for a ``lower`` child killed before it said anything: its failure is the lowering's."""
        try:
            said = os.read(request.started, 4096)
        except OSError:
            said = b""
        os.close(request.started)
        request.started = -1
        return said if said or request.execs else None


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


def _child(message: dict[str, Any], parent: int, out_w: int, err_w: int, inherited: list[int], warm: Warm, started: int) -> int:
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
    sys.stdout = terminal.Relayed(1, ttys[0], size, encodings[0], errors[0], line_buffering=ttys[0])
    sys.stderr = terminal.Relayed(2, ttys[1], size, encodings[1], errors[1], line_buffering=True)
    try:
        _become_client(message, warm)
        pyexec.reseed()  # as a new process: an unseeded factory draws afresh, so a confirmation can tell
    except BaseException as e:  # noqa: BLE001
        os.write(started, b"E" + _why_not_started(e, "the lowering").encode()[:4000])
        return 1
    os.write(started, b"S")
    os.close(started)
    try:
        from . import cli
        from .errors import new_command

        new_command()  # the server's own warnings were its own
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


def _confirm_child(message: dict[str, Any], parent: int, inherited: list[int], warm: Warm) -> int:
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
        from .cli.commands import confirm_record
        from .errors import new_command

        new_command()
        said = confirm_record([str(a) for a in message["argv"]])
    except BaseException as e:  # noqa: BLE001 - the record stays unconfirmed; the next run confirms it as before
        said = f"failed ({type(e).__name__}: {e})"
    print(f"lowercache server: background confirmation of {message.get('cwd')}: lower {' '.join(message['argv'][1:])}: {said}",
          file=sys.stderr, flush=True)
    return 0


def _exec_child(message: dict[str, Any], parent: int, fds: list[int], inherited: list[int], warm: Warm, started: int) -> int:
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
        from .errors import show_warnings_in_one_line
        from .run.hook import activate_in_process
        from .run.replay import record_in_process

        dump = record_in_process(at_exit=False, warm={"env": warm.read_env, "lookups": warm.lookups})
        show_warnings_in_one_line()
        activate_in_process()
    except Exception as e:  # noqa: BLE001 - as in a new process: never break the wrapped program
        print(f"lowercache: warning: caching is off for this process ({e})", file=sys.stderr)

    def now_started() -> None:
        os.write(started, b"S")
        os.close(started)

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


@dataclass
class Warm:
    """What the warm-up left that a child standing in for a new ``python`` process needs (``run/pyexec.py``)."""

    threads: int  # torch's default thread count, before the server set one
    cpus: int  # how many CPUs the server may run on (torch's default follows it)
    start_env: dict[str, str]  # the environment as the server started
    base_path: list[str] | None  # sys.path as the interpreter started, without sys.path[0] (None: unknown)
    read_env: list[str] = field(default_factory=list)  # variables the imports and the warm-up read
    lookups: list[str] = field(default_factory=list)  # module names they looked up
    imported: dict[str, list[str]] = field(default_factory=dict)  # top-level names of those and of every module imported, where found
    installed: tuple[str, ...] = ()  # directories of installed code (stdlib, site-packages, lowercache)
    files: dict[str, list[int] | None] = field(default_factory=dict)  # every imported module's file: its stat_key

    def remember_files(self) -> None:
        """Note the file of every module imported so far (thousands after the warm-up, checked again before each request)."""
        for module in list(sys.modules.values()):
            origin = getattr(module, "__file__", None)
            if isinstance(origin, str) and os.path.isabs(origin):
                self.files[origin] = _file_stamp(origin)

    def changed_file(self) -> str | None:
        """A file the server imported that has changed since (an upgrade or an edit in place), or None."""
        for path, stamp in self.files.items():
            if _file_stamp(path) != stamp:
                return path
        return None


def _file_stamp(path: str) -> list[int] | None:
    """The file's ``stat_key``, None when it is gone (a file missing at the warm-up stays missing)."""
    try:
        return stat_key(os.stat(path))
    except OSError:
        return None


def _installed_dirs() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")} | set(site.getsitepackages())
    dirs.add(os.path.dirname(os.path.abspath(__file__)))
    return tuple(os.path.join(os.path.normpath(d), "") for d in dirs)


def _warm_up(warm: Warm) -> None:
    """Import the stack single-threaded and lower a tiny model into a throwaway cache, listening to what it reads."""
    from .record.recorder import listen, remember_modules
    from .run.replay import CommandRecorder

    settings = load_settings()
    recorder = CommandRecorder("/", settings, [])
    listen(recorder)
    try:
        _import_and_lower(warm)
    finally:
        recorder.close()
    warm.read_env = sorted(name for name in recorder.env if not environment.shown_only(name))  # rich's and typer's: never inputs
    warm.lookups = sorted(recorder.lookups)
    warm.imported = startup.found_in(dict(sys.modules), recorder.lookups)
    warm.installed = _installed_dirs()
    warm.remember_files()
    remember_modules()


# What ExecuTorch's Arm export script (aot_arm_compiler, ``lowercache run``'s usual command) imports beyond
# the flow: its devtools (which bring pandas), Cortex-M and model-registry modules, about 400 modules
# that each child would otherwise import again. Never the script itself: ``-m`` must find it unimported.
SCRIPT_IMPORTS = (
    "executorch.backends.arm.util._factory", "executorch.backends.arm.vgf", "executorch.backends.cortex_m.edge_compile_config",
    "executorch.backends.cortex_m.passes.cortex_m_pass_manager", "executorch.backends.cortex_m.passes.replace_quant_nodes_pass",
    "executorch.backends.cortex_m.quantizer.quantizer", "executorch.backends.cortex_m.target_config", "executorch.devtools",
    "executorch.devtools.backend_debug", "executorch.devtools.bundled_program.config",
    "executorch.devtools.bundled_program.serialize", "executorch.examples.models", "executorch.examples.models.model_factory",
    "executorch.extension.export_util.utils", "tabulate",
)


def _import_and_lower(warm: Warm) -> None:
    from . import quiet

    with quiet.captured(import_torch=True) as imports:  # what a new process's imports hold back, its children count too
        import torch

        warm.threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a fork after the intra-op pool ran can hang the child
        from .lowering.flow import import_stack

        import_stack()
        import rich.console  # noqa: F401
        import rich.progress  # noqa: F401
        import rich.table  # noqa: F401
        import typer  # noqa: F401

        from . import api, verify  # noqa: F401
        from .bench import models
        from .cli import commands  # noqa: F401  (the typer commands a lower or verify child runs)
        from .lowering import loading  # noqa: F401

        for name in ("typer._adapters", *SCRIPT_IMPORTS):  # typer's first parse imports pydantic there, in every child
            try:
                importlib.import_module(name)
            except ImportError:  # another ExecuTorch release: its script imports something else, in the child
                pass
    quiet.inherit(imports.lines)
    with quiet.captured(), tempfile.TemporaryDirectory(prefix="lowercache-warmup-") as scratch:
        module, example = models.tiny_cnn()
        settings = load_settings(cache_dir=scratch, disable=False, read_only=False, remote="")
        api.lower(module, example, target="ethos-u55-128", settings=settings)


def _listen(path: str) -> socket.socket:
    """Bind the socket; a file left by a dead server is replaced, a live server is not."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        raise SystemExit(f"lowercache server: another server answers at {path}")
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
    finally:
        probe.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    listener.setblocking(False)
    return listener


def main() -> None:
    """``python -m lowercache.server``: warm up, then serve until stopped or idle."""
    # sys.path as ``python -c`` started it, '' first, with this lowercache put in front by client._spawn's code
    base_path = sys.path[2:] if sys.path[1:2] == [""] else None
    warm = Warm(threads=1, cpus=len(os.sched_getaffinity(0)), start_env=dict(os.environ), base_path=base_path)
    settings = load_settings()
    identity = client.identity(settings)  # before the imports: a source edited meanwhile makes this server stale
    directory = client.private_dir()
    _warm_up(warm)
    gc.collect()
    gc.freeze()  # children share the warm heap instead of copying pages the collector would touch
    listener = _listen(os.fspath(directory / client.SOCKET_NAME))
    print(f"lowercache server {os.getpid()} listening at {listener.getsockname()}", file=sys.stderr, flush=True)
    Server(listener, identity, warm, settings.server_idle_timeout, settings.server_jobs).serve()


if __name__ == "__main__":
    main()
