"""Run ``python script.py`` or ``python -m module`` in a child of the warm server, as a new interpreter would.

``lowercache run -- python export.py`` sends the command to the warm server
(``lowercache/server/``), whose children have torch, ExecuTorch's Arm backend and
torchao imported already, so the script does not pay for the imports. This
module is what lets such a child stand in for the process ``python`` would
have started:

- which command lines qualify (:func:`parse`): a script or ``-m module``,
  with at most ``-u`` and ``-B``; anything else runs as a new process;
- when the warm process cannot stand in (:func:`why_not`, by the rule of
  ``startup.py`` that ``lower``'s requests share): a variable that the
  interpreter's start, torch's native code or the server's imports read
  differs from the server's, or a file in the script's directory (or on
  ``PYTHONPATH``) would shadow a module the server imported or looked for;
- the interpreter's own start and exit (:func:`run`): ``__main__``,
  ``sys.argv``, ``sys.path[0]``, fresh standard streams, torch's default
  random generators seeded afresh, the exit code of ``SystemExit``
  or an uncaught exception (through ``sys.excepthook``, without this
  module's frames), non-daemon threads joined, exit handlers, and files left
  open in the user's modules flushed. The server's own ``weakref.finalize``
  callbacks do not run at the child's exit: they are the server's (such as
  torch.library registrations undone in memory, which cost every command).

Imports nothing heavy: the client uses :func:`parse` before any server exists.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib
import importlib.machinery
import io
import os
import random
import runpy
import signal
import sys
import threading
import types
import warnings
import weakref
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

from .. import environment, startup
from ..record.recorder import PROCESSES, WRITES, opens_to_write

@dataclass(frozen=True)
class Invocation:
    """A ``python`` command line this module can stand in for."""

    script: str | None
    module: str | None
    args: list[str]
    unbuffered: bool = False
    no_bytecode: bool = False

    def main_dir(self, cwd: str) -> str:
        """``sys.path[0]``: the script's directory (links resolved), or the working directory for ``-m``."""
        if self.module is not None:
            return cwd
        return os.path.dirname(os.path.realpath(os.path.join(cwd, self.script or "")))


def parse(argv: list[str]) -> Invocation | None:
    """``argv`` (the interpreter first) as an :class:`Invocation`, or None when it is anything else (``-c``, ``-X``, ``-W``, stdin...)."""
    flags: set[str] = set()
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[i + 1:] if arg != "-m" else argv[i + 2:]
            return Invocation(None, module, rest, "u" in flags, "B" in flags) if module else None
        if arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= {"u", "B"}:
            flags.update(arg[1:])
            continue
        if arg.startswith("-"):
            return None
        return Invocation(arg, None, argv[i + 1:], "u" in flags, "B" in flags)
    return None


def why_not(invocation: Invocation, cwd: str, env: dict[str, str], start_env: dict[str, str],
            imported: dict[str, list[str]]) -> str | None:
    """Why a child of the server cannot stand in for a new ``python`` process here, or None when it can.

    The start-up rule is ``startup.why_not``'s, shared with ``lower``'s
    requests; the search path is the script's directory (or the working
    directory for ``-m``) and ``PYTHONPATH``, as a new interpreter's starts.
    """
    if invocation.script is not None:
        path = os.path.join(cwd, invocation.script)
        if not os.path.isfile(path):
            return f"{invocation.script} is not a file"
        if zipfile.is_zipfile(path):
            return f"{invocation.script} is a zip archive"
    pythonpath = startup.without_dir(env.get("PYTHONPATH"), startup.HOOK_DIR)
    search = [invocation.main_dir(cwd), *(pythonpath.split(os.pathsep) if pythonpath else [])]
    return startup.why_not(env, start_env, search, cwd, imported)


STACK = ("torch", "executorch", "torchao")  # what the warm server imported for the command; each imports torch
# What a command does that a new process would do again if the child backed out: a change on disk, a process, the network.
_ACTS = frozenset({*WRITES, *PROCESSES, "os.kill", "socket.connect", "socket.sendto", "socket.sendmsg"})
_PACKAGE = __name__.split(".")[0] + "."


