"""The audit-hook recorder: what code reads while it runs, for direct mode's ``lower`` records and ``lowercache run``'s.

It hears Python's audit events (files opened, directories listed, module
names looked up, code compiled, processes, network, writes) and watches
``os.environ`` and ``os.stat``, while it is listening and not paused. What
cannot be recorded (a network connection, a subprocess, a write outside
scratch space, a change of directory) is noted as a refusal: such a run is
never served from a record. See docs/direct-mode.md.
"""

from __future__ import annotations

import os
import posix
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

from .. import sweep
from ..cache.digests import digest_json
from ..cache.toolchain import hashed_package_dirs, in_toolchain_part, lowercache_digest, memo_prefixes
from ..config import Settings
from .places import (RACY_NS, STAT_FIELDS, InstalledDigests, Places, bytecode_matches, dir_listing, entries, named, on_system,
                     path_state, read_file, size, stdlib_dirs, work_tree)
from .trust import env_digest

if TYPE_CHECKING:  # the tracer is imported only to record: a hit needs none of it
    from . import backstop

_PYCACHE = os.sep + "__pycache__" + os.sep
# lowercache's own package: the rooms whose code the toolchain identity covers are not a record's inputs.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a stat shows besides kind, content and links, by what the caller observed (``Recorder.looked_at``): which
# result (``meta``: the stat through links, ``lmeta``: the link's own) and which of its fields. ``os.stat``,
# ``os.lstat``, ``os.fstat`` and a listed entry's ``stat()`` hand the caller the whole result (but the access time,
# which reading moves); ``os.access`` and the standard library's one-field helpers show less.
_META = {"mode": ("meta", ("mode", "uid", "gid")), "size": ("meta", ("size",)), "mtime": ("meta", ("mtime_ns",)),
         "ctime": ("meta", ("ctime_ns",)), "ident": ("meta", ("dev", "ino")), "stat": ("meta", STAT_FIELDS),
         "lstat": ("lmeta", STAT_FIELDS)}


# Audit events after which no record can say what the factory read. Network use on a remote tier's
# own call thread is the cache's traffic (its entries are checked like any other), not the code's.
_NETWORK = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
            "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.getnameinfo", "urllib.Request", "http.client.connect",
            "ftplib.connect", "smtplib.connect", "imaplib.open", "poplib.connect", "nntplib.connect", "webbrowser.open")
# Audit events that start a process.
PROCESSES = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn")
_UNRECORDABLE = {
    **dict.fromkeys(_NETWORK, "used the network"),
    **dict.fromkeys(PROCESSES, "ran a process"),
    "os.chdir": "changed the working directory",
    "sqlite3.connect": "opened an SQLite database",
}


def _on_remote_thread() -> bool:
    """Whether this thread is a remote tier's call (a remote exists only once its module is imported)."""
    remote = sys.modules.get("lowercache.cache.remote.guarded")
    return remote is not None and threading.current_thread().name.startswith(remote.THREAD_PREFIX)


# Audit events that change files: a direct hit would not make the change. Paths in __pycache__ (bytecode) are the import system's.
WRITES = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.link", "os.symlink",
          "os.utime", "shutil.rmtree", "shutil.move")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def opens_to_write(args: tuple[Any, ...]) -> bool:
    """Whether an ``open`` audit event's arguments (path, mode, flags) open the file to change it."""
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    mode = args[1] if isinstance(args[1], str) else ""
    return bool(flags & _WRITE_FLAGS) or any(c in mode for c in "wax+")



_active: list["Recorder"] = []
# lowercache's own threads (the progress display at a terminal), by identity: a factory's thread of the same name still counts.
_own_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def own_thread(thread: threading.Thread) -> None:
    """Mark a thread lowercache itself started while a recorder listens: no factory left it running."""
    _own_threads.add(thread)


_hooked = False
# The environment as the process started (kept by ``keep_initial_environ`` before anything else runs): torch
# sets variables of its own at import, and a record must compare what the user's environment held.
_initial_env: dict[str, str] | None = None


def keep_initial_environ() -> None:
    """Take the environment now, as this command's start-up environment (direct mode, before torch is imported)."""
    global _initial_env
    _initial_env = dict(os.environ)


def initial_environ() -> dict[str, str] | Any:
    """The environment as this command started (torch sets variables of its own when it is imported)."""
    return _initial_env if _initial_env is not None else os.environ


