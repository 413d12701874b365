"""The backstop's tracer: every path a process names in a system call, seen below Python (``backstop.py`` starts it).

Run as its own small process (``python -I -S tracer.py PID CONTROL REPORT``,
standard library only): it attaches to every thread of process ``PID`` with
``PTRACE_SEIZE`` (following its threads, forks and execs), writes ``A`` on
descriptor ``CONTROL`` once attached (or ``E`` and why not), and then serves
the seccomp stops the process's filter asks for (``SECCOMP_RET_TRACE`` on the
path system calls listed in :data:`CALLS`, as ``strace --seccomp-bpf``
does): it reads the call's number and arguments (``PTRACE_GET_SYSCALL_INFO``)
and its path strings (``process_vm_readv``), notes them, and lets the call
go on. The process steers it by system calls on marker paths (:func:`marker`):
record on, record off, and write the report (JSON) to ``REPORT``. It exits
once no traced process is left. The module also holds what both sides share:
the system-call table and the filter program.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import posix
import signal
import struct
import sys
from typing import Any

# How a system call names a path: (kind, [(dirfd argument or None, path argument), ...], flags argument or None).
# Kinds: open (by its flags), read, look (stat, access), link (readlink), list (getdents: a descriptor), exec,
# write (changes the file system), cwd (changes directory), handle (opens by handle, no path), system (mounts and the like).
_X86_64 = {
    2: ("open", "open", [(None, 0)], 1), 4: ("stat", "look", [(None, 0)], None), 6: ("lstat", "lstat", [(None, 0)], None),
    21: ("access", "look", [(None, 0)], None), 59: ("execve", "exec", [(None, 0)], None),
    76: ("truncate", "write", [(None, 0)], None), 78: ("getdents", "list", [], None), 80: ("chdir", "cwd", [(None, 0)], None),
    82: ("rename", "write", [(None, 0), (None, 1)], None), 83: ("mkdir", "write", [(None, 0)], None),
    84: ("rmdir", "write", [(None, 0)], None), 85: ("creat", "write", [(None, 0)], None),
    86: ("link", "write", [(None, 1)], None), 87: ("unlink", "write", [(None, 0)], None),
    88: ("symlink", "write", [(None, 1)], None), 89: ("readlink", "link", [(None, 0)], None),
    90: ("chmod", "write", [(None, 0)], None), 92: ("chown", "write", [(None, 0)], None),
    94: ("lchown", "write", [(None, 0)], None), 132: ("utime", "write", [(None, 0)], None),
    133: ("mknod", "write", [(None, 0)], None), 134: ("uselib", "read", [(None, 0)], None),
    137: ("statfs", "look", [(None, 0)], None), 155: ("pivot_root", "system", [], None),
    161: ("chroot", "system", [], None), 163: ("acct", "system", [], None), 165: ("mount", "system", [], None),
    166: ("umount2", "system", [], None), 167: ("swapon", "system", [], None), 179: ("quotactl", "system", [], None),
    188: ("setxattr", "write", [(None, 0)], None), 189: ("lsetxattr", "write", [(None, 0)], None),
    191: ("getxattr", "look", [(None, 0)], None), 192: ("lgetxattr", "look", [(None, 0)], None),
    194: ("listxattr", "look", [(None, 0)], None), 195: ("llistxattr", "look", [(None, 0)], None),
    197: ("removexattr", "write", [(None, 0)], None), 198: ("lremovexattr", "write", [(None, 0)], None),
    217: ("getdents64", "list", [], None), 235: ("utimes", "write", [(None, 0)], None),
    254: ("inotify_add_watch", "look", [(None, 1)], None), 257: ("openat", "open", [(0, 1)], 2),
    258: ("mkdirat", "write", [(0, 1)], None), 259: ("mknodat", "write", [(0, 1)], None),
    260: ("fchownat", "write", [(0, 1)], None), 261: ("futimesat", "write", [(0, 1)], None),
    262: ("newfstatat", "fstatat", [(0, 1)], 3), 263: ("unlinkat", "write", [(0, 1)], None),
    264: ("renameat", "write", [(0, 1), (2, 3)], None), 265: ("linkat", "write", [(2, 3)], None),
    266: ("symlinkat", "write", [(1, 2)], None), 267: ("readlinkat", "link", [(0, 1)], None),
    268: ("fchmodat", "write", [(0, 1)], None), 269: ("faccessat", "look", [(0, 1)], None),
    280: ("utimensat", "write", [(0, 1)], None), 301: ("fanotify_mark", "look", [(3, 4)], None),
    303: ("name_to_handle_at", "look", [(0, 1)], None), 304: ("open_by_handle_at", "handle", [], None),
    316: ("renameat2", "write", [(0, 1), (2, 3)], None), 322: ("execveat", "exec", [(0, 1)], None),
    332: ("statx", "fstatat", [(0, 1)], 2),
}
_AARCH64 = {
    5: ("setxattr", "write", [(None, 0)], None), 6: ("lsetxattr", "write", [(None, 0)], None),
    8: ("getxattr", "look", [(None, 0)], None), 9: ("lgetxattr", "look", [(None, 0)], None),
    11: ("listxattr", "look", [(None, 0)], None), 12: ("llistxattr", "look", [(None, 0)], None),
    14: ("removexattr", "write", [(None, 0)], None), 15: ("lremovexattr", "write", [(None, 0)], None),
    27: ("inotify_add_watch", "look", [(None, 1)], None), 33: ("mknodat", "write", [(0, 1)], None),
    34: ("mkdirat", "write", [(0, 1)], None), 35: ("unlinkat", "write", [(0, 1)], None),
    36: ("symlinkat", "write", [(1, 2)], None), 37: ("linkat", "write", [(2, 3)], None),
    38: ("renameat", "write", [(0, 1), (2, 3)], None), 39: ("umount2", "system", [], None),
    40: ("mount", "system", [], None), 41: ("pivot_root", "system", [], None), 43: ("statfs", "look", [(None, 0)], None),
    45: ("truncate", "write", [(None, 0)], None), 48: ("faccessat", "look", [(0, 1)], None),
    49: ("chdir", "cwd", [(None, 0)], None), 51: ("chroot", "system", [], None), 53: ("fchmodat", "write", [(0, 1)], None),
    54: ("fchownat", "write", [(0, 1)], None), 56: ("openat", "open", [(0, 1)], 2), 60: ("quotactl", "system", [], None),
    61: ("getdents64", "list", [], None), 78: ("readlinkat", "link", [(0, 1)], None),
    79: ("newfstatat", "fstatat", [(0, 1)], 3), 88: ("utimensat", "write", [(0, 1)], None),
    89: ("acct", "system", [], None), 221: ("execve", "exec", [(None, 0)], None), 224: ("swapon", "system", [], None),
    263: ("fanotify_mark", "look", [(3, 4)], None), 264: ("name_to_handle_at", "look", [(0, 1)], None),
    265: ("open_by_handle_at", "handle", [], None), 276: ("renameat2", "write", [(0, 1), (2, 3)], None),
    281: ("execveat", "exec", [(0, 1)], None), 291: ("statx", "fstatat", [(0, 1)], 2),
}
# Added in later kernels, numbered alike on every architecture.
_COMMON = {
    428: ("open_tree", "system", [], None), 429: ("move_mount", "system", [], None), 430: ("fsopen", "system", [], None),
    431: ("fsconfig", "system", [], None), 433: ("fspick", "system", [], None), 437: ("openat2", "open2", [(0, 1)], 2),
    439: ("faccessat2", "look", [(0, 1)], None), 452: ("fchmodat2", "write", [(0, 1)], None),
    463: ("setxattrat", "write", [(0, 1)], None), 464: ("getxattrat", "look", [(0, 1)], None),
    465: ("listxattrat", "look", [(0, 1)], None), 466: ("removexattrat", "write", [(0, 1)], None),
}
# (the table, the audit architecture seccomp reports, the x32 bit that must also be traced or None)
ARCHES = {"x86_64": ({**_X86_64, **_COMMON}, 0xC000003E, 0x40000000), "aarch64": ({**_AARCH64, **_COMMON}, 0xC00000B7, None)}


def arch() -> tuple[dict[int, Any], int, int | None] | None:
    """This machine's system-call table, audit architecture and x32 bit; None where the backstop has no table."""
    return ARCHES.get(platform.machine())


AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
O_ACCMODE, O_CREAT, O_TRUNC, O_PATH, O_DIRECTORY = 0o3, 0o100, 0o1000, 0o10000000, 0o200000
_SECCOMP_RET_TRACE, _SECCOMP_RET_ALLOW = 0x7FF00000, 0x7FFF0000
# The directory descriptor lowercache's own look at or read of an absolute path passes (``os.stat(path,
# dir_fd=HEARD_DIRFD)``): the kernel ignores it there, and no descriptor is negative but AT_FDCWD. The filter lets such a
# call go untraced: it comes from Python, where the recorder heard it already (a wrapper of ``os.stat``, the import
# system's lookups by name, the audit event of the import system's read).
HEARD_DIRFD = -0x4C434D47
_HEARD_KINDS = ("look", "fstatat", "link", "open")
MARK = "/proc/lowercache-backstop-"  # a procfs name no process can make: the marker calls fail, and say what to do


def read_heard(path: str) -> bytes:
    """The bytes of the file at the absolute ``path``, read by lowercache itself (the import system for the recorder, a
    record's digests): opened with :data:`HEARD_DIRFD` and read without a stat, so a backstop's filter, which stays
    after its record's window, lets the calls through instead of stopping for each."""
    fd = posix.open(path, posix.O_RDONLY | posix.O_CLOEXEC, dir_fd=HEARD_DIRFD)
    try:
        chunks = []
        while chunk := posix.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        posix.close(fd)