class ImportWatch:
    """What the command changes, before its own import of a module the server had imported, that the import reads.

    The warm child imported torch (and what it brings) before the fork; a new
    process imports each such module when the command first does, under the
    state of that moment:

    - a variable: ``os.environ["OMP_NUM_THREADS"] = "1"`` at the top of a
      script, then ``import torch``, gives one thread in a new process, since
      native code reads it as torch loads. Which variables an import reads
      cannot be listed (C code calls ``getenv``), so any change of an input
      variable (``environment.inputs``) before the command first imports
      torch, ExecuTorch or torchao (each imports torch) counts;
    - the search path: ``sys.path.insert(0, "vendor")`` and then ``import
      tabulate`` imports ``vendor/tabulate.py`` in a new process, where the
      child would hand over the server's. So at the command's first import of
      each module the server imported, a search path changed since the start
      is asked where that name is found now;
    - the warnings filters: ``warnings.simplefilter("error")`` and then
      ``import executorch...`` raises in a new process, whose imports warn
      (a ``DeprecationWarning`` of ExecuTorch 1.5.1's); the child's imports
      ran before. So a filter that turns warnings into errors, added before
      the command first imports the stack, counts.

    Either means the child cannot stand in: ``back_out`` is called with why
    (``sets X before...``) when nothing of the command has been seen yet (no
    output written, nothing changed on disk, no process, no network), and the
    command runs as a new process; otherwise ``too_late`` is (the run goes on,
    and is not recorded). Installed just before the command's code runs;
    imports and variables lowercache's own code makes are not the command's.
    """

    def __init__(self, back_out: Callable[[str], None], too_late: Callable[[str], None]):
        self.back_out, self.too_late = back_out, too_late
        self.env_watched = True  # until the command's first import of the stack
        self.acted = False
        self.decided = False
        self.unseen = {name for name in sys.modules if "." not in name}  # the server's, not yet imported by the command
        self.path = list(sys.path)  # as the command starts: ImportWatch is made just before its code runs
        self.filters = list(warnings.filters)
        self._import, self._import_module = builtins.__import__, importlib.import_module

    def install(self) -> None:
        sys.addaudithook(self._audit)
        builtins.__import__ = self._watched_import
        importlib.import_module = self._watched_import_module

    def _watched_import(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and (top := name.partition(".")[0]) in self.unseen:  # one set lookup per import statement otherwise
            self._importing(top)
        return self._import(name, globals, locals, fromlist, level)

    def _watched_import_module(self, name: str, package: str | None = None) -> Any:
        if not name.startswith(".") and (top := name.partition(".")[0]) in self.unseen:
            self._importing(top)
        return self._import_module(name, package)

    def _importing(self, top: str) -> None:
        if self.decided or _ours(sys._getframe(2)):
            return
        self.unseen.discard(top)
        if top in STACK and self.env_watched:
            self.env_watched = False
            if any(f[0] == "error" and f not in self.filters for f in warnings.filters):
                self._cannot("turns warnings into errors before it imports torch, whose imports warn in a new process")
                return
        if sys.path != self.path:
            where = _found_elsewhere(top)
            if where is not None:
                self._cannot(f"puts {where} on sys.path before it imports {top}, which the server imported from its own")

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.decided:
            return
        if event in ("os.putenv", "os.unsetenv"):
            name = os.fsdecode(args[0])
            if self.env_watched and environment.inputs({name: ""}) and not _ours(sys._getframe(1)):
                self._cannot(f"sets {name} before it imports torch, which the server imported under its own value")
        elif event in _ACTS or (event == "open" and opens_to_write(args)):
            self.acted = True

    def _cannot(self, why: str) -> None:
        self.decided = True
        builtins.__import__, importlib.import_module = self._import, self._import_module
        (self.too_late if self.acted or _output_written() else self.back_out)(why)


def _found_elsewhere(top: str) -> str | None:
    """The directory on today's ``sys.path`` where ``top`` is found, when it is not where the loaded module came from."""
    module = sys.modules.get(top)
    origin = getattr(module, "__file__", None)
    if not isinstance(origin, str):
        return None  # built in, frozen or a namespace package: nothing on the path replaces it
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, sys.path)
    except (ImportError, ValueError):
        return None
    found = getattr(spec, "origin", None)
    if not isinstance(found, str) or os.path.realpath(found) == os.path.realpath(origin):
        return None
    return os.path.dirname(os.path.dirname(found) if os.path.basename(found) == "__init__.py" else found)


def _ours(frame: Any) -> bool:
    """Whether the first frame outside ``os`` (whose ``environ`` calls ``putenv``) is lowercache's own code."""
    while frame is not None and frame.f_globals.get("__name__") in ("os", __name__):
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith(_PACKAGE)


def _output_written() -> bool:
    """Whether the command's output reached its standard streams (:func:`streams`' files): a child that backed out then
    would show it twice."""
    for stream in (sys.__stdout__, sys.__stderr__):
        buffer = getattr(stream, "buffer", None)
        if getattr(getattr(buffer, "raw", buffer), "written", True):
            return True
    return False


class _Counted(io.FileIO):
    """A standard stream's file, which says whether anything reached it."""

    written = False

    def write(self, b: Any) -> int | None:
        self.written = True
        return super().write(b)