_heard: frozenset[str] = frozenset()  # the listening recorder's ``heard``: a global is the cheapest test per event


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _heard and _active and not _active[-1].paused and not _run_ahead_unheard():
        _active[-1].event(event, args)


def _run_ahead_unheard() -> bool:
    """Whether this thread forks ``lowercache run``'s runner, or is that runner (``run/ahead.py``, not imported
    by the client, which need not pay for its import)."""
    unrecorded = getattr(sys.modules.get("lowercache.run.ahead"), "unrecorded", None)  # None while it is imported
    return unrecorded is not None and unrecorded()


# This module and run/replay.py (whose recorder hands events on to this one's): frames of neither raised an event.
_RECORDER_FILES = frozenset({os.path.abspath(__file__), os.path.join(_PACKAGE, "run", "replay.py")})


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
# child's record need not ask every module for its ``__file__`` again.
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
    """Collects what code under ``root`` reads while it listens: a factory and its export (direct mode), a whole process (``run``).

    ``paused`` while lowercache's own stages run: their reads are the toolchain's, covered by its identity.
    """

    def __init__(self, root: str, settings: Settings):
        self.settings = settings
        self.places = Places(root)
        self.covered = tuple(d + os.sep for d in (*stdlib_dirs(), *self.places.anchors.values()) if d != self.places.anchors["root"])
        self.covered += tuple(os.path.join(_PACKAGE, room) + os.sep for room in ("cache", "lowering", "speedups", "targets"))
        self.memos = memo_prefixes()  # found once: each write the window makes is checked against them
        self.site = tuple(os.path.join(base, "") for name, base in self.places.anchors.items() if name != "root")
        self.installed_reads: set[str] = set()  # files read in site-packages: installed code's data (``installed_code``)
        self._installed_before: dict[str, list[Any]] = {}  # the installed code loaded before the backstop started
        self._digests: InstalledDigests | None = None
        self._packages_before: dict[int, tuple[Any, list[str]]] = {}  # the packages' own paths then (``_search_dirs``)
        self.covered += self.memos
        self._paused = True
        self.below: backstop.Backstop | None = None  # the tracer below Python (``watch_below``)
        self.below_why = "was not watched below Python"
        self.below_counts: dict[str, int] = {}  # what the backstop served (``manifest.json``'s ``backstop``)
        self.paths: set[str] = set()
        self.listings: set[str] = set()
        self.lookups: set[str] = set()
        self.env: dict[str, str | None] = {}
        self.env_listed = False
        self.unrecordable: list[str] = []
        self.written: set[str] = set()
        self.remade_dirs: set[str] = set()  # ``os.mkdir`` of a directory there already (``remade``)
        self._looked: set[str] = set()  # paths ``looked_at`` already took: linecache stats each file again and again
        import tempfile

        # Temporary files, and the POSIX semaphores glibc's sem_open makes (multiprocessing's locks: created, then
        # unlinked at once); a project elsewhere in /dev/shm is a project like any other.
        self.scratch = (os.path.realpath(tempfile.gettempdir()) + os.sep, os.path.abspath(tempfile.gettempdir()) + os.sep,
                        "/dev/shm/sem.")
        self.syspath = self.places.search_path()
        self.started_ns = time.time_ns()
        self._threads = set(threading.enumerate())
        self.meta: dict[str, dict[str, set[str]]] = {}  # path -> ``meta``/``lmeta`` -> stat fields a caller observed
        self.scanned: set[str] = set()  # directories the user's code itself called ``os.scandir`` on: entries' stat() is its
        self.located: list[str] = []  # how the code observed where the project is (``observed_location``)
        self.package = _PACKAGE + os.sep
        self.bytecode: dict[str, str] = {}  # source -> the .pyc that ran for it (``ran_bytecode``)
        self.initial_env = dict(initial_environ())
        self.stdlib = tuple(d + os.sep for d in stdlib_dirs())
        # The command's own output files, never swept (``> build.log``); found here, before the backstop attaches, since
        # following a pipe reads /proc and each of those calls would stop for the tracer.
        self.streams = sweep.stream_files()

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if self.below is not None and value != self._paused:
            self.below.off() if value else self.below.on()
        self._paused = value

    def watch_below(self) -> None:
        """Attach the backstop below Python (``backstop.py``) before the recorded code runs; where the platform does
        not allow one, the record will be untrusted, naming why."""
        from . import backstop

        # The installed code loaded by now, found while its stats are cheap: under the backstop each of these thousands
        # of stats stops for the tracer (about 0.2 s a record). It is the code that runs, unless the window reads it again.
        self._digests = InstalledDigests()
        self._installed_before = self._installed_states(self._loaded_files(), self._digests)
        self._packages_before = _package_dirs()
        started = backstop.start()
        if isinstance(started, str):
            self.below_why = f"could not be watched below Python ({started})"
            return
        self.below = started
        if not self._paused:
            started.on()

    def _user(self, path: str) -> bool:
        """Not the toolchain's (the installed-code directories its identity covers) nor bytecode. Device nodes and kernel
        files are known by what they are when recorded (``places.is_system``), not here by where they are."""
        return not path.startswith(self.covered) and "__pycache__" not in path

    def refuse(self, why: str) -> None:
        if why not in self.unrecordable:
            self.unrecordable.append(why)

    # The events ``event`` acts on; the hook passes no other: events such as ``builtins.id`` fire hundreds of thousands
    # of times in a strict re-export, and a set membership test is far cheaper than the checks in ``event``.
    heard: ClassVar[frozenset[str]] = frozenset(
        {"open", "os.listdir", "os.scandir", "import", "compile", "ctypes.dlopen", *_UNRECORDABLE, *WRITES}
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
            elif path.startswith(self.site) and _PYCACHE not in path:
                self.installed_reads.add(path)
            elif path.endswith(".pyc") and _PYCACHE in path and not path.startswith(self.covered):
                self.ran_bytecode(path)
        elif event in ("os.listdir", "os.scandir"):
            self.listed(args, sys._getframe(2), event == "os.scandir")  # frames: event, _audit, the caller of os.listdir
        elif event == "import":
            self.lookups.add(args[0])
        elif event in _UNRECORDABLE:
            if not (event in _NETWORK and _on_remote_thread()):
                self.refuse(_UNRECORDABLE[event])
        elif event in WRITES:
            remade = _abspath(args[0]) if event == "os.mkdir" and args[2] == -1 else None
            if remade is not None and os.path.isdir(remade):
                self.remade_dirs.add(remade)
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
        """``open(fd)``: importlib writes bytecode so (``_write_atomic``: ``os.open``, then ``FileIO(fd)``), a scratch write,
        and lowercache its toolchain memos (``mkstemp``, then ``fdopen``).

        Any other descriptor (a pipe, a socket, a file of the user's) says nothing of what it reads: refused.
        """
        try:
            target = _readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if os.path.isabs(target) and (_PYCACHE in target or target.startswith(self.memos)):
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

    def listed(self, args: tuple[Any, ...], caller: Any, scanned: bool = False) -> None:
        """A directory listing made from frame ``caller`` (``scanned``: by ``os.scandir``)."""
        if caller.f_code.co_filename.startswith("<frozen importlib") or not self.by_user(caller):
            return  # the import system's scans (module lookups are recorded by name), installed libraries' own
        path = _abspath(args[0] if args and args[0] is not None else ".")
        if path is None:
            self.refuse("listed a directory by descriptor")
        elif self._user(path):
            self.listings.add(path)
            if scanned and not caller.f_code.co_filename.startswith(("<frozen", *self.stdlib)):
                self.scanned.add(path)  # the user's own code holds the entries: each one's stat() is there to read

    def remade(self, path: str) -> None:
        """``os.mkdir`` of a directory there already fails (EEXIST) and changes nothing: ``os.makedirs(exist_ok=True)``,
        as torch's ``cache_dir()`` does for ``TORCHINDUCTOR_CACHE_DIR`` in every process once one has lowered."""

    def wrote(self, path: str) -> None:
        """A file the window changed is no input; outside scratch space (temporary files, bytecode) it is a side effect a hit would skip."""
        self.written.add(path)
        scratch = path.startswith((*self.scratch, *self.memos)) or "__pycache__" in path or path == os.devnull
        if not scratch:
            self.refuse(f"wrote {path}")

    def users(self, path: Any) -> bool:
        """Whether ``path`` names one of the user's files (:meth:`looked_at` keeps no other)."""
        found = _abspath(path)
        return found is not None and self._user(found)

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
                which, fields = _META[how]
                self.meta.setdefault(found, {}).setdefault(which, set()).update(fields)

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
        self.env[name] = env_digest(self.initial_env.get(name))

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
        listings = []
        for path in sorted(self.listings):
            state = path_state(path, listing=True)
            if state["kind"] == "system":
                continue  # a kernel file system's directory (``/proc/self/fd``): the machine's, not an input
            listings.append([self.places.ref(path), state])
            if state["kind"] == "dir":
                files.update(self._listed_links(path))
        for name, base in self.places.anchors.items():
            if name != "root" and os.path.isdir(base):
                listings.append([[name, "."], path_state(base, listing=True)])
        for directory in sorted(self.scanned):
            for name in entries(directory) or []:
                entry = os.path.join(directory, name)
                if not self._user(entry):
                    continue
                files.add(entry)
                for how in ("stat", "lstat"):
                    which, fields = _META[how]
                    self.meta.setdefault(entry, {}).setdefault(which, set()).update(fields)
        swept, why = sweep.sweep(root, self.beside(), self.unswept(), self._user, leave_out=self.streams)
        if why is not None:
            self.refuse(why)
        native, native_listings = self.below_python(files | set(swept) | self.listings)
        for path in sorted(native_listings - self.listings):
            state = path_state(path, listing=True)
            if state["kind"] != "system":
                listings.append([self.places.ref(path), state])
                if state["kind"] == "dir":
                    native.update(self._listed_links(path))
        for path in native - files:  # seen only below Python: native code may observe every stat field of a file
            if not os.path.isdir(path):  # a directory by its kind (its listing when listed): its times move with any entry
                self.meta[path] = {"meta": set(STAT_FIELDS), "lmeta": set(STAT_FIELDS)}
        files |= native
        hashed = 0
        states = []
        for path in sorted(files | (set(swept) - self.written)):
            if path in files:
                meta = self.meta.get(path, {})
                state = path_state(path, meta=meta.get("meta", ()), lmeta=meta.get("lmeta", ()))
            else:  # swept: hashed while the total stays small, else proven unchanged by its stat only
                hashed += size(path)
                state = path_state(path, hashed=hashed <= sweep.HASH_BYTES)
            if state["kind"] == "system":
                continue  # a device node or a kernel file (``/dev/null``, ``/proc/cpuinfo``): the machine's, not an input
            if state["kind"] == "other":
                self.refuse(f"read {path}, which is not a regular file")
            elif state["kind"] == "file" and max(state["stat"][1:3]) >= self.started_ns - RACY_NS // 40:
                self.refuse(f"read {path} while it was changing")
            states.append([self.places.ref(path), state])
        env = dict(self.env)
        if self.env_listed:
            env.update({name: env_digest(value) for name, value in self.initial_env.items()})
            env["<listed>"] = digest_json(sorted(self.initial_env))
        return {
            "files": states,
            "listings": listings,
            "lookups": self._lookups(),
            "syspath": self.syspath,
            "installed": self.installed_code(),
            "env": env,
            "location": self.location(root, files),
        }

    def below_python(self, known: set[str]) -> tuple[set[str], set[str]]:
        """What the backstop saw that nothing else covers: the files and the directories listed to add to the record.

        Not inputs: what the record already holds (``known``), installed code
        (the standard library, site-packages, the interpreter's prefix and
        lowercache: covered by the identity), lowercache's own cache, scratch
        written in the window (temporary files, bytecode), the import system's
        listings of the search path, device nodes and kernel file systems (by
        what they are, ``places.is_system``). A write, a process, a change of
        directory or a call no path describes is refused, as the audit hook
        refuses them. Without a backstop (none could attach) the record is
        untrusted, and says why.
        """
        files: set[str] = set()
        listed: set[str] = set()
        if self.below is None:
            self.refuse(self.below_why)
            return files, listed
        report, self.below = self.below.report(), None
        if report is None:
            self.refuse("could not be watched below Python (the tracer stopped)")
            return files, listed
        exempt = _exempt_processes()
        for why in report.get("odd", []):
            self.refuse(why)
        if any(pid not in exempt for pid in report.get("processes", [])):
            self.refuse("ran a process")
        search = _search_dirs(self._packages_before)
        installed = self._installed()
        own_dirs = self.own_dirs()  # once: a call may stat (``realpath``), and every stat here stops for the tracer
        for path, hows in sorted(report.get("seen", {}).items()):
            own = set()
            for how in hows:
                owner, _, what = how.rpartition(":")
                if not owner:
                    own.add(what)
                elif int(owner) not in exempt:
                    self.refuse("ran a process")
            if not own or path.startswith(own_dirs) or path + os.sep in own_dirs:
                continue
            if "mkdir" in own and path in self.remade_dirs:
                own.discard("mkdir")  # heard by the audit hook too, as a directory that was there (``remade``)
                if not own:
                    continue
            if own & {"write", "mkdir"}:
                self.wrote(path)
                if own - {"write", "mkdir"}:
                    self.read_written(path)
                continue
            if "exec" in own:
                self.refuse("ran a process")
            if "cwd" in own:
                self.refuse("changed the working directory")
            if path in self.written:
                self.read_written(path)
                continue
            if path.startswith(self.site) and _PYCACHE not in path and own - {"list", "look", "dir"}:
                self.installed_reads.add(path)  # checked with the installed code (``installed_code``), not as a user's file
            if path in known or _PYCACHE in path or path.startswith(installed) or path + os.sep in installed:
                continue
            if on_system(path):
                continue
            if path in search and own <= {"list", "look", "dir"}:
                continue  # the import system's scan of a search directory: its lookups are recorded by name
            if "list" in own:
                listed.add(path)
            if own - {"list", "dir"} or "list" not in own:
                files.add(path)
        stops = report.get("stops") or [0, 0]
        self.below_counts = {"calls": stops[0], "recorded": stops[1], "paths": len(report.get("seen", {})),
                             "added": len(files | listed)}
        return files, listed

    def installed_code(self) -> list[list[Any]]:
        """Every file in site-packages the process loaded as a module or read in the window, and every standard library
        module it loaded, each with its stat and content digest.

        The site directories' listings, recorded with the inputs, see an install, an upgrade or a removal; these see
        an edit in place, which no listing or version shows. Left out: what the toolchain identity's source digests
        count (torch, executorch, ... but their tests, whose helpers a user's script may import) and lowercache's own
        code (its identity too)."""
        digests = self._digests or InstalledDigests()
        found = {origin: state for origin, state in self._installed_before.items() if origin not in self.installed_reads}
        found |= self._installed_states([*self._loaded_files(), *sorted(self.installed_reads)], digests, known=found)
        digests.save()
        return [found[origin] for origin in sorted(found)]

    @staticmethod
    def _loaded_files() -> list[str | None]:
        return [_module_file(module) for module in list(sys.modules.values())]

    def _installed_states(self, origins: list[str | None], digests: InstalledDigests,
                          known: dict[str, list[Any]] | None = None) -> dict[str, list[Any]]:
        """Each installed file among ``origins`` (not one ``known`` already) with its reference and state."""
        hashed, own = hashed_package_dirs(), os.path.join(_PACKAGE, "")
        found: dict[str, list[Any]] = {}
        for origin in origins:
            if (origin is None or origin in found or (known and origin in known) or origin.startswith(own)
                    or in_toolchain_part(origin, hashed)):
                continue
            ref = self.places.ref(origin)
            if ref[0] == "root" or (ref[0] == "abs" and not origin.startswith(self.stdlib)):
                continue  # the user's code, or outside site-packages and the standard library: a file input when read
            try:
                if not os.path.isdir(origin):
                    found[origin] = [ref, *digests.state(origin)]
            except OSError:
                continue  # a module whose file has gone since it was loaded: nothing there to come back
        return found

    def read_written(self, path: str) -> None:
        """Native code read a file the window wrote: scratch, unless a kind of record keeps it as an output."""

    def own_dirs(self) -> tuple[str, ...]:
        """Where lowercache itself reads and writes while the window runs: its cache and its toolchain memos."""
        return (os.path.join(os.path.abspath(str(self.settings.cache_dir)), ""), *self.memos)

    def _installed(self) -> tuple[str, ...]:
        """Installed code, covered by the identity: the interpreter's prefixes, the standard library, site-packages, lowercache."""
        dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *stdlib_dirs(), _PACKAGE,
                *(base for name, base in self.places.anchors.items() if name != "root")}
        return tuple(os.path.join(os.path.normpath(d), "") for d in dirs)

    def beside(self) -> list[str]:
        """Directories whose every file native code may read (the code's own data); none unless a kind of record says."""
        return []

    def _listed_links(self, directory: str) -> list[str]:
        """The links in a listed directory: what each points at can change while the directory stays as it was."""
        try:
            return [link for link in dir_listing(directory)[1] if self._user(link)]
        except OSError:
            return []

    def unswept(self) -> list[str]:
        """Directories the sweep leaves out: the cache (lowercache writes it)."""
        return [str(self.settings.cache_dir)]

    def location(self, root: str, files: set[str]) -> dict[str, Any]:
        """Where the record was made, and ``why`` its code may depend on that place (a name it uses, see
        ``sweep.LOCATION_NAMES``; a root that is no git work tree). That is said by ``explain``, and an opt-in
        (``portable_records``) vouches only for code without one; whether the record answers in another directory
        is settled when it is confirmed (``trust.verdict``, ``trust.elsewhere``), not by these names."""
        why = "" if work_tree(root) == root else "the working directory is not in a git work tree"
        for path in sorted(files):
            if why or self.located:
                break
            if path.endswith(".py") and not path.startswith(self.package):  # lowercache's own: the toolchain's
                try:
                    found = sweep.LOCATION_NAMES.search(read_file(path))
                except OSError:
                    found = None
                if found is not None:
                    why = f"{os.path.relpath(path, root)} names {found.group().decode()}"
        why = why or (self.located[0] if self.located else "")
        return {"root": root, "roots": [root], "bound": False, "portable": False, "why": why}

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
                    listings[d] = entries(d)
                found.append([self.places.ref(os.path.abspath(d)), last, named(listings[d], last)])
        return found


