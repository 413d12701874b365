"""The server's one thread: the accept loop, the queue, a child per request, and, while idle, background confirmation
and the warm-up of a target family first used after the start."""

from __future__ import annotations

import base64
import collections
import contextlib
import errno
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable

from .. import client, direct, startup
from ..config import load_settings
from ..run import pyexec
from ..speedups.gcfreeze import freeze_for_children
from . import child, protocol
from .warm import Warm, targets_named, family_warmed_on_use, warm_family, warm_up


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


def _signal_error(status: int) -> str:
    number = -status
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    why = " (out of memory?)" if number == signal.SIGKILL else ""
    return f"the lowering process was killed by {name}{why}; the server is still up"


class Server:
    """The accept loop, the children and the queue."""

    def __init__(self, listener: socket.socket, identity: dict[str, Any], warm: Warm, idle_timeout: float, jobs: int,
                 started: float | None = None) -> None:
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
        self.started = time.time() if started is None else started  # the process's start: its warm-up is uptime too
        self.last_active = time.monotonic()
        self.beat = time.monotonic()
        self.served = 0
        self.failed = 0
        self.stopping = False
        self.listening = True
        self.unconfirmed: collections.OrderedDict[tuple[str, ...], dict[str, Any]] = collections.OrderedDict()  # lower requests
        self.confirming: tuple[int, dict[str, Any]] | None = None  # the child confirming one in the background, and its request
        self.confirmed = 0  # background confirmations run to the end
        self.to_warm: dict[str, None] = {}  # families served here not yet warm in this process, warmed when idle
        self.warm_tried: set[str] = set()  # families warmed on use whose warm-up ran (or failed): never again

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
        idle = not self.running and not self.queue and now - self.last_active >= CONFIRM_AFTER
        if self.listening and self.to_warm and self.confirming is None and idle:
            self._warm(next(iter(self.to_warm)))
        if self.listening and self.unconfirmed and self.confirming is None and idle:
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
            why = protocol.request_error(message)
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
        elif op == "warm":  # asked for (server start --target): now, whatever runs meanwhile
            self.last_active = time.monotonic()
            self._confirm_yield()
            for family in [f for f in map(family_warmed_on_use, message["targets"]) if f is not None]:
                self._warm(family)
            self._reply(request, {"warm": sorted(self.warm.families)})
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
            "warm": sorted(self.warm.families),
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

        def body() -> int:
            own = [self.listener.fileno(), self.selector.fileno(), out_r, err_r, started_r]
            own += [r.conn.fileno() for r in self.requests.values()]
            own += [fd for r in self.requests.values() if r is not request for fd in r.fds]
            own += [fd for r in self.running.values() for fd in (*r.pipes, r.pidfd, r.started)]
            inherited = [fd for fd in own if fd >= 0]
            if request.execs:
                return child.run_python(request.message or {}, parent, request.fds, inherited, self.warm, started_w)
            return child.run_cli(request.message or {}, parent, out_w, err_w, inherited, self.warm, started_w)

        pid = _forked(body)
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
        if said is not None and said.startswith(b"SD"):  # it backed out before anything of the command was seen
            reply = {"declined": said[2:].decode("utf-8", "replace")}
        elif said is not None and not said.startswith(b"S"):
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
            self._warm_later(request.message or {})
        self._reply(request, reply)
        self._start_queued()

    # warming a family on use: its first request here ran cold; the server warms itself for the next while idle

    def _warm_later(self, message: dict[str, Any]) -> None:
        for target in targets_named([str(a) for a in message.get("argv") or []]):
            family = family_warmed_on_use(target)
            if family is not None and family not in self.warm_tried:
                self.to_warm[family] = None

    def _warm(self, family: str) -> None:
        """Warm ``family`` in this process (seconds, requests wait); a failure is logged and not tried again."""
        self.to_warm.pop(family, None)
        if family in self.warm_tried:
            return
        self.warm_tried.add(family)
        marker = os.path.join(os.path.dirname(self.path), client.WARMING)  # a client that waits meanwhile waits longer
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        gc.unfreeze()
        try:
            warm_family(self.warm, family)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(marker)
            freeze_for_children()
        print(f"lowercache server: warmed {family}", file=sys.stderr, flush=True)

    # background confirmation: a new direct-mode record is used once a re-run with the same inputs gave the same flow key;
    # an idle server re-runs the factory and the export of a ``lower`` it served (``direct.confirm``), so the next is a hit

    def _confirm_later(self, message: dict[str, Any]) -> None:
        """A ``lower`` that ran here may have left a new record: confirm it when the server is idle, unless its client
        said not to (``server_confirm``)."""
        argv = [str(a) for a in message.get("argv") or []]
        if not argv or message.get("confirm") is False or direct.parse_lower(argv) is None:
            return
        key = (str(message.get("cwd")), *argv)
        self.unconfirmed.pop(key, None)
        self.unconfirmed[key] = message
        while len(self.unconfirmed) > MAX_UNCONFIRMED:
            self.unconfirmed.popitem(last=False)

    def _confirm_next(self) -> None:
        key, message = self.unconfirmed.popitem(last=False)
        parent = os.getpid()

        def body() -> int:
            own = [self.listener.fileno(), self.selector.fileno(), *(r.conn.fileno() for r in self.requests.values())]
            return child.confirm(message, parent, [fd for fd in own if fd >= 0], self.warm)

        self.confirming = (_forked(body), message)

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
        """What the child said before the command's own code ran: ``S`` (it started; then ``D`` and why if it backed out before
        anything of the command was seen), ``E`` and why not, or ``b""`` (it died first). None for a ``lower`` child killed
        before it said anything: its failure is the lowering's."""
        try:
            said = os.read(request.started, 4096)
        except OSError:
            said = b""
        os.close(request.started)
        request.started = -1
        return said if said or request.execs else None


def _forked(body: Callable[[], int]) -> int:
    """Fork a child that runs ``body`` and exits with what it returns (1 if it raises), never returning into the loop;
    the child leads a process group, set on both sides so that whichever runs first, a kill reaches the whole group."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    return pid


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
    started = time.time()
    # sys.path as ``python -c`` started it, '' first, with this lowercache put in front by client._spawn's code
    base_path = sys.path[2:] if sys.path[1:2] == [""] else None
    warm = Warm(threads=1, cpus=len(os.sched_getaffinity(0)), start_env=dict(os.environ), base_path=base_path)
    settings = load_settings()
    identity = client.identity(settings)  # before the imports: a source edited meanwhile makes this server stale
    directory = client.private_dir()
    warm_up(warm)
    freeze_for_children()
    listener = _listen(os.fspath(directory / client.SOCKET_NAME))
    print(f"lowercache server {os.getpid()} listening at {listener.getsockname()}", file=sys.stderr, flush=True)
    Server(listener, identity, warm, settings.server_idle_timeout, settings.server_jobs, started).serve()