def streams(unbuffered: bool) -> None:
    """New standard streams on descriptors 0-2, as the interpreter makes them (pipes: block buffered; stderr: line buffered).

    Made before anything wraps them (``lowercache run``'s recorder watches ``sys.stdin``)."""
    def text(fd: int, mode: str, template: Any, buffered: bool, line: bool) -> io.TextIOWrapper:
        raw = _Counted(fd, mode, closefd=False) if mode == "wb" else io.FileIO(fd, mode, closefd=False)
        stream: Any = raw
        if buffered:
            stream = io.BufferedReader(raw) if mode == "rb" else io.BufferedWriter(raw)
        return io.TextIOWrapper(stream, encoding=template.encoding, errors=template.errors,
                                line_buffering=line, write_through=not buffered)

    tty = [os.isatty(fd) for fd in (0, 1, 2)]
    sys.stdin = sys.__stdin__ = text(0, "rb", sys.__stdin__ or sys.stdin, True, tty[0])
    sys.stdout = sys.__stdout__ = text(1, "wb", sys.__stdout__ or sys.stdout, not unbuffered, tty[1])
    sys.stderr = sys.__stderr__ = text(2, "wb", sys.__stderr__ or sys.stderr, not unbuffered, True)


def reseed() -> None:
    """Random generators seeded from the OS, as a new process seeds them (torch's, Python's, NumPy's); forked, they are the server's."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _exit_code(e: SystemExit) -> int:
    """``SystemExit``'s code as the interpreter turns it into an exit status (a message is printed, status 1)."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - as the interpreter, print what can be printed
        pass
    return 1


def _uncaught(e: BaseException) -> None:
    """Print an uncaught exception through ``sys.excepthook``, without this module's frames in the traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    e.__traceback__ = tb  # the default hook prints the exception's own traceback
    try:
        sys.excepthook(type(e), e, tb)
    except Exception:  # noqa: BLE001
        pass


def _run_script(path: str, main: types.ModuleType) -> None:
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main.__dict__.update(__file__=path, __cached__=None, __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    exec(code, main.__dict__)


def _user_module(module: Any, installed: tuple[str, ...]) -> bool:
    origin = getattr(module, "__file__", None)
    return isinstance(origin, str) and not os.path.abspath(origin).startswith(installed)


def _servers_finalizers_off() -> None:
    """Keep the exit from running the finalizers registered before the command: the server's, not the command's."""
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]  (CPython's list of live finalizers)
        finalizer.atexit = False


def run(invocation: Invocation, argv: list[str], executable: str, base_path: list[str], installed: tuple[str, ...],
        dump: Callable[[], None] | None, started: Callable[[], None] = lambda: None) -> int:
    """Be ``python`` running ``invocation`` in this (forked) process; the exit status, or death by SIGINT as ``python`` dies.

    Call with the client's working directory, environment and descriptors
    0-2 in place, and :func:`streams` made on them. ``base_path``: ``sys.path`` after the interpreter's start,
    without ``sys.path[0]``. ``installed``: directories whose modules are not
    the user's (their files are not flushed by hand at exit). ``dump``:
    called last, after every exit handler (``lowercache run``'s recorder).
    ``started``: called just before the command's own code runs.
    """
    sys.executable = executable
    sys.orig_argv = list(argv)
    sys.dont_write_bytecode = invocation.no_bytecode or sys.dont_write_bytecode
    cwd = os.getcwd()
    sys.path[:] = [invocation.main_dir(cwd), *base_path]
    importlib.invalidate_caches()
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __package__=None, __spec__=None)
    sys.modules["__main__"] = main
    reseed()
    before = set(sys.modules)
    _servers_finalizers_off()
    code, interrupted = 0, False
    started()
    try:
        if invocation.module is not None:
            sys.argv = ["-m", *invocation.args]
            runpy._run_module_as_main(invocation.module, alter_argv=True)  # what ``python -m`` itself calls
        else:
            sys.argv = [invocation.script or "", *invocation.args]
            _run_script(os.path.abspath(invocation.script or ""), main)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - the interpreter's own top level
        _uncaught(e)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    threading._shutdown()  # type: ignore[attr-defined]  (the interpreter joins non-daemon threads at exit so)
    atexit._run_exitfuncs()
    for name in [n for n in sys.modules if n not in before] + ["__main__"]:
        module = sys.modules.get(name)
        if module is not None and (name == "__main__" or _user_module(module, installed)):
            module.__dict__.clear()  # files a module left open are flushed as the interpreter's exit would
    gc.collect()
    if dump is not None:
        dump()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code