def _exempt_processes() -> set[int]:
    """Processes lowercache itself started while recording: ``lowercache run``'s runner (``run/ahead.py``)."""
    runner = getattr(sys.modules.get("lowercache.run.ahead"), "runner_pid", None)
    found = runner() if callable(runner) else None
    return {found} if isinstance(found, int) else set()


def _search_dirs(before: dict[int, tuple[Any, list[str]]] | None = None) -> set[str]:
    """The directories the import system lists: the module search path and every imported package's own path.

    ``before``: :func:`_package_dirs` found before the backstop started, where the modules loaded then are looked up
    cheaply (a module's ``__getattr__`` may search for ``__path__``, and each stat of that stops for the tracer).
    """
    dirs = {os.path.abspath(p or ".") for p in sys.path if isinstance(p, str)}
    for found in _package_dirs(before).values():
        dirs.update(found[1])
    return dirs


def _package_dirs(before: dict[int, tuple[Any, list[str]]] | None = None) -> dict[int, tuple[Any, list[str]]]:
    """Each imported package's own path, by the module's identity (kept with the module, so that the identity stays its)."""
    found = {}
    for module in list(sys.modules.values()):
        known = (before or {}).get(id(module))
        if known is not None and known[0] is module:
            found[id(module)] = known
            continue
        path = getattr(module, "__path__", None)
        if isinstance(path, (list, tuple)) or type(path).__name__ == "_NamespacePath":  # torch's ops namespaces fake one
            found[id(module)] = (module, [os.path.abspath(d) for d in path if isinstance(d, str)])
        else:
            found[id(module)] = (module, [])
    return found


