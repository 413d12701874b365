"""Direct mode: answer an unchanged ``lowercache lower`` without importing torch or running the model factory.

As ccache's direct mode skips the preprocessor, a normal ``lower`` run
records what its model factory (and the export that runs the model's
``forward``) read: the model file and every module outside the standard
library and site-packages, files opened (an audit hook sees them), files
looked at, directories listed, module names looked up, environment
variables read; plus the interpreter, the machine, the toolchain identity,
the settings that shape the result, and the flow key the run produced. A
later run whose recorded inputs all hash the same writes the flow entry
for that key, from the store, without importing torch.

A record is not used when it cannot be trusted: the factory did something
no record can capture (a network connection, a subprocess, a write, a
chdir), or the first re-run with identical inputs produced another flow
key (an unseeded random generator, the time): such a record is untrusted
for good. Every record waits for that first re-run before it is used. See
docs/direct-mode.md.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, TypeVar

from . import delegation, startup, sweep
from .cache.digests import digest, digest_json, stat_key
from .cache.store import Entry
from .cache.toolchain import lowercache_digest, toolchain_parts
from .config import Settings, load_settings
from .errors import LowercacheError
from .lowering import numerics
from .lowering.targets import resolve
from .output import check_output_dir, counted, write_files

KIND = "direct"
T = TypeVar("T")
RECORD_VERSION = 2
# A file changed less than this before its stat was recorded may change again
# without changing its timestamps (coarse file-system clocks): it is hashed.
RACY_NS = 2_000_000_000
# Variables native code reads at start-up (threads, CPU kernels, hash seed): recorded for every factory.
NATIVE_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ATEN_CPU_CAPABILITY", "PYTHONHASHSEED")
_SYSTEM_DIRS = ("/proc/", "/sys/", "/dev/")
_PYCACHE = os.sep + "__pycache__" + os.sep

# Audit events after which no record can say what the factory read. Network use on a remote tier's
# own call thread is the cache's traffic (its entries are checked like any other), not the code's.
_NETWORK = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
            "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.getnameinfo", "urllib.Request", "http.client.connect",
            "ftplib.connect", "smtplib.connect", "imaplib.open", "poplib.connect", "nntplib.connect", "webbrowser.open")
_UNRECORDABLE = {
    **dict.fromkeys(_NETWORK, "used the network"),
    **dict.fromkeys(
        ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn"),
        "ran a process",
    ),
    "os.chdir": "changed the working directory",
    "sqlite3.connect": "opened an SQLite database",
}


def _on_remote_thread() -> bool:
    """Whether this thread is a remote tier's call (a remote exists only once its module is imported)."""
    remote = sys.modules.get("lowercache.cache.remote")
    return remote is not None and threading.current_thread().name.startswith(remote.THREAD_PREFIX)


# Audit events that change files: a direct hit would not make the change. Paths in __pycache__ (bytecode) are the import system's.
_WRITES = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.link", "os.symlink",
           "os.utime", "shutil.rmtree", "shutil.move")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def opens_to_write(args: tuple[Any, ...]) -> bool:
    """Whether an ``open`` audit event's arguments (path, mode, flags) open the file to change it."""
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    mode = args[1] if isinstance(args[1], str) else ""
    return bool(flags & _WRITE_FLAGS) or any(c in mode for c in "wax+")


# -- where paths are: relative to the project root where they can be -----------------------------


def project_root(cwd: str) -> str:
    """The git work tree holding ``cwd``, else ``cwd``: records name files relative to it, so a copy elsewhere can hit."""
    return work_tree(cwd) or cwd


def work_tree(cwd: str) -> str | None:
    """The git work tree holding ``cwd``, or None."""
    probe = cwd
    while True:
        if os.path.exists(os.path.join(probe, ".git")):
            return probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent


def _site_dirs() -> dict[str, str]:
    import sysconfig

    paths = sysconfig.get_paths()
    return {name: os.path.normpath(paths[name]) for name in ("purelib", "platlib")}


def _stdlib_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(os.path.normpath(paths[name]) for name in ("stdlib", "platstdlib"))


class Places:
    """Turns absolute paths into portable references (``["root", rel]``, ``["purelib", rel]``, ``["abs", path]``) and back."""

    def __init__(self, root: str):
        self.anchors = {"root": os.path.normpath(root), **_site_dirs()}

    def ref(self, path: str) -> list[str]:
        path = os.path.normpath(path)
        for name, base in self.anchors.items():
            if path == base or path.startswith(base + os.sep):
                return [name, os.path.relpath(path, base)]
        return ["abs", path]

    def path(self, ref: Any) -> str:
        if not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(p, str) for p in ref)):
            raise ValueError("bad path reference")
        anchor, rel = ref
        if anchor == "abs":
            return rel
        if anchor not in self.anchors or os.path.isabs(rel):
            raise ValueError("bad path reference")
        return os.path.normpath(os.path.join(self.anchors[anchor], rel))


# -- what a path holds -------------------------------------------------------------------------------


# What a stat shows besides kind and content, by what the caller observed: ``os.access`` the mode bits and owner,
# ``os.stat``/``os.path.getmtime`` also the mtime. Kept only for paths a caller observed so (``Recorder.looked_at``).
_META = {"mode": ("mode", "uid", "gid"), "meta": ("mode", "uid", "gid", "mtime_ns")}


def stat_meta(st: os.stat_result, fields: Any) -> dict[str, int]:
    """The observed stat ``fields`` (``mode``, ``uid``, ``gid``, ``mtime_ns``) of ``st``."""
    if not set(fields) <= {"mode", "uid", "gid", "mtime_ns"}:
        raise ValueError("bad stat field")
    return {f: (stat.S_IMODE(st.st_mode) if f == "mode" else getattr(st, f"st_{f}")) for f in sorted(fields)}


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return digest(f.read())


def _listing_digest(path: str) -> str:
    return digest_json(sorted(os.listdir(path)))