def marker(token: str, command: str) -> str:
    """The path the traced process stats to tell the tracer ``command`` (``on``, ``off``, ``report``)."""
    return f"{MARK}{token}/{command}"


def filter_program() -> bytes | None:
    """The seccomp-BPF program: stop (``RET_TRACE``) on the table's calls and on any other architecture's, else allow;
    but allow a look (stat, access, readlink) or an ``openat`` whose directory argument is :data:`HEARD_DIRFD`."""
    found = arch()
    if found is None:
        return None
    table, audit_arch, x32 = found
    heard = [n for n in sorted(table) if table[n][1] in _HEARD_KINDS and table[n][2][:1] == [(0, 1)]]
    traced = [n for n in sorted(table) if n not in heard]
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    # (code, jump if true, jump if false, k), jumps named by label and resolved below
    ins: list[tuple[int, Any, Any, int]] = [
        (ld_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq, "next", "trace", audit_arch),  # another architecture's calls (int 0x80): traced, and refused there
        (ld_abs, 0, 0, 0),  # seccomp_data.nr
    ]
    if x32 is not None:
        ins.append((jge, "trace", "next", x32))
    ins += [(jeq, "trace", "next", n) for n in traced] + [(jeq, "heard", "next", n) for n in heard]
    ins.append((ret, 0, 0, _SECCOMP_RET_ALLOW))
    labels = {"heard": len(ins)}
    ins.append((ld_abs, 0, 0, 16))  # the low half of seccomp_data.args[0] (little-endian): the directory descriptor, an int
    ins.append((jeq, "allow", "trace", HEARD_DIRFD & 0xFFFFFFFF))
    labels["trace"] = len(ins)
    ins.append((ret, 0, 0, _SECCOMP_RET_TRACE))
    labels["allow"] = len(ins)
    ins.append((ret, 0, 0, _SECCOMP_RET_ALLOW))

    def offset(at: int, target: Any) -> int:
        return 0 if target in (0, "next") else labels[target] - at - 1

    return b"".join(struct.pack("HBBI", code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(ins))


# -- the tracer process ------------------------------------------------------------------------------

_PTRACE_CONT, _PTRACE_GETEVENTMSG, _PTRACE_SEIZE, _PTRACE_LISTEN, _PTRACE_GET_SYSCALL_INFO = 7, 0x4201, 0x4206, 0x4208, 0x420E
_OPTIONS = 0x02 | 0x04 | 0x08 | 0x10 | 0x80  # TRACEFORK, TRACEVFORK, TRACECLONE, TRACEEXEC, TRACESECCOMP
_EVENT_FORK, _EVENT_VFORK, _EVENT_CLONE, _EVENT_EXEC, _EVENT_SECCOMP, _EVENT_STOP = 1, 2, 3, 4, 7, 128
_WALL = 0x40000000
_GROUP_STOPS = {signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}
_INFO = struct.Struct("=B3xIQQQ6Q")  # ptrace_syscall_info, seccomp: op, arch, ip, sp, nr, args


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Tracer:
    """Attached to one process and all it starts; notes the paths its calls name while recording is on."""

    def __init__(self, pid: int, token: str, report: str):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.libc.process_vm_readv.restype = ctypes.c_ssize_t
        self.libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                               ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        self.pid = pid
        self.mark = marker(token, "")
        self.report_path = report
        found = arch()
        assert found is not None
        self.table, self.audit_arch, self.x32 = found
        self.threads: dict[int, int] = {}  # tid -> the pid of the process it belongs to
        self.recording = False
        self.seen: dict[str, set[str]] = {}  # path -> kinds of access
        self.odd: list[str] = []  # what no path describes (a call of another architecture, a mount, a handle)
        self.processes: list[int] = []  # processes the traced one started (forks)
        self.stops = [0, 0]  # seccomp stops served: in all, and while recording
        self.info = ctypes.create_string_buffer(_INFO.size + 16)
        self.info_size = ctypes.c_void_p(len(self.info))
        self.page = ctypes.create_string_buffer(4096)
        self.local = _Iovec(ctypes.cast(self.page, ctypes.c_void_p), 0)  # reused on every read: one per call costs
        self.remote = _Iovec(0, 0)
        self.local_ref, self.remote_ref = ctypes.byref(self.local), ctypes.byref(self.remote)

    # attaching

    def attach(self) -> str | None:
        """Seize every thread of the process (again until none is new); why not, or None."""
        while True:
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
            except OSError as e:
                return f"cannot list the process's threads ({e.strerror})"
            new = [t for t in tids if t not in self.threads]
            if not new:
                return None
            for tid in new:
                if self.libc.ptrace(_PTRACE_SEIZE, tid, None, ctypes.c_void_p(_OPTIONS)) != 0:
                    err = ctypes.get_errno()
                    if err == errno.ESRCH:
                        continue  # the thread exited meanwhile
                    if tid != self.pid and err == errno.EPERM and self.threads:
                        self.threads[tid] = self.pid  # started by a seized thread: already ours (TRACECLONE)
                        continue
                    return f"ptrace: {os.strerror(err)}"
                self.threads[tid] = self.pid

    # serving

    def serve(self) -> None:
        while self.threads:
            try:
                tid, status = os.waitpid(-1, _WALL)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self.threads.pop(tid, None)
                continue
            if not os.WIFSTOPPED(status):
                continue
            event = status >> 16
            sig = os.WSTOPSIG(status)
            inject = 0
            if event == _EVENT_SECCOMP:
                self.stops[0] += 1
                self.stops[1] += self.recording
                self.stopped(tid)
            elif event in (_EVENT_FORK, _EVENT_VFORK, _EVENT_CLONE):
                child = ctypes.c_ulong()
                self.libc.ptrace(_PTRACE_GETEVENTMSG, tid, None, ctypes.byref(child))
                self.owner(child.value)
                if event != _EVENT_CLONE and self.recording:
                    self.processes.append(child.value)
            elif event == _EVENT_STOP:
                if sig in _GROUP_STOPS:
                    self.libc.ptrace(_PTRACE_LISTEN, tid, None, None)
                    continue
                self.owner(tid)  # a new thread or process's first stop
            elif event == _EVENT_EXEC:
                pass
            else:
                inject = sig  # a signal on its way to the process
            self.libc.ptrace(_PTRACE_CONT, tid, None, ctypes.c_void_p(inject))

    def owner(self, tid: int) -> int:
        """The process a thread belongs to (its thread group), read once."""
        found = self.threads.get(tid)
        if found is None:
            found = tid
            try:
                with open(f"/proc/{tid}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Tgid:"):
                            found = int(line.split()[1])
                            break
            except (OSError, ValueError):
                pass
            self.threads[tid] = found
        return found

    def stopped(self, tid: int) -> None:
        """A seccomp stop: note the paths the call names (unless it is a marker), then it goes on."""
        got = self.libc.ptrace(_PTRACE_GET_SYSCALL_INFO, tid, self.info_size, self.info)
        if got < _INFO.size:
            self.odd.append("a system call the tracer could not read")
            return
        op, call_arch, _, _, nr, *args = _INFO.unpack_from(self.info)
        if call_arch != self.audit_arch or (self.x32 is not None and nr & self.x32):
            self.note_odd(f"made a system call of another architecture ({nr})")
            return
        entry = self.table.get(nr)
        if entry is None:
            return
        name, kind, paths, flags_at = entry
        first = None  # the first path, read once: a stat's is read for a marker, then noted
        if kind in ("look", "lstat", "fstatat") and paths:
            first = self.string(tid, args[paths[0][1]])
            if first is not None and first.startswith(self.mark):
                self.command(first[len(self.mark):])
                return
        if not self.recording:
            return
        owner = self.owner(tid)
        if kind == "list":
            self.note(self.fd_path(tid, args[0]), "list", owner)
            return
        if kind in ("system", "handle"):
            self.note_odd(f"called {name}")
            return
        flags = args[flags_at] if flags_at is not None else 0
        if kind == "open2":
            flags = self.open_how(tid, args[2])
        for i, (dirfd_at, path_at) in enumerate(paths):
            text = first if i == 0 and first is not None else self.string(tid, args[path_at])
            if text is None:
                continue
            if text == "" and kind == "fstatat" and flags & AT_EMPTY_PATH:
                continue  # fstat of a descriptor: its open was seen
            dirfd = args[dirfd_at] if dirfd_at is not None else AT_FDCWD
            path = self.absolute(tid, dirfd, text)
            if path is None:
                self.note_odd(f"named a path by a descriptor the tracer could not resolve ({name})")
                continue
            self.note(path, self.access(kind, flags, name), owner)

    @staticmethod
    def access(kind: str, flags: int, name: str) -> str:
        if name in ("mkdir", "mkdirat"):
            return "mkdir"  # of a directory that may be there already (``os.makedirs(exist_ok=True)``)
        if kind in ("open", "open2"):
            if flags & O_PATH:
                return "look"
            if flags & (O_CREAT | O_TRUNC) or flags & O_ACCMODE:
                return "write"
            return "dir" if flags & O_DIRECTORY else "read"
        if kind == "fstatat":
            return "lstat" if flags & AT_SYMLINK_NOFOLLOW else "look"
        return kind

    def note(self, path: str | None, how: str, owner: int) -> None:
        if path is None:
            return
        if owner != self.pid:
            how = f"{owner}:{how}"  # a process it started: refused as such, unless it is lowercache's own
        self.seen.setdefault(path, set()).add(how)

    def note_odd(self, why: str) -> None:
        if self.recording and why not in self.odd:
            self.odd.append(why)

    def command(self, what: str) -> None:
        if what == "on":
            self.recording = True
        elif what == "off":
            self.recording = False
        elif what == "report":
            self.write_report()

    def write_report(self) -> None:
        report = {"seen": {p: sorted(h) for p, h in self.seen.items()}, "odd": self.odd, "processes": self.processes,
                  "stops": self.stops, "cpu": sum(os.times()[:2])}
        tmp = self.report_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, self.report_path)

    # reading the traced process

    def string(self, tid: int, address: int) -> str | None:
        """The NUL-terminated string at ``address`` in the thread's memory, read a page at a time (at most 4096 bytes)."""
        if address == 0:
            return None
        data = b""
        while len(data) < 4096:
            chunk = 4096 - (address + len(data)) % 4096
            self.local.len = self.remote.len = chunk
            self.remote.base = address + len(data)
            got = self.libc.process_vm_readv(tid, self.local_ref, 1, self.remote_ref, 1, 0)
            if got <= 0:
                return None
            part = self.page.raw[:got]
            end = part.find(b"\0")
            if end >= 0:
                return os.fsdecode(data + part[:end])
            data += part
        return None

    def open_how(self, tid: int, address: int) -> int:
        self.local.len = self.remote.len = 8
        self.remote.base = address
        if self.libc.process_vm_readv(tid, self.local_ref, 1, self.remote_ref, 1, 0) != 8:
            return O_ACCMODE  # unreadable: counted as a write
        return int.from_bytes(self.page.raw[:8], sys.byteorder)

    @staticmethod
    def fd_path(tid: int, fd: int) -> str | None:
        try:
            return os.readlink(f"/proc/{tid}/fd/{ctypes.c_int(fd).value}")
        except OSError:
            return None

    def absolute(self, tid: int, dirfd: int, path: str) -> str | None:
        if path.startswith("/"):
            return os.path.normpath(path) if "/." in path or "//" in path else path
        dirfd = ctypes.c_int(dirfd).value
        try:
            base = os.readlink(f"/proc/{tid}/cwd" if dirfd == AT_FDCWD else f"/proc/{tid}/fd/{dirfd}")
        except OSError:
            return None
        return os.path.normpath(os.path.join(base, path)) if path else base


def main() -> None:
    """Fork once (the process to trace must not have the tracer as its child: it may wait for its own children), say
    the tracer's pid on CONTROL, wait for the go on standard input (the process allows this pid to trace it), attach."""
    pid, control, token, report = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(number, signal.SIG_IGN)  # a Ctrl-C at the process's group is the process's, not the tracer's
    if os.fork():
        os._exit(0)
    os.write(control, struct.pack("=i", os.getpid()))
    if os.read(0, 1) != b"G":
        os._exit(0)
    tracer = Tracer(pid, token, report)
    why = tracer.attach()
    os.write(control, b"A" if why is None else b"E" + why.encode())
    os.close(control)
    if why is None:
        tracer.serve()
    directory = os.path.dirname(report)  # the process's own, made for this tracer: gone unless it never asked for a report
    for name in (report, report + ".tmp"):
        try:
            os.unlink(name)
        except OSError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass


if __name__ == "__main__":
    main()
