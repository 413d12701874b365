"""The backstop below Python: every path the recorded code names in a system call, native code's included.

An audit hook hears Python's own opens only; ``torch.from_file``, a C
extension or ``ctypes`` read files unheard. So while a record is made, a small
tracer process (``tracer.py``) is attached to this process with ``ptrace``,
and a seccomp filter (installed here, for every thread: ``TSYNC``) stops only
the path system calls for it (open, the stat family, access, readlink,
getdents, exec, and those that change the file system), as ``strace
--seccomp-bpf`` does. What it saw while recording was on is compared with
the record (``recorder.py``, ``Recorder.below_python``): a path
nothing else covers is added to it, or makes it untrusted.

The filter cannot be removed: the tracer serves this process (and what it
starts) until it exits. Where no tracer can attach (``ptrace`` forbidden by
Yama, a container's seccomp policy, another debugger already attached) or no
filter can be installed, :func:`start` says why, and the record is untrusted
rather than trusted blind. See docs/direct-mode.md.
"""

from __future__ import annotations

import ctypes
import json
import os
import posix
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
from typing import Any

from . import tracer

_PR_SET_NO_NEW_PRIVS, _PR_SET_PTRACER = 38, 0x59616D61
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Backstop:
    """A tracer attached to this process: :meth:`on`, :meth:`off` and :meth:`report` steer it."""

    def __init__(self, token: str, directory: str, pid: int):
        self.token = token
        self.pid = pid  # the tracer's
        self.directory = directory
        self.report_path = os.path.join(directory, "report.json")

    def _mark(self, command: str) -> None:
        try:
            posix.stat(tracer.marker(self.token, command))  # posix's own: not the recorder's watched os.stat
        except OSError:
            pass

    def on(self) -> None:
        """Note paths from now on."""
        self._mark("on")

    def off(self) -> None:
        """Stop noting paths (lowercache's own stages run)."""
        self._mark("off")

    def report(self) -> dict[str, Any] | None:
        """What the tracer saw while on: ``seen`` (path -> kinds of access), ``odd`` (what no path says), ``processes``
        (processes started); None when the tracer gave no report (it died)."""
        self._mark("report")
        try:
            with open(self.report_path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        return found if isinstance(found, dict) else None


def start() -> Backstop | str:
    """Attach a tracer to this process and install the filter; why not, when the platform does not allow it.

    Off while it starts: call :meth:`Backstop.on` when the recording begins.
    """
    program = tracer.filter_program()
    number = _SYS_SECCOMP.get(os.uname().machine)
    if program is None or number is None:
        return f"the backstop has no system-call table for {os.uname().machine}"
    directory = tempfile.mkdtemp(prefix="lowercache-backstop-")
    token = secrets.token_hex(8)
    attached = _attach(token, directory)
    why = attached if isinstance(attached, str) else _install(program, number)
    if why is not None:
        if isinstance(attached, int):
            os.kill(attached, 9)  # a tracer without a filter to serve: gone, and the process is let go
        shutil.rmtree(directory, ignore_errors=True)
        return why
    assert isinstance(attached, int)
    return Backstop(token, directory, attached)


def _attach(token: str, directory: str) -> int | str:
    """Start the tracer (in a session of its own; it forks away from this process at once) and let it attach; its pid,
    or why not. It leaves when the last process it traces has exited."""
    libc = ctypes.CDLL(None, use_errno=True)
    control_r, control_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        launcher = subprocess.Popen([sys.executable, "-I", "-S", tracer.__file__, str(os.getpid()), str(control_w), token,
                                     os.path.join(directory, "report.json")],
                                    stdin=go_r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=[control_w],
                                    start_new_session=True)  # not of the process's job: a Ctrl-C or killpg of it is not the tracer's
    except OSError as e:
        for fd in (control_r, control_w, go_r, go_w):
            os.close(fd)
        return f"the tracer could not start ({e.strerror})"
    os.close(control_w)
    os.close(go_r)
    try:
        launcher.wait()
        said = os.read(control_r, 4)
        if len(said) != 4:
            return "the tracer did not start"
        pid = struct.unpack("=i", said)[0]
        libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0)  # Yama's ptrace_scope 1: only this pid may trace us (EINVAL without Yama)
        os.write(go_w, b"G")
        answer = b""
        while chunk := os.read(control_r, 4096):
            answer += chunk
        if answer != b"A":
            return f"no tracer can attach ({answer[1:].decode(errors='replace') or 'it exited'})"
        return pid
    finally:
        os.close(control_r)
        os.close(go_w)


def _install(program: bytes, number: int) -> str | None:
    """The seccomp filter, on every thread; ``no_new_privs`` first only when the filter needs it (no CAP_SYS_ADMIN)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    for attempt in range(2):
        rc = libc.syscall(ctypes.c_long(number), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                          ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog))
        if rc == 0:
            return None
        err = ctypes.get_errno()
        if rc > 0:
            return f"a seccomp filter cannot reach thread {rc}"
        if attempt == 0 and err == 13:  # EACCES: unprivileged, as most are; the filter needs no_new_privs
            libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            continue
        return f"no seccomp filter can be installed ({os.strerror(err)})"
    return "no seccomp filter can be installed"