def path_state(path: str, listing: bool = False, meta: Any = (), hashed: bool = True) -> dict[str, Any]:
    """What ``path`` is (file with its content digest, directory, missing), with its stat for a later fast check.

    ``meta``: stat fields a caller observed (:func:`stat_meta`), kept to compare exactly. ``hashed``
    false: a file's digest is left out (None), so only an unchanged stat proves it unchanged.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return {"kind": "missing"}
    if stat.S_ISDIR(st.st_mode):
        state: dict[str, Any] = {"kind": "dir"}
        if listing:
            state["digest"] = _listing_digest(path)
    elif stat.S_ISREG(st.st_mode):
        state = {"kind": "file", "digest": _file_digest(path) if hashed else None}
    else:
        return {"kind": "other"}
    state["stat"] = stat_key(st)
    if meta and state["kind"] == "file":  # a directory's mode and mtime are not kept (docs/direct-mode.md, Limits)
        state["meta"] = stat_meta(st, meta)
    return state


def bytecode_matches(source: str, cached: str | None) -> bool:
    """False when Python may have run ``cached`` for an older ``source``.

    A timestamp pyc is trusted by the source's size and whole-second mtime, so a
    save of the same size within the second its pyc was written runs the old
    code. Only then (the pyc no newer than that second) is the source compiled
    again and compared; a compare that cannot be made counts as a mismatch.
    """
    try:
        src, pyc = os.stat(source), os.stat(cached) if cached else None
    except OSError:
        return True  # no bytecode was read
    if pyc is None or pyc.st_mtime_ns >= (src.st_mtime_ns // 1_000_000_000 + 1) * 1_000_000_000:
        return True
    try:
        import marshal

        with open(cached, "rb") as f:
            header = f.read(16)
            body = f.read()
        if int.from_bytes(header[4:8], "little") & 1:
            return True  # a hash-based pyc is checked by content already
        stamp = (int(src.st_mtime) & 0xFFFFFFFF, src.st_size & 0xFFFFFFFF)
        if (int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")) != stamp:
            return True  # Python compiled the source afresh (with bytecode writing off, this pyc stays behind)
        with open(source, "rb") as f:
            code = compile(f.read(), source, "exec", dont_inherit=True)
        return marshal.loads(body) == code  # code objects compared, not marshal bytes (those vary with refcounts)
    except (OSError, SyntaxError, ValueError, EOFError, TypeError):
        return False


def same_state(path: str, recorded: dict[str, Any], recorded_ns: int, listing: bool = False) -> bool:
    """True when ``path`` holds what ``recorded`` says; the content is hashed unless the stat proves it unchanged.

    The stat proves it only when size, mtime, ctime, inode and device are all
    equal and the mtime and ctime were older than the record by more than
    :data:`RACY_NS` (git's racy-clean rule): ctime cannot be set back by a user.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return recorded.get("kind") == "missing"
    except OSError:
        return False
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
    if kind != recorded.get("kind") or kind == "other":
        return False
    meta = recorded.get("meta")
    if meta is not None and (not isinstance(meta, dict) or stat_meta(st, meta) != meta):
        return False
    if kind == "dir" and not listing:
        return True
    old = recorded.get("stat")
    if old == stat_key(st) and max(st.st_mtime_ns, st.st_ctime_ns) < recorded_ns - RACY_NS:
        return True
    if kind == "file" and recorded.get("digest") is None:
        return False  # swept unhashed (too large to hash at record time): only its stat could prove it
    try:
        now = _listing_digest(path) if kind == "dir" else _file_digest(path)
    except OSError:
        return False
    return now == recorded.get("digest")


def _cpu_digest() -> str:
    """The CPU's feature flags: torch picks its kernels (and so some float results) by them."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return digest(b" ".join(sorted(line.split(b":", 1)[1].split())))
    except OSError:
        pass
    return ""


def _env_digest(value: str | None) -> str | None:
    """Values are kept as digests: an environment holds secrets, and records travel to the remote."""
    return None if value is None else digest(value.encode("utf-8", "surrogateescape"))


def identity(settings: Settings, environ: dict[str, str] | Any) -> dict[str, Any]:
    """What the result depends on besides the factory's inputs: interpreter and its start-up, machine, toolchain, settings."""
    return {
        "python": sys.version,
        "cache_tag": sys.implementation.cache_tag,
        "machine": os.uname().machine,
        "cpu": _cpu_digest(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "toolchain": toolchain_parts(),
        "speedups": settings.speedups,
        "native_env": {name: _env_digest(environ.get(name)) for name in NATIVE_ENV},
        "startup": startup.state(environ),
    }


# -- the request: which record answers it ------------------------------------------------------------


@dataclass
class Request:
    """A ``lower`` command as given: what names its record."""

    model: str
    target: str
    out_dir: str
    per_tensor: bool = False
    calibration: str | None = None
    cache_dir: str | None = None
    no_cache: bool = False
    remote: str | None = None
    no_direct: bool = False
    as_json: bool = False
    system_config: str | None = None
    memory_mode: str | None = None
    check: bool = False  # the numerics check (lowering/numerics.py): its own record, which names the check's entry
    min_snr: str | None = None
    cwd: str = field(default_factory=os.getcwd)

    @property
    def root(self) -> str:
        return project_root(self.cwd)

    def key(self) -> str:
        """The record's key: the model and calibration as given, the working directory relative to the project root, target, flags."""
        return digest_json(
            {
                "version": RECORD_VERSION,
                "model": self.model,
                "cwd": os.path.relpath(self.cwd, self.root),
                "target": self.target,
                "per_tensor": self.per_tensor,
                "calibration": self.calibration,
                "vela": [self.system_config, self.memory_mode],
                **({"check": True} if self.check else {}),
            }
        )

    def history_name(self) -> str:
        """The name ``lower`` records run history under (as ``cli._model_name``)."""
        if self.model.endswith(".pt2"):
            return os.path.abspath(self.model)
        path, _, factory = self.model.rpartition(":")
        return f"{os.path.abspath(path)}:{factory}"

    def settings(self) -> Settings:
        return load_settings(
            cache_dir=Path(self.cache_dir) if self.cache_dir else None,
            disable=True if self.no_cache else None,
            remote=self.remote,
            direct=False if self.no_direct else None,
            check=True if self.check or self.min_snr is not None else None,
        )


_VALUE_OPTIONS = {"--target": "target", "-t": "target", "--out": "out_dir", "-o": "out_dir", "--cache-dir": "cache_dir",
                  "--calibration": "calibration", "--remote": "remote", "--system-config": "system_config",
                  "--memory-mode": "memory_mode", "--min-snr": "min_snr"}
_FLAG_OPTIONS = {"--no-cache": "no_cache", "--per-tensor": "per_tensor", "--no-direct": "no_direct", "--json": "as_json", "--check": "check",
                 "--no-server": None}


def parse_lower(args: list[str]) -> Request | None:
    """A plain ``lower`` command line, or None for anything else (which the full CLI then handles, errors included)."""
    args = list(args)
    while args and args[0] in ("-v", "--verbose"):
        args.pop(0)
    if not args or args[0] != "lower":
        return None
    values: dict[str, Any] = {}
    positional: list[str] = []
    rest = iter(args[1:])
    for arg in rest:
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in _VALUE_OPTIONS:
            value = inline if eq else next(rest, None)
            field_name = _VALUE_OPTIONS[name]
            if value is None or field_name in values:
                return None
            values[field_name] = value
        elif name in _FLAG_OPTIONS and not eq:
            if _FLAG_OPTIONS[name] is not None:
                values[_FLAG_OPTIONS[name]] = True
        elif arg.startswith("-"):
            return None
        else:
            positional.append(arg)
    if len(positional) != 1 or "target" not in values or "out_dir" not in values:
        return None
    if "calibration" in values:
        values["calibration"] = str(Path(values["calibration"]))  # as the CLI's Path option gives it to start()
    return Request(model=positional[0], **values)


# -- recording ---------------------------------------------------------------------------------------


_active: list["Recorder"] = []
# lowercache's own threads (the progress display at a terminal), by identity: a factory's thread of the same name still counts.
_own_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def own_thread(thread: threading.Thread) -> None:
    """Mark a thread lowercache itself started while a recorder listens: no factory left it running."""
    _own_threads.add(thread)


_hooked = False
# The environment as the process started (taken by serve() before anything else runs): torch sets
# variables of its own at import, and a record must compare what the user's environment held.
_initial_env: dict[str, str] | None = None


_heard: frozenset[str] = frozenset()  # the listening recorder's ``heard``: a global is the cheapest test per event


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _heard and _active and not _active[-1].paused and not _run_ahead_unheard():
        _active[-1].event(event, args)


def _run_ahead_unheard() -> bool:
    """Whether this thread forks ``lowercache run``'s runner, or is that runner (``lowering/runahead.py``, not imported
    by the client: 7 ms it need not pay)."""
    unrecorded = getattr(sys.modules.get("lowercache.lowering.runahead"), "unrecorded", None)  # None while it is imported
    return unrecorded is not None and unrecorded()


# This module and replay.py (whose recorder hands events on to this one's): frames of neither raised an event.
_RECORDER_FILES = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("direct.py", "replay.py"))


def _event_caller() -> Any:
    """The frame that raised the audit event being handled: the first outside the recorder's own modules."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _RECORDER_FILES:
        frame = frame.f_back
    return frame


def _abspath(path: Any) -> str | None:
    if isinstance(path, int) or path is None:
        return None
    try:
        return os.path.abspath(os.fsdecode(os.fspath(path)))
    except TypeError:
        return None


# Modules whose file was looked up ahead (``remember_modules``), by identity: the warm server's, so that each
# child's record need not ask 5000 modules for their ``__file__`` again (0.02 s per command).
_module_files: dict[int, tuple[Any, str | None]] = {}


def remember_modules() -> None:
    """Look up every imported module's file now, for records made later in this process or its forked children."""
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if not isinstance(origin, str) or os.path.isabs(origin):  # a relative one depends on the working directory
            _module_files[id(module)] = (module, _absolute(origin))


def _module_file(module: Any) -> str | None:
    """The absolute path of the module's ``__file__``, or None if it has none."""
    known = _module_files.get(id(module))
    if known is not None and known[0] is module:
        return known[1]
    return _absolute(getattr(module, "__file__", None))


def _absolute(origin: Any) -> str | None:
    return os.path.abspath(origin) if isinstance(origin, str) else None


class Recorder:
    """Collects what the factory reads while it is imported and run, and while its model is exported.

    ``paused`` while lowercache's own stages run: their reads are the toolchain's, covered by its identity.
    """

    def __init__(self, request: Request, settings: Settings):
        self.request = request
        self.settings = settings
        self.places = Places(request.root)
        self.covered = tuple(d + os.sep for d in (*_stdlib_dirs(), *self.places.anchors.values()) if d != self.places.anchors["root"])
        package = os.path.dirname(os.path.abspath(__file__))
        self.covered += tuple(os.path.join(package, room) + os.sep for room in ("cache", "lowering", "speedups"))
        self.paused = True
        self.paths: set[str] = set()
        self.listings: set[str] = set()
        self.lookups: set[str] = set()
        self.env: dict[str, str | None] = {}
        self.env_listed = False
        self.unrecordable: list[str] = []
        self.written: set[str] = set()
        self._looked: set[str] = set()  # paths ``looked_at`` already took: linecache stats each file again and again
        import tempfile

        self.scratch = (os.path.realpath(tempfile.gettempdir()) + os.sep, os.path.abspath(tempfile.gettempdir()) + os.sep)
        self.syspath = [self.places.ref(os.path.abspath(p or ".")) for p in sys.path]
        self.started_ns = time.time_ns()
        self._threads = set(threading.enumerate())
        self.meta: dict[str, set[str]] = {}  # path -> stat fields a caller observed (``looked_at``)
        self.located: list[str] = []  # how the code observed where the project is (``observed_location``)
        self.package = os.path.dirname(os.path.abspath(__file__)) + os.sep
        self.bytecode: dict[str, str] = {}  # source -> the .pyc that ran for it (``ran_bytecode``)
        self.initial_env = dict(initial_environ())
        self.stdlib = tuple(d + os.sep for d in _stdlib_dirs())

    def _user(self, path: str) -> bool:
        return not path.startswith(self.covered) and not path.startswith(_SYSTEM_DIRS) and "__pycache__" not in path

    def refuse(self, why: str) -> None:
        if why not in self.unrecordable:
            self.unrecordable.append(why)

    # The events ``event`` acts on; the hook passes no other. ``builtins.id`` alone fires 220 000 times in the strict
    # re-export of a quantized MobileNetV2, and going through these checks took 1.2 us per event, where the hook's
    # membership test (``_heard``) takes 0.2 us.
    heard: ClassVar[frozenset[str]] = frozenset(
        {"open", "os.listdir", "os.scandir", "import", "compile", "ctypes.dlopen", *_UNRECORDABLE, *_WRITES}
    )

    def event(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path = _abspath(args[0])
            if path is None:
                if isinstance(args[0], int) and args[0] > 2:
                    self.opened_fd(args[0])
                return
            if opens_to_write(args):
                self.wrote(path)
            elif self._user(path):
                self.paths.add(path)
            elif path.endswith(".pyc") and _PYCACHE in path and not path.startswith(self.covered):
                self.ran_bytecode(path)
        elif event in ("os.listdir", "os.scandir"):
            self.listed(args, sys._getframe(2))  # frames: event, _audit, the caller of os.listdir
        elif event == "import":
            self.lookups.add(args[0])
        elif event in _UNRECORDABLE:
            if not (event in _NETWORK and _on_remote_thread()):
                self.refuse(_UNRECORDABLE[event])
        elif event in _WRITES:
            remade = _abspath(args[0]) if event == "os.mkdir" and args[2] == -1 else None
            if remade is not None and os.path.isdir(remade):
                self.remade(remade)
                return
            for path in [_abspath(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]:
                self.wrote(path or "?")
        elif event == "compile":
            self.compiled(args, _event_caller())
        elif event == "ctypes.dlopen" and isinstance(args[0], str) and os.sep in args[0]:
            path = os.path.abspath(args[0])
            if self._user(path):
                self.paths.add(path)

    def opened_fd(self, fd: int) -> None:
        """``open(fd)``: importlib writes bytecode so (``_write_atomic``: ``os.open``, then ``FileIO(fd)``), a scratch write.

        Any other descriptor (a pipe, a socket, a file of the user's) says nothing of what it reads: refused.
        """
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if os.path.isabs(target) and _PYCACHE in target:
            self.wrote(target)
        else:
            self.refuse("opened a file descriptor")

    def ran_bytecode(self, pyc: str) -> None:
        """A ``.pyc`` read stands for its source: a module run from it (``exec_module`` of a file outside
        ``sys.modules``, ``torch.hub.load(source='local')``) stats its source but never opens it."""
        import importlib.util

        try:
            source = importlib.util.source_from_cache(pyc)
        except ValueError:
            return
        if self._user(source):
            self.paths.add(source)
            self.bytecode[source] = pyc

    def listed(self, args: tuple[Any, ...], caller: Any) -> None:
        """A directory listing made from frame ``caller``."""
        if caller.f_code.co_filename.startswith("<frozen importlib") or not self.by_user(caller):
            return  # the import system's scans (module lookups are recorded by name), installed libraries' own
        path = _abspath(args[0] if args and args[0] is not None else ".")
        if path is None:
            self.refuse("listed a directory by descriptor")
        elif self._user(path):
            self.listings.add(path)

    def remade(self, path: str) -> None:
        """``os.mkdir`` of a directory there already fails (EEXIST) and changes nothing: ``os.makedirs(exist_ok=True)``,
        as torch's ``cache_dir()`` does for ``TORCHINDUCTOR_CACHE_DIR`` in every process once one has lowered."""

    def wrote(self, path: str) -> None:
        """A file the window changed is no input; outside scratch space (temporary files, bytecode) it is a side effect a hit would skip."""
        self.written.add(path)
        scratch = path.startswith(self.scratch) or "__pycache__" in path or path == os.devnull
        if not scratch:
            self.refuse(f"wrote {path}")

    def looked_at(self, path: Any, how: str = "kind") -> None:
        """``os.stat`` and friends: whether a file exists can decide what the factory does, and so can its
        mode (``how`` ``mode``: ``os.access``) or mtime (``meta``: ``os.stat``, ``os.path.getmtime``)."""
        if type(path) is str:
            if (path, how) in self._looked:
                return
            self._looked.add((path, how))  # a relative path is the same file throughout: a change of directory is refused
        found = _abspath(path)
        if found is not None and self._user(found):
            self.paths.add(found)
            if how != "kind":
                self.meta.setdefault(found, set()).update(_META[how])

    def observed_location(self, how: str, frame: Any) -> None:
        """The code at ``frame`` learnt where the project is (``os.getcwd()``; ``how`` says how), unless it is
        lowercache's or an installed library's: a record of it cannot answer in another directory."""
        while frame is not None and frame.f_code.co_filename.startswith(("<frozen", *self.stdlib)):
            frame = frame.f_back
        if frame is None:
            return
        filename = os.path.abspath(frame.f_code.co_filename)
        if self._user(filename) and not filename.startswith(self.package) and how not in self.located:
            self.located.append(how)

    def compiled(self, args: tuple[Any, ...], frame: Any) -> None:
        """``compile()`` of source text by the user's code (``exec``, ``eval``): read for what it observes of its location."""
        if self.by_user(frame) and isinstance(args[0], (str, bytes)):
            found = sweep.LOCATION_NAMES.search(args[0] if isinstance(args[0], bytes) else args[0].encode("utf-8", "replace"))
            if found is not None:
                self.observed_location(f"code it compiled names {found.group().decode()}", frame)

    def read_env(self, key: Any) -> None:
        """The variable's value as the process started: a value set since is derived from it and from recorded code."""
        name = os.fsdecode(key) if isinstance(key, (str, bytes)) else repr(key)
        self.env[name] = _env_digest(self.initial_env.get(name))

    def by_user(self, frame: Any) -> bool:
        """Whether the first frame outside the standard library is the user's code (not an installed library's).

        Listings made by installed libraries (networkx lists the environment for its own prefix,
        importlib.metadata lists every search-path directory for torch) are left to the toolchain identity.
        """
        while frame is not None and frame.f_code.co_filename.startswith(("<frozen", *self.stdlib)):
            frame = frame.f_back
        return frame is None or self._user(os.path.abspath(frame.f_code.co_filename))

    def listed_env(self, frame: Any) -> None:
        """The environment was listed by the user's code: a new variable can then change what the factory does."""
        if self.by_user(frame):
            self.env_listed = True

    def stage(self, label: str) -> None:
        """The flow's stage listener: record while the model is exported (its ``forward`` runs), not during lowering."""
        if label == "export":
            self.paused = False
        else:
            self.pause()

    def pause(self) -> None:
        """Stop listening; a thread the window started and left running could read more, unseen."""
        if not self.paused:
            self.paused = True
            started = [t for t in threading.enumerate() if t not in self._threads and t not in _own_threads]
            if started:
                self.refuse(f"left a thread running ({sorted(t.name for t in started)[0]})")

    def close(self) -> None:
        """Stop recording for good (after the export stage)."""
        self.pause()
        if self in _active:
            _active.remove(self)

    def add_file(self, path: str) -> None:
        self.paths.add(os.path.abspath(path))

    def inputs(self) -> dict[str, Any]:
        """The recorded inputs, hashed now (outside the window)."""
        files = self.paths - self.written
        for module in list(sys.modules.values()):
            origin = _module_file(module)
            if origin is not None and self._user(origin):
                files.add(origin)
                if not bytecode_matches(module.__file__, getattr(module, "__cached__", None)):
                    self.refuse(f"ran bytecode that may be older than {origin} (saved twice in one second)")
        for source, pyc in sorted(self.bytecode.items()):
            if not bytecode_matches(source, pyc):
                self.refuse(f"ran bytecode that may be older than {source} (saved twice in one second)")
        root = self.places.anchors["root"]
        swept, why = sweep.sweep(root, self.beside(), self.unswept(), self._user)
        if why is not None:
            self.refuse(why)
        hashed = 0
        states = []
        for path in sorted(files | (set(swept) - self.written)):
            if path in files:
                state = path_state(path, meta=self.meta.get(path, ()))
            else:  # swept: hashed while the total stays small, else proven unchanged by its stat only
                size = _size(path)
                hashed += size
                state = path_state(path, hashed=hashed <= sweep.HASH_BYTES)
            if state["kind"] == "other":
                self.refuse(f"read {path}, which is not a regular file")
            elif state["kind"] == "file" and max(state["stat"][1:3]) >= self.started_ns - RACY_NS // 40:
                self.refuse(f"read {path} while it was changing")
            states.append([self.places.ref(path), state])
        listings = [[self.places.ref(p), path_state(p, listing=True)] for p in sorted(self.listings)]
        for name, base in self.places.anchors.items():
            if name != "root" and os.path.isdir(base):
                listings.append([[name, "."], path_state(base, listing=True)])
        env = dict(self.env)
        if self.env_listed:
            env.update({name: _env_digest(value) for name, value in self.initial_env.items()})
            env["<listed>"] = digest_json(sorted(self.initial_env))
        return {
            "files": states,
            "listings": listings,
            "lookups": self._lookups(),
            "syspath": self.syspath,
            "env": env,
            "location": self.location(root, files),
        }

    def beside(self) -> list[str]:
        """Directories whose every file native code may read: the model file's."""
        path = self.request.model if self.request.model.endswith(".pt2") else self.request.model.rpartition(":")[0]
        return [os.path.dirname(os.path.join(self.request.cwd, path))] if path else []

    def unswept(self) -> list[str]:
        """Directories the sweep leaves out: the output directory (lowercache writes it) and the cache."""
        return [os.path.join(self.request.cwd, self.request.out_dir), str(self.settings.cache_dir)]

    def location(self, root: str, files: set[str]) -> dict[str, Any]:
        """Where the record was made, and whether it may answer elsewhere (``portable``): only in a git work
        tree, and only when no code it ran can have seen its directory (see ``sweep.LOCATION_NAMES``)."""
        why = "" if work_tree(root) == root else "the working directory is not in a git work tree"
        for path in sorted(files):
            if why or self.located:
                break
            if path.endswith(".py") and not path.startswith(self.package):  # lowercache's own: the toolchain's
                try:
                    with open(path, "rb") as f:
                        found = sweep.LOCATION_NAMES.search(f.read())
                except OSError:
                    found = None
                if found is not None:
                    why = f"{os.path.relpath(path, root)} names {found.group().decode()}"
        why = why or (self.located[0] if self.located else "")
        return {"root": root, "portable": not why, "why": why}

    def _lookups(self) -> list[list[Any]]:
        """For each module name looked up: what the user's search directories hold under that name (a new file may shadow it)."""
        found = []
        searched: dict[str, list[str]] = {}  # parent package ("" for top level) -> its user search directories
        listings: dict[str, list[str] | None] = {}  # directory -> its entries, listed once
        for name in sorted(self.lookups):
            parent, _, last = name.rpartition(".")
            if parent not in searched:
                if parent:
                    dirs = list(getattr(sys.modules.get(parent), "__path__", None) or [])
                else:
                    dirs = [os.path.abspath(p or ".") for p in sys.path]
                searched[parent] = [d for d in dirs if isinstance(d, str) and self._user(os.path.abspath(d) + os.sep)]
            for d in searched[parent]:
                if d not in listings:
                    listings[d] = _entries(d)
                found.append([self.places.ref(os.path.abspath(d)), last, _named(listings[d], last)])
        return found


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _matching(directory: str, name: str) -> list[str]:
    return _named(_entries(directory), name)


def _entries(directory: str) -> list[str] | None:
    """The directory's entries, None when it cannot be listed."""
    try:
        return os.listdir(directory)
    except OSError:
        return None


def _named(entries: list[str] | None, name: str) -> list[str]:
    """The entries a module ``name`` could be found as (None: the directory is unreadable)."""
    if entries is None:
        return ["<unreadable>"]
    return sorted(e for e in entries if e == name or e.startswith(name + "."))


# Where a listing of the environment reads every value: ItemsView/ValuesView.__iter__, _Environ.copy.
_LISTING_FRAMES = {("<frozen _collections_abc>", "__iter__"), ("<frozen os>", "copy")}


def _current() -> Recorder | None:
    return _active[-1] if _active and not _active[-1].paused else None


def _install() -> None:
    """Once per process: the audit hook (which cannot be removed), and watchers on ``os.environ`` and ``os.stat``.

    All three are idle unless a recorder is active and not paused. Every read
    of ``os.environ`` (``os.getenv``, ``in``, ``.get``) goes through
    ``__getitem__``; listing it (``__iter__``, ``__len__``) records the whole
    environment. ``os.path.exists`` and friends call ``os.stat``: a file the
    factory only looked for is an input too. The import system uses
    ``posix.stat`` directly and is not seen (module lookups are recorded by name).
    """
    global _hooked
    if _hooked:
        return
    _hooked = True
    sys.addaudithook(_audit)
    cls = type(os.environ)
    getitem, iterate, length = cls.__getitem__, cls.__iter__, cls.__len__

    def watched_getitem(self: Any, key: Any) -> Any:
        if (recorder := _current()) is not None:
            caller = sys._getframe(1).f_code
            if (caller.co_filename, caller.co_name) in _LISTING_FRAMES:  # items(), values(), copy(): part of a listing
                recorder.listed_env(sys._getframe(2))
            else:
                recorder.read_env(key)
        return getitem(self, key)

    def listed() -> None:
        if (recorder := _current()) is not None:
            recorder.listed_env(sys._getframe(2))

    def watched_iter(self: Any) -> Iterator[Any]:
        listed()
        return iterate(self)

    def watched_len(self: Any) -> int:
        listed()
        return length(self)

    cls.__getitem__, cls.__iter__, cls.__len__ = watched_getitem, watched_iter, watched_len

    def wrap(fn: Callable[..., Any], how: str) -> Callable[..., Any]:
        def watched(path: Any, *args: Any, **kwargs: Any) -> Any:
            if (recorder := _current()) is not None:
                recorder.looked_at(path, _observed(sys._getframe(1), how))
            return fn(path, *args, **kwargs)

        return watched

    for name, how in (("stat", "meta"), ("lstat", "meta"), ("access", "mode")):
        setattr(os, name, wrap(getattr(os, name), how))

    def located(fn: Callable[[], Any]) -> Callable[[], Any]:
        def watched() -> Any:
            if (recorder := _current()) is not None:
                recorder.observed_location("it called os.getcwd()", sys._getframe(1))
            return fn()

        return watched

    os.getcwd, os.getcwdb = located(os.getcwd), located(os.getcwdb)
    _watch_posix_environ()


# Callers of ``os.stat`` that observe only what a path is (missing, file, directory), not its mode or mtime;
# linecache's checks only decide whether to read a source again.
_KIND_ONLY = frozenset({"exists", "lexists", "isfile", "isdir", "islink", "is_file", "is_dir", "is_symlink", "realpath",
                        "checkcache", "updatecache"})


def _observed(frame: Any, how: str) -> str:
    """``kind`` when the standard-library function calling ``os.stat`` (or its caller) only tests what a path is, else ``how``."""
    while frame is not None and frame.f_code.co_filename.startswith(("<frozen", *_stdlib_prefixes())):
        if frame.f_code.co_name in _KIND_ONLY:
            return "kind"
        frame = frame.f_back
    return how


def _stdlib_prefixes() -> tuple[str, ...]:
    return _active[-1].stdlib if _active else ()


class _WatchedEnvironData(dict):  # type: ignore[type-arg]
    """``posix.environ``: the bytes dict ``os.environ`` and ``os.environb`` keep their data in. Read from Python
    (``posix.environ[b'X']``), it is a variable read; listed, the environment is. ``os``'s own use is its wrappers'."""

    def __getitem__(self, key: Any) -> Any:
        _raw(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        _raw(key)
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        _raw(key)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        _raw()
        return super().__iter__()

    def keys(self) -> Any:
        _raw()
        return super().keys()

    def items(self) -> Any:
        _raw()
        return super().items()

    def values(self) -> Any:
        _raw()
        return super().values()

    def copy(self) -> dict[Any, Any]:
        _raw()
        return dict(super().items())

    def __len__(self) -> int:
        _raw()
        return super().__len__()


_LISTED = object()


def _raw(key: Any = _LISTED) -> None:
    """A read of ``posix.environ[key]`` (without ``key``: a listing of it) by the frame calling its method."""
    if (recorder := _current()) is None:
        return
    frame = sys._getframe(2)
    if frame.f_code.co_filename == "<frozen os>":
        return
    if key is _LISTED:
        recorder.listed_env(frame)
    else:
        recorder.read_env(key)


def _watch_posix_environ() -> None:
    """Put :class:`_WatchedEnvironData` in place of ``posix.environ``, as the one dict ``os.environ`` and ``os.environb`` share."""
    import posix

    data = getattr(os.environ, "_data", None)
    if type(data) is not dict or data is not getattr(posix, "environ", None) or getattr(os.environb, "_data", None) is not data:
        return
    watched = _WatchedEnvironData(data)
    os.environ._data = watched  # type: ignore[attr-defined]
    os.environb._data = watched  # type: ignore[attr-defined]
    posix.environ = watched  # type: ignore[attr-defined]


def listen(recorder: Recorder) -> None:
    """Make ``recorder`` the one that hears the audit hook and the watchers (installed once per process)."""
    global _heard
    lowercache_digest()  # its memo file is read and written now, not heard as the recorded code's
    _install()
    _heard = recorder.heard
    _active[:] = [recorder]


def start(model: str, target: str, out_dir: Any, per_tensor: bool, calibration: Any, settings: Settings,
          system_config: str | None = None, memory_mode: str | None = None) -> Recorder | None:
    """A (paused) recorder for this ``lower`` run, or None when direct mode is off or nothing could be stored."""
    if not settings.direct or settings.disable or settings.read_only:
        return None
    request = Request(model=model, target=target, out_dir=str(out_dir), per_tensor=per_tensor,
                      calibration=str(calibration) if calibration is not None else None,
                      system_config=system_config, memory_mode=memory_mode, check=settings.check)
    recorder = Recorder(request, settings)
    listen(recorder)  # one lowering at a time; a failed run's recorder is dropped
    if calibration is not None:
        recorder.add_file(str(calibration))
    return recorder


def recorded(recorder: Recorder | None, load: Callable[[str], T], model: str) -> T:
    """``load(model)`` (import the model file, run its factory) with the recorder listening."""
    if recorder is None:
        return load(model)
    recorder.paused = False
    try:
        return load(model)
    finally:
        recorder.pause()


def listening(recorder: Recorder | None, listener: Callable[[str, Any, str], None]) -> Callable[[str, Any, str], None]:
    """The flow's listener, also telling the recorder which stage runs (only the export is recorded)."""
    if recorder is None:
        return listener

    def both(phase: str, record: Any, label: str) -> None:
        if phase == "stage":
            recorder.stage(label)
        listener(phase, record, label)

    return both


def finish(recorder: Recorder | None, records: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """Store the record of a finished run; ``manifest["direct"]`` says what became of it."""
    if recorder is None:
        return
    recorder.close()
    flow = next((r for r in records if r.get("kind") == "flow"), None)
    if flow is None or flow.get("outcome") not in ("hit", "miss"):
        manifest["direct"] = {"record": "none", "reason": "the flow step was not cached"}
        return
    from .cache.tiers import open_store

    try:
        store = open_store(recorder.settings)
    except LowercacheError:
        return
    try:
        _store_record(recorder, store, flow, manifest)
    finally:
        store.close()


def _store_record(recorder: Recorder, store: Any, flow: dict[str, Any], manifest: dict[str, Any]) -> None:
    request = recorder.request
    inputs = recorder.inputs()
    ident = identity(recorder.settings, recorder.initial_env)
    record = {
        "version": RECORD_VERSION,
        "request": {"model": request.model, "target": request.target, "per_tensor": request.per_tensor, "calibration": request.calibration},
        "identity": ident,
        "inputs": inputs,
        "recorded_ns": time.time_ns(),
        "flow": {"name": flow["name"], "key": flow["key"]},
        "manifest": {k: v for k, v in manifest.items() if k in _KEPT_MANIFEST},
    }
    key = request.key()
    old = _load(store, key)
    since = None
    if old is not None:
        try:
            since = _changed(old, request, recorder.settings, recorder.syspath, recorder.initial_env)
        except (ValueError, KeyError, TypeError):
            old, since = None, None  # a malformed previous record confirms nothing
    record["status"], record["reason"] = _verdict(old, since, record, recorder.unrecordable)
    store.put(KIND, key, Entry(meta=record))
    manifest["direct"] = {"record": record["status"], "reason": record["reason"]}
    _set_status(store, request, "record", record["status"], record["reason"])


def _verdict(old: dict[str, Any] | None, since: str | None, record: dict[str, Any], unrecordable: list[str]) -> tuple[str, str]:
    """``untrusted`` (never used), ``unconfirmed`` (waits for a re-run with the same inputs) or ``confirmed`` (used).

    ``since``: what changed since the previous record, judged as a lookup judges it (so a run that merely
    touched other paths, say a bytecode file it wrote the first time, still confirms).
    """
    if old is not None and old.get("status") == "untrusted" and old.get("for_good"):
        record["for_good"] = True
        return "untrusted", old.get("reason", "untrusted")
    if unrecordable:
        return "untrusted", f"the factory {unrecordable[0]}"
    if old is None or old.get("status") == "untrusted" or since is not None:
        changed = f" ({since} since the previous record)" if since else ""
        return "unconfirmed", f"recorded{changed}; used once a re-run with the same inputs gives the same flow key"
    if old.get("flow", {}).get("key") != record["flow"]["key"]:
        record["for_good"] = True
        return "untrusted", (
            "identical inputs lowered differently (another flow key): the factory reads something direct mode "
            "cannot see, such as an unseeded random generator or the time"
        )
    return "confirmed", "a re-run with the same inputs gave the same flow key"


_KEPT_MANIFEST = ("model", "target", "quantization", "toolchain", "speedups", "key_parts", "numerics")


# -- answering ---------------------------------------------------------------------------------------


def _load(store: Any, key: str) -> dict[str, Any] | None:
    entry = store.get(KIND, key)
    if entry is None or entry.blobs or not isinstance(entry.meta, dict) or entry.meta.get("version") != RECORD_VERSION:
        return None
    return entry.meta


def _status_name(request: Request, which: str) -> str:
    return f"direct/{which}/{request.target.strip().lower()}/{request.history_name()}"


def _set_status(store: Any, request: Request, which: str, outcome: str, reason: str) -> None:
    """``which``: ``lookup`` (what the latest run's lookup found) or ``record`` (what the latest record became)."""
    put_status(store, _status_name(request, which), outcome, reason)


def put_status(store: Any, name: str, outcome: str, reason: str) -> None:
    """Remember what a lookup found or a record became, for ``explain`` (``lowercache run``'s records too)."""
    if getattr(store, "writable", False):
        store.put_record(name, {"time": time.time(), "outcome": outcome, "reason": reason})


def status_lines(store: Any, name: Callable[[str], str], prefix: str = "") -> list[str]:
    """The remembered lookup and record outcomes (``name("lookup")``, ``name("record")``), one line each."""
    lines = []
    for which, label in (("lookup", "latest lookup"), ("process", "latest run"), ("record", "latest record")):
        status = store.get_record(name(which))
        if isinstance(status, dict):
            lines.append(f"{prefix}{label}: {status.get('outcome')}: {status.get('reason')}")
    return lines


def _changed(
    record: dict[str, Any], request: Request, settings: Settings, syspath: list[list[str]], environ: dict[str, str] | Any
) -> str | None:
    """What differs between the record and now, or None when every recorded input is the same.

    ``syspath`` and ``environ``: the module search path and environment the process started with.
    """
    _check_shape(record)
    why = identity_changed(record.get("identity"), identity(settings, environ))
    if why is not None:
        return why
    inputs = record["inputs"]
    if inputs["syspath"] != syspath:
        return "the module search path changed"
    return inputs_changed(inputs, Places(request.root), record["recorded_ns"], request.cwd, environ)


def identity_changed(recorded: Any, now: dict[str, Any]) -> str | None:
    """Which parts of the interpreter, machine, toolchain and settings identity differ, or None."""
    if recorded == now:
        return None
    recorded = recorded if isinstance(recorded, dict) else {}
    if recorded.get("startup") != now.get("startup"):
        return startup.changed(recorded.get("startup"), now["startup"], "the record's")
    parts = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    return f"the {', '.join(parts)} changed"


def inputs_changed(inputs: dict[str, Any], places: Places, recorded_ns: int, cwd: str, environ: dict[str, str] | Any) -> str | None:
    """What differs between recorded inputs (variables, files, listings, module lookups) and now, or None.

    Shared by ``lower``'s records and ``lowercache run``'s command records (``replay.py``).
    """
    location = inputs["location"]
    if location["root"] != places.anchors["root"] and not location["portable"]:
        return f"the project is in another directory than the record's ({location['root']}), and {location['why']}"
    for name, value in inputs["env"].items():
        if name == "<listed>":
            if value != digest_json(sorted(environ)):
                return "the environment's variables changed (the factory listed them)"
        elif _env_digest(environ.get(name)) != value:
            return f"environment variable {name} changed"
    for ref, state in inputs["files"]:
        path = places.path(ref)
        if not same_state(path, state, recorded_ns):
            return f"{os.path.relpath(path, cwd) if ref[0] == 'root' else path} changed"
    for ref, state in inputs["listings"]:
        if not same_state(places.path(ref), state, recorded_ns, listing=True):
            return f"directory {places.path(ref)} changed"
    for ref, name, entries in inputs["lookups"]:
        if _matching(places.path(ref), name) != entries:
            return f"what module {name} resolves to changed"
    return None


def _check_shape(record: dict[str, Any]) -> None:
    """A record read from a store is checked field by field before any of it is used."""
    flow = record.get("flow")
    if not (
        isinstance(flow, dict)
        and isinstance(flow.get("key"), str)
        and isinstance(record.get("recorded_ns"), int)
        and isinstance(record.get("manifest"), dict)
    ):
        raise ValueError("the record is malformed")
    check_inputs(record.get("inputs"))


def check_inputs(inputs: Any) -> None:
    """Recorded inputs read from a store, checked field by field (``ValueError`` when malformed)."""
    if not (
        isinstance(inputs, dict)
        and all(isinstance(inputs.get(k), list) for k in ("files", "listings", "lookups", "syspath"))
        and isinstance(inputs.get("env"), dict)
        and isinstance(inputs.get("location"), dict)
        and isinstance(inputs["location"].get("root"), str)
        and isinstance(inputs["location"].get("portable"), bool)
        and isinstance(inputs["location"].get("why"), str)
        and all(isinstance(s, list) and len(s) == 2 and isinstance(s[1], dict) for s in inputs["files"] + inputs["listings"])
        and all(isinstance(s, list) and len(s) == 3 and isinstance(s[1], str) and isinstance(s[2], list) for s in inputs["lookups"])
    ):
        raise ValueError("the record is malformed")


def serve(args: list[str]) -> int | None:
    """Answer ``lowercache lower`` from a direct record: the exit code, or None to run the normal path.

    Runs before anything imports torch. Any doubt (no record, a changed
    input, an untrusted record, a missing or corrupt entry, a bad record) is
    None: the normal path then lowers, and records afresh.
    """
    global _initial_env
    _initial_env = dict(os.environ)
    request = parse_lower(args)
    if request is None:
        return None
    started = time.perf_counter()
    from .errors import show_warnings_in_one_line

    show_warnings_in_one_line()
    try:
        settings = request.settings()
        if not settings.direct or settings.disable:
            return None
        request.check = settings.check
        min_snr = float(request.min_snr) if request.min_snr is not None else None
        resolve(request.target)
        check_output_dir(request.out_dir)
        from .cache.tiers import open_store

        store = open_store(settings)
    except (LowercacheError, ValueError):
        return None  # the normal path reports it, in its words
    try:
        return _answer(request, settings, store, started, min_snr)
    finally:
        store.close()


def initial_environ() -> dict[str, str] | Any:
    """The environment as this command started (torch sets variables of its own when it is imported)."""
    return _initial_env if _initial_env is not None else os.environ


def lookup(request: Request, settings: Settings, store: Any, environ: dict[str, str] | None = None) -> tuple[dict[str, Any], Entry] | str:
    """The record and flow entry that would answer ``request`` in this process now, or why none would.

    ``environ``: the environment the command started with (default: as :func:`serve` took it).
    """
    record = _load(store, request.key())
    if record is None:
        return "no record"
    try:
        if record.get("status") != "confirmed":
            why = f"the record is {record.get('status')}: {record.get('reason')}"
        else:
            syspath = [Places(request.root).ref(os.path.abspath(p or ".")) for p in sys.path]
            why = _changed(record, request, settings, syspath, environ if environ is not None else initial_environ())
    except (ValueError, KeyError, TypeError) as e:
        why = f"the record is unusable ({e})"
    if why is not None:
        return why
    flow = store.get("flow", record["flow"]["key"])
    if flow is None:
        return "its flow entry is missing or corrupt"
    return record, flow


def _answer(request: Request, settings: Settings, store: Any, started: float, min_snr: float | None = None) -> int | None:
    found = lookup(request, settings, store)
    checked = None
    if not isinstance(found, str) and request.check:
        checked = numerics.stored(store, found[0]["manifest"].get("numerics"), found[0]["flow"]["key"])
        found = found if checked is not None else "its numerics check is not stored"
    if isinstance(found, str):
        if found != "no record":
            _set_status(store, request, "lookup", "not used", found)
        return None
    record, flow = found
    tier = store.last_tier
    seconds = time.perf_counter() - started
    manifest = _manifest(record, flow, tier, seconds)
    manifest.pop("numerics", None)
    if checked is not None:
        manifest["numerics"] = checked[0]
        manifest["step_counts"]["check"] = {"hit": 1}
    manifest["model"] = request.history_name()  # this checkout's path, not the recording one's
    remote = getattr(store, "remote", None)
    if remote is not None:
        manifest["remote"] = remote.stats()
    try:
        written = write_files(flow.blobs, manifest, request.out_dir)
    except LowercacheError as e:
        print(f"lowercache: error: {e}", file=sys.stderr)
        return 2
    _set_status(store, request, "lookup", "hit", f"served from the record (flow entry {record['flow']['key'][:12]}, {tier} tier)")
    _count(store, request, record, flow, seconds, checked is not None)
    short = numerics.below(manifest.get("numerics"), min_snr)
    _report(request, manifest, written, seconds, short)
    if short is not None:
        print(f"lowercache: error: {short}", file=sys.stderr)
        return 1
    return 0


def _manifest(record: dict[str, Any], flow: Entry, tier: str, seconds: float) -> dict[str, Any]:
    step = {"kind": "flow", "name": record["flow"]["name"], "outcome": "hit", "key": record["flow"]["key"],
            "parts": record["manifest"].get("key_parts", {}), "seconds": round(seconds, 4), "saved": round(max(flow.cost - seconds, 0.0), 4),
            "output": flow.digest(), "note": "direct", "tier": tier, "nodes": {}}
    return {
        **record["manifest"],
        "stages": {"direct": round(seconds, 4)},
        "steps": [step],
        "step_counts": {"flow": {"hit": 1}},
        "nodes": {},
        "passes": [],
        "files": {name: {"size": len(data), "xxh3_128": digest(data)} for name, data in sorted(flow.blobs.items())},
        "direct": {"outcome": "hit", "torch_imported": "torch" in sys.modules},
        **({"delegation": flow.meta["delegation"]} if "delegation" in flow.meta else {}),
    }


def _count(store: Any, request: Request, record: dict[str, Any], flow: Entry, seconds: float, checked: bool = False) -> None:
    """Counters and run history, as a flow hit of the normal path would leave them."""
    from .cache import history

    store.add_counts({"flow": {"hit": 1}, "direct": {"hit": 1}, **({"check": {"hit": 1}} if checked else {})}, max(flow.cost - seconds, 0.0))
    step = {"kind": "flow", "name": record["flow"]["name"], "outcome": "hit", "key": record["flow"]["key"],
            "parts": record["manifest"].get("key_parts", {}), "seconds": seconds}
    history.record_run(store, request.history_name(), record["flow"]["name"], [step])


def _report(request: Request, manifest: dict[str, Any], written: list[Path], seconds: float, short: str | None = None) -> None:
    print(f"lowercache: direct mode: served from the record, no factory run ({seconds:.2f}s)", file=sys.stderr)
    said = delegation.line(manifest.get("delegation"))
    if said is not None:
        print(f"lowercache: {said}", file=sys.stderr)
    for line in numerics.lines(manifest.get("numerics")):
        print(f"lowercache: {line}", file=sys.stderr)
    if request.as_json:
        summary = {
            "model": manifest.get("model"),
            "target": manifest.get("target"),
            "out": request.out_dir,
            "flow": "hit",
            "direct": "hit",
            "step_counts": manifest["step_counts"],
            "seconds": round(seconds, 4),
            "saved_seconds": manifest["steps"][0]["saved"],
            "files": {p.name: manifest["files"].get(p.name, {}) for p in written},
            **delegation.json_part(manifest.get("delegation")),
            **numerics.json_part(manifest.get("numerics"), short),
        }
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(f"wrote {counted(len(written), 'file')} to {request.out_dir}")


# -- what a record names (``lowercache watch`` polls it) ----------------------------------------------


def recorded_files(model: str, target: str, per_tensor: bool, calibration: str | None, settings: Settings,
                   system_config: str | None = None, memory_mode: str | None = None) -> list[str]:
    """The files the latest record of this ``lower`` says its factory read, outside site-packages and lowercache.

    That is the model file, the project's modules it imported and the files
    it opened: what a re-lowering would see change. Empty when there is no
    record (direct mode off, caching disabled, nothing recorded yet) or it
    cannot be read.
    """
    from .cache.tiers import open_store

    request = Request(model=model, target=target, out_dir="", per_tensor=per_tensor, calibration=calibration,
                      system_config=system_config, memory_mode=memory_mode, check=settings.check)
    try:
        store = open_store(settings)
    except LowercacheError:
        return []
    if store is None:
        return []
    try:
        record = _load(store, request.key())
    finally:
        store.close()
    if record is None:
        return []
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    try:
        _check_shape(record)
        places = Places(request.root)
        paths = {places.path(ref) for ref, state in record["inputs"]["files"] if ref[0] in ("root", "abs") and state.get("kind") == "file"}
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(p for p in paths if not p.startswith(package))


# -- explain -----------------------------------------------------------------------------------------


def explain(store: Any, model: str, target: str) -> list[str]:
    """What direct mode did with the latest ``lower`` of MODEL on a target, and why."""
    request = Request(model=model, target=target, out_dir="")
    lines = status_lines(store, lambda which: _status_name(request, which), "direct mode, ") or ["direct mode: no record of this model yet"]
    return [*lines, f"direct mode {UNSEEN}"]


# What no record sees, said by ``explain`` (docs/direct-mode.md, Limits).
UNSEEN = ("cannot see: files native code reads outside the project tree, or inside it away from the model with a suffix "
          "the sweep does not know; variables C code reads itself; a directory's mode or mtime")