# Where a listing of the environment reads every value: ItemsView/ValuesView.__iter__, _Environ.copy.
_LISTING_FRAMES = {("<frozen _collections_abc>", "__iter__"), ("<frozen os>", "copy")}


def refuse_listening(why: str) -> None:
    """The record this process is making, if any, cannot be trusted (``why``)."""
    if _active:
        _active[-1].refuse(why)


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
    from .tracer import HEARD_DIRFD

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

    def wrap(fn: Callable[..., Any], how: str, heard: bool) -> Callable[..., Any]:
        def watched(path: Any, *args: Any, **kwargs: Any) -> Any:
            if (recorder := _current()) is not None and recorder.users(named := _named(path, kwargs.get("dir_fd"))):
                seen = "lstat" if how == "stat" and not kwargs.get("follow_symlinks", True) else how
                recorder.looked_at(named, _observed(sys._getframe(1), seen))  # its frames walked only for a user's path
            if heard and "dir_fd" not in kwargs and _is_absolute(path):
                kwargs["dir_fd"] = HEARD_DIRFD  # heard here: the backstop need not stop for it (``tracer.HEARD_DIRFD``)
            return fn(path, *args, **kwargs)

        return watched

    # ``os.readlink`` shows a link's text, as ``os.path.realpath`` does through ``os.lstat``: the path's state keeps it.
    # All but ``os.fstat`` (a descriptor, no path) take ``dir_fd`` where ``os.stat`` does.
    at = posix.stat in os.supports_dir_fd
    for name, how in (("stat", "stat"), ("lstat", "lstat"), ("fstat", "stat"), ("access", "mode"), ("readlink", "kind")):
        setattr(os, name, wrap(getattr(os, name), how, at and name != "fstat"))
    _untrace_import_system()

    def located(fn: Callable[[], Any]) -> Callable[[], Any]:
        def watched() -> Any:
            if (recorder := _current()) is not None:
                recorder.observed_location("it called os.getcwd()", sys._getframe(1))
            return fn()

        return watched

    os.getcwd, os.getcwdb = located(os.getcwd), located(os.getcwdb)
    _watch_posix_environ()


def _is_absolute(path: Any) -> bool:
    return isinstance(path, (str, bytes)) and os.path.isabs(path)


def _untrace_import_system() -> None:
    """The import system's stats and reads of absolute paths go untraced by the backstop (``tracer.HEARD_DIRFD``): its
    lookups are recorded by name, and each file it reads raises an ``open`` audit event the recorder hears, so the
    tracer's stop for each would add nothing. Native code's own loads (``dlopen``) stay traced."""
    from importlib import _bootstrap_external as external  # type: ignore[attr-defined]

    from .tracer import HEARD_DIRFD, read_heard

    if posix.stat not in os.supports_dir_fd or posix.open not in os.supports_dir_fd:
        return
    stat, get_data = external._path_stat, external.FileLoader.get_data

    def _path_stat(path: Any) -> Any:
        return posix.stat(path, dir_fd=HEARD_DIRFD) if _is_absolute(path) else stat(path)

    def _get_data(self: Any, path: Any) -> bytes:
        """``FileLoader.get_data``: the file's bytes, opened by ``os.open`` (whose audit event names the path, where
        ``io.open_code``'s did)."""
        return read_heard(os.fsdecode(path)) if _is_absolute(path) else get_data(self, path)

    external._path_stat = _path_stat
    external.FileLoader.get_data = _get_data


def _named(path: Any, dir_fd: Any = None) -> Any:
    """The path a stat-family call names: a descriptor's file (``os.fstat``, ``os.stat(fd)``), a path relative to ``dir_fd``."""
    if isinstance(path, int):
        return _fd_path(path)
    if dir_fd is None:
        return path
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return None
    base = _fd_path(dir_fd) if isinstance(dir_fd, int) and not os.path.isabs(text) else None
    return text if os.path.isabs(text) else os.path.join(base, text) if base is not None else None


def _fd_path(fd: int) -> str | None:
    """The file a descriptor is open on, None when it is no file's (a pipe, a socket) or the system cannot say."""
    try:
        target = _readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if os.path.isabs(target) else None


_readlink = os.readlink  # before it is watched: lowercache's own look at a descriptor is no read of the code's

# Callers of ``os.stat`` in the standard library by what they observe: only what a path is (missing, file, directory,
# link; the link's text is kept for every path), or one field. linecache's checks and importlib.metadata's
# ``FastPath.mtime`` only decide whether to read a source or a search-path directory again (what they read is recorded).
_KIND_ONLY = frozenset({"exists", "lexists", "isfile", "isdir", "islink", "is_file", "is_dir", "is_symlink", "realpath",
                        "resolve", "getatime", "checkcache", "updatecache", "mtime"})
_ONE_FIELD = {"getsize": "size", "getmtime": "mtime", "getctime": "ctime", "samefile": "ident", "sameopenfile": "ident"}


def _observed(frame: Any, how: str) -> str:
    """``kind`` (or the one field it reads) when the standard-library function calling ``os.stat`` (or its caller) only
    tests what a path is, else ``how``."""
    while frame is not None and frame.f_code.co_filename.startswith(("<frozen", *_stdlib_prefixes())):
        name = frame.f_code.co_name
        if name in _KIND_ONLY:
            return "kind"
        if name in _ONE_FIELD and how in ("stat", "lstat"):
            return _ONE_FIELD[name]
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
