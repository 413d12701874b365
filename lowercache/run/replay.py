"""Command-level replay for ``lowercache run``, as ccache replays a compile.

The first run of ``lowercache run -- CMD`` runs CMD with a recorder in its
Python process (``record/recorder.py``'s, for the whole process): the script, the
user's modules it imports, the files it reads, looks at and lists, the
module names it looks up and the environment variables it reads. The files
it writes (under the working directory or an ``--out`` directory) and its
stdout and stderr are stored as content-addressed blobs. A later run of the
same command line, in the same directory, whose recorded inputs, interpreter,
toolchain and settings all hash the same, writes those files (atomically,
with their recorded mode) and prints that output without running CMD.

A record is only used once a re-run with identical inputs wrote identical
files (a script that reads the time or an unseeded generator does not); it
is never made when the command could not be fully seen: a non-zero exit, a
network call, a subprocess, a read of standard input, a file it wrote that
it also read, a write outside the working directory, a changed directory.
Any doubt at lookup is a normal run. See docs/run.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..cache.digests import digest, digest_json
from ..cache.store import Entry
from ..client import exec_through_server
from ..config import Settings, load_settings
from ..errors import LowercacheError
from ..record.places import Places, hop_dirs, path_state, project_root, read_file
from ..record.recorder import Recorder, listen, opens_to_write
from ..record.trust import (UNSEEN, Words, check_inputs, elsewhere, from_earlier, identity, identity_changed, inputs_changed, judged_once,
                            kept_earlier, put_status, status_lines, verdict)
from ..targets.arm_ethosu import VELA_SCRATCH_PREFIX
from . import ahead, pyexec

KIND = "run"
# On the wrapped command's PYTHONPATH: its sitecustomize starts the recorder and the Arm hooks (hook.py).
RECORD_VERSION = 2
# Handed to the wrapped process only (it removes them before the script runs).
ENV_RECORD = "LOWERCACHE_RUN_RECORD"
ENV_OUT = "LOWERCACHE_RUN_OUT"
# Output kept per stream; a command printing more is run every time.
MAX_STREAM = 64 * 2**20
# How command records say the one confirm rule (``record/trust.py``).
WORDS = Words(
    who="the command",
    same="writes the same files",
    gave_same="wrote the same files",
    elsewhere="wrote different files in another directory",
    differed="identical inputs wrote different files: the command reads something no record can see, "
             "such as the time or an unseeded random generator",
)
_STDIN_READS = frozenset({"read", "readline", "readlines", "buffer", "readinto", "detach", "__next__"})


@dataclass
class Command:
    """A wrapped command line as given: what names its record."""

    argv: list[str]
    outs: list[str] = field(default_factory=list)
    cwd: str = field(default_factory=os.getcwd)

    @property
    def root(self) -> str:
        return project_root(self.cwd)

    def key(self) -> str:
        """The command line, the working directory relative to the project root and the ``--out`` directories."""
        return digest_json({"version": RECORD_VERSION, "argv": self.argv, "cwd": os.path.relpath(self.cwd, self.root),
                            "outs": [os.path.relpath(os.path.abspath(o), self.cwd) for o in self.outs]})

    def earlier_key(self, result: str) -> str:
        """Where an earlier confirmed record of this command is kept, by the digest of what it replays."""
        return digest_json({"earlier": self.key(), "result": result})

    def allowed(self) -> list[str]:
        return [os.path.abspath(self.cwd), *(os.path.abspath(o) for o in self.outs)]


# -- inside the wrapped process ------------------------------------------------------------------------


class CommandRecorder(Recorder):
    """The recorder of a whole process: writes under the allowed directories are its outputs."""

    def __init__(self, root: str, settings: Settings, allowed: list[str]):
        super().__init__(root, settings)
        cache = os.path.abspath(str(settings.cache_dir)) + os.sep
        self.cache = cache
        self.covered += (cache,)  # lowercache's own store: reads are the cache's, writes its entries
        self.allowed = tuple(os.path.join(d, "") for d in allowed)
        # lowercache's own scratch in the temporary directory, which can be inside the project: run ahead's runner's and a
        # Vela compile's (found once: a realpath stats, and under the backstop every stat stops for the tracer)
        where = tempfile.gettempdir()
        self.own_scratch = tuple(os.path.join(d, prefix) for d in dict.fromkeys((where, os.path.realpath(where)))
                                 for prefix in (ahead.SCRATCH_PREFIX, VELA_SCRATCH_PREFIX))
        self.outputs: set[str] = set()
        self.opened: set[str] = set()
        self.temporary: set[str] = set()
        self.paused = False

    heard = Recorder.heard | {"builtins.input"}

    def event(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "sqlite3.connect" and isinstance(args[0], (str, bytes, os.PathLike)):
            if (os.path.abspath(os.fsdecode(args[0])) + os.sep).startswith(self.cache):
                return  # the store's index
        elif event == "builtins.input":
            self.refuse("read standard input")
            return
        if not event.startswith(("os.", "open")):
            super().event(event, args)  # and no frame asked for: sys._getframe raises an audit event itself
            return
        try:
            caller = sys._getframe(2)  # frames: this, _audit, the function that raised the event
        except ValueError:  # raised with no Python caller (at start-up)
            caller = None
        if caller is not None and caller.f_code.co_name == "_rmtree_safe_fd" and caller.f_code.co_filename == shutil.__file__:
            return  # shutil.rmtree's walk, by names relative to directory descriptors: its own event names the tree
        if event in ("os.listdir", "os.scandir"):
            if caller is not None:
                self.listed(args, caller, event == "os.scandir")
            else:
                self.refuse("listed a directory outside any Python frame")
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and not opens_to_write(args):
            self.opened.add(os.path.abspath(os.fsdecode(args[0])))
        super().event(event, args)

    def beside(self) -> list[str]:
        """The script's directory (and its link's target's): data files beside it are what native code most likely reads."""
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        return hop_dirs(os.path.abspath(script)) if isinstance(script, str) else []

    def unswept(self) -> list[str]:
        return [self.cache]

    def own_dirs(self) -> tuple[str, ...]:
        """The store, the toolchain memos, and lowercache's scratch (:attr:`own_scratch`), which the backstop below Python
        sees made and removed, even with the temporary directory inside the project."""
        return (self.cache, *self.memos, *self.own_scratch)

    def read_written(self, path: str) -> None:
        if path in self.outputs and os.path.isfile(path):
            self.refuse(f"read {path}, which it also wrote")

    def remade(self, path: str) -> None:
        if (path + os.sep).startswith(self.allowed):
            self.wrote(path)  # an output directory either way, so that a record does not depend on whether it was there

    def wrote(self, path: str) -> None:
        self.written.add(path)
        if ("__pycache__" in path or path == os.devnull or (path + os.sep).startswith(self.cache)
                or path.startswith((*self.memos, *self.own_scratch))):
            return
        if (path + os.sep).startswith(self.allowed):
            self.outputs.add(path)
        elif path.startswith(self.scratch):
            self.temporary.add(path)  # scratch, if it is gone by the exit
        else:
            self.refuse(f"wrote {path}, outside the working directory and --out")

    def observation(self) -> dict[str, Any]:
        """What the process read and wrote, for the ``lowercache run`` that started it."""
        self.paused = True
        for path in sorted(self.outputs & (self.opened | self.paths)):
            if os.path.isfile(path):
                self.refuse(f"read {path}, which it also wrote")
        for path in sorted(self.temporary):
            if os.path.lexists(path) and not os.path.isdir(path):  # a directory left (torch's caches) holds nothing replayed
                self.refuse(f"wrote {path}, outside the working directory and --out, and left it there")
        inputs = self.inputs()
        return {
            "python": python_identity(),
            "inputs": inputs,
            "outputs": sorted(self.outputs),
            "refused": list(self.unrecordable),
            "recorded_ns": time.time_ns(),
        }


class _WatchedStdin:
    """``sys.stdin`` that tells the recorder when the script reads it: no record can hold what it read."""

    def __init__(self, stream: Any, recorder: CommandRecorder):
        self._stream, self._recorder = stream, recorder

    def __getattr__(self, name: str) -> Any:
        if name in _STDIN_READS:
            self._recorder.refuse("read standard input")
        return getattr(self._stream, name)

    def __iter__(self) -> Any:
        self._recorder.refuse("read standard input")
        return iter(self._stream)


def python_identity() -> dict[str, str]:
    """The interpreter as a file, not as named: ``python`` and ``python3`` in one venv are one interpreter (``_our_python``)."""
    return {"executable": os.path.realpath(sys.executable), "prefix": sys.prefix, "version": sys.version}


def record_in_process(at_exit: bool = True, warm: dict[str, Any] | None = None) -> Callable[[], None] | None:
    """Record this process for the ``lowercache run`` that started it (``lowercache/run/_site/sitecustomize.py`` calls this).

    Returns the function that hands the observation over, registered as the
    first exit handler unless ``at_exit`` is false (a child of the warm
    server calls it itself, after every other). ``warm``: in such a child,
    the variables and module names the server's imports read and looked up,
    which a new process would have read itself.
    """
    where = os.environ.pop(ENV_RECORD, None)
    outs = os.environ.pop(ENV_OUT, "")
    if not where:
        return None
    cwd = os.getcwd()
    recorder = CommandRecorder(project_root(cwd), load_settings(), [cwd, *(o for o in outs.split(os.pathsep) if o)])
    if warm is not None:
        recorder.lookups.update(warm["lookups"])
        for name in warm["env"]:
            recorder.read_env(name)
    # The variables sys.path is built from (PYTHONPATH, PYTHONHOME, HOME for the user site, ...) are in the record's
    # identity (startup.state); whether the user's site-packages exists decides whether it is on sys.path at all.
    import site

    if site.ENABLE_USER_SITE:
        recorder.looked_at(site.getusersitepackages())
    # A lowering's keys stat thousands of installed files (the toolchain parts): found now, before the backstop traces
    # each of those stats; a script that changes its search path before it lowers has them found again there.
    from ..cache.toolchain import toolchain_parts

    try:
        toolchain_parts()
    except Exception:  # noqa: BLE001 - found again when a lowering asks, and said there
        pass
    recorder.watch_below()
    listen(recorder)
    if sys.stdin is not None:
        sys.stdin = _WatchedStdin(sys.stdin, recorder)

    def dump() -> None:
        """Hand the observation over; on any fault none is (the run is then not recorded, and says nothing)."""
        try:
            observation = recorder.observation()
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(where))
            with os.fdopen(fd, "w") as f:
                json.dump(observation, f)
            os.replace(tmp, where)
        except Exception:  # noqa: BLE001 - a lowercache fault never changes the command's output
            pass

    if at_exit:
        atexit.register(dump)  # registered first, so it runs after every other exit handler
    return dump


# -- in ``lowercache run`` -------------------------------------------------------------------------------


def _status_name(command: Command, which: str) -> str:
    return f"run/{which}/{command.key()}"


def _set_status(store: Any, command: Command, which: str, outcome: str, reason: str) -> None:
    put_status(store, _status_name(command, which), outcome, reason)


def explain(store: Any, command: Command) -> list[str]:
    """What the latest ``lowercache run`` of this command did with its record, and why."""
    lines = status_lines(store, lambda which: _status_name(command, which)) or ["no record of this command yet"]
    return [*lines, f"replay {UNSEEN}"]


def _load(store: Any, key: str) -> Entry | None:
    entry = store.get(KIND, key)
    if entry is None or not isinstance(entry.meta, dict) or entry.meta.get("version") != RECORD_VERSION:
        return None
    return entry


def _check(record: dict[str, Any]) -> None:
    """A record read from a store is checked field by field before any of it is used."""
    check_inputs(record.get("inputs"))
    outputs = record.get("outputs")
    if not (
        isinstance(record.get("recorded_ns"), int)
        and isinstance(record.get("cost"), (int, float))
        and isinstance(outputs, list)
        and all(
            isinstance(o, dict) and isinstance(o.get("ref"), list) and o.get("kind") in ("file", "dir", "missing")
            and (o["kind"] != "file" or (isinstance(o.get("blob"), str) and isinstance(o.get("mode"), int)
                                         and re.fullmatch(r"[0-9a-f]{32}", o.get("digest", "")) is not None))
            for o in outputs
        )
    ):
        raise ValueError("the record is malformed")


def _why_not(entry: Entry, command: Command, settings: Settings, env: dict[str, str]) -> str | None:
    """Why the record cannot answer this run, or None when it can."""
    record = entry.meta
    if record.get("status") != "confirmed":
        return f"the record is {record.get('status')}: {record.get('reason')}"
    _check(record)
    if record.get("python") != python_identity() or not _runs_our_python(command.argv, env, command.cwd):
        return "the command's interpreter changed"
    why = identity_changed(record.get("identity"), identity(settings, env))
    if why is not None:
        return why
    places = Places(command.root)
    why = elsewhere(record["inputs"]["location"], command.root, settings.portable_records, WORDS) or inputs_changed(
        record["inputs"], places, record["recorded_ns"], command.cwd, env)
    if why is not None:
        return why
    for out in record["outputs"]:
        path = places.path(out["ref"])
        if not (path + os.sep).startswith(tuple(os.path.join(d, "") for d in command.allowed())):
            return "the record names a file outside the working directory"
        if out["kind"] == "file" and (out["blob"] not in entry.blobs or digest(entry.blobs[out["blob"]]) != out["digest"]):
            return "a stored output is missing or damaged"
        parent = os.path.dirname(path)
        if not os.path.isdir(parent) and not any(o["kind"] == "dir" and places.path(o["ref"]) == parent for o in record["outputs"]):
            return f"directory {parent} is gone"
    return None


def _runs_our_python(argv: list[str], env: dict[str, str], cwd: str) -> bool:
    return _our_python(argv, env, cwd) is not None


def _our_python(argv: list[str], env: dict[str, str], cwd: str) -> str | None:
    """The interpreter the command starts, when it is lowercache's own (its file, in its directory: the same venv); else None.

    Only then does the record's interpreter identity describe the process a
    re-run would start; another venv's ``python`` is run every time. A pyenv
    shim (a shell script choosing the interpreter by ``.python-version`` and
    ``PYENV_VERSION``) is asked which interpreter it would start, here and now.
    """
    found = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    if found is None:
        return None
    shim = _pyenv_shim(found)
    if shim is not None:
        found = _pyenv_which(shim, os.path.basename(found), env, cwd)
        if found is None:
            return None
    ours = os.path.abspath(sys.executable)
    if os.path.dirname(os.path.abspath(found)) == os.path.dirname(ours) and os.path.realpath(found) == os.path.realpath(ours):
        return os.path.abspath(found)
    return None


# The lines of a pyenv shim that name its root and the pyenv it hands over to.
_SHIM_ROOT = re.compile(rb'^export PYENV_ROOT="([^"]+)"$', re.M)
_SHIM_EXEC = re.compile(rb'^exec "([^"]+/libexec/pyenv)" exec "\$program" "\$@"$', re.M)


def _pyenv_shim(path: str) -> tuple[str, str] | None:
    """``(PYENV_ROOT, pyenv)`` when ``path`` is a pyenv shim, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    root, pyenv = _SHIM_ROOT.search(head), _SHIM_EXEC.search(head)
    if not head.startswith(b"#!") or root is None or pyenv is None:
        return None
    return os.fsdecode(root.group(1)), os.fsdecode(pyenv.group(1))


def _pyenv_which(shim: tuple[str, str], program: str, env: dict[str, str], cwd: str) -> str | None:
    """The interpreter the shim would start in ``cwd`` with ``env`` (``pyenv which``), or None if pyenv cannot say."""
    root, pyenv = shim
    try:
        done = subprocess.run([pyenv, "which", program], cwd=cwd, env={**env, "PYENV_ROOT": root}, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and len(lines) == 1 and os.path.isabs(lines[0]) else None


def _replay(entry: Entry, command: Command) -> None:
    """Write the recorded outputs: directories, then each file to a temporary name beside it, renamed into place."""
    places = Places(command.root)
    outputs = entry.meta["outputs"]
    for out in outputs:
        if out["kind"] == "dir":
            os.makedirs(places.path(out["ref"]), exist_ok=True)
    for out in outputs:
        path = places.path(out["ref"])
        if out["kind"] == "file":
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".lowercache-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(entry.blobs[out["blob"]])
                os.chmod(tmp, out["mode"] & 0o777)  # permission bits only, never set-id
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        elif out["kind"] == "missing" and os.path.isfile(path):
            os.unlink(path)


def _tee(source: Any, sink: Any, kept: list[bytes], full: list[bool]) -> None:
    """Copy a child's stream to ours as it comes, keeping a copy (up to :data:`MAX_STREAM`)."""
    size = 0
    with source:
        while chunk := os.read(source.fileno(), 65536):
            try:
                sink.write(chunk)
                sink.flush()
            except OSError:  # our reader went away (``| head``): the command sees its pipe close, as it would
                full[0] = True
                return
            if size + len(chunk) <= MAX_STREAM:
                kept.append(chunk)
            else:
                full[0] = True
            size += len(chunk)


def _run_child(command: Command, env: dict[str, str], settings: Settings) -> tuple[int, bytes, bytes, str]:
    """Run the command, its output passed through as it comes and kept; its exit code, output, and how it ran.

    A ``python`` command runs in a child of the warm server when it can stand
    in for a new process (``pyexec.py``), writing to the same pipes; else, or
    with no server, as a new process.
    """
    pipes = [os.pipe(), os.pipe()]
    out: list[bytes] = []
    err: list[bytes] = []
    full = [False]
    threads = [threading.Thread(target=_tee, args=(os.fdopen(pipes[0][0], "rb", 0), sys.stdout.buffer, out, full), daemon=True),
               threading.Thread(target=_tee, args=(os.fdopen(pipes[1][0], "rb", 0), sys.stderr.buffer, err, full), daemon=True)]
    for t in threads:
        t.start()
    try:
        code, why = None, "not a python command lowercache's interpreter runs"
        python = _our_python(command.argv, env, command.cwd) if pyexec.parse(command.argv) is not None else None
        if python is not None:
            stdin = 0 if _usable(0) else os.open(os.devnull, os.O_RDONLY)
            code, why = exec_through_server(command.argv, env, python, [stdin, pipes[0][1], pipes[1][1]], settings)
            if stdin:
                os.close(stdin)
        how = "in a child of the warm server" if code is not None else f"as a new process ({why})"
        if code is None:
            child = subprocess.Popen(command.argv, env=env, stdout=pipes[0][1], stderr=pipes[1][1])
            while True:
                try:
                    code = child.wait()
                    break
                except KeyboardInterrupt:
                    continue  # the child got the signal too; its exit code says what it did
    finally:
        for _, write_end in pipes:
            os.close(write_end)  # the tees end once the command and everything it started closed theirs
    for t in threads:
        t.join()
    if full[0]:
        return code, b"", b"\0too long", how  # or not all passed through: not recorded
    return code, b"".join(out), b"".join(err), how


def _usable(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def run(command: Command, settings: Settings, env: dict[str, str]) -> int:
    """``lowercache run``: replay the command from its record when every input is as recorded, else run and record it."""
    store = None
    if settings.direct and not settings.disable:
        from ..cache.tiers import open_store

        try:
            store = open_store(settings)
        except LowercacheError:
            store = None
    try:
        found = _lookup(store, command, settings, env) if store is not None else None
        if found is not None:
            return _answer(store, command, *found, env, settings)
        if store is None or not store.writable:
            return _run_child(command, env, settings)[0]
        return _record(store, command, settings, env)
    finally:
        if store is not None:
            store.close()


def _lookup(store: Any, command: Command, settings: Settings, env: dict[str, str]) -> tuple[Entry, str] | None:
    """The record that answers this run and which one it is: the latest, else an earlier one whose inputs are back."""
    entry = _load(store, command.key())
    if entry is None:
        return None
    why = _judged(entry, command, settings, env)
    if why is None:
        return entry, "its record"

    def load(result: str) -> Entry | None:
        found = _load(store, command.earlier_key(result))
        return found if found is not None and found.meta.get("result") == result else None

    found, said = from_earlier(entry.meta, load, lambda e: _judged(e, command, settings, env))
    if found is not None:
        return found, f"an earlier record (the latest: {why})"
    _set_status(store, command, "lookup", "not used", why + said)
    return None


def _judged(entry: Entry, command: Command, settings: Settings, env: dict[str, str]) -> str | None:
    """:func:`_why_not`, with a record too malformed to judge saying so."""
    try:
        return _why_not(entry, command, settings, env)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"the record is unusable ({e})"


def _answer(store: Any, command: Command, entry: Entry, which: str, env: dict[str, str], settings: Settings) -> int:
    started = time.perf_counter()
    try:
        _replay(entry, command)
    except OSError as e:  # the command itself would have written these: it runs and says what is wrong
        print(f"lowercache: warning: replay failed ({e}); running the command", file=sys.stderr)
        _set_status(store, command, "lookup", "not used", f"writing its files failed ({e})")
        return _run_child(command, env, settings)[0]
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        with contextlib.suppress(BrokenPipeError):
            stream.buffer.write(entry.blobs[name])
            stream.flush()
    seconds = time.perf_counter() - started
    store.add_counts({KIND: {"hit": 1}}, max(entry.meta["cost"] - seconds, 0.0))
    files = sum(o["kind"] == "file" for o in entry.meta["outputs"])
    _set_status(store, command, "lookup", "hit", f"replayed {files} files and the output from {which} without running the command")
    return 0


def _record(store: Any, command: Command, settings: Settings, env: dict[str, str]) -> int:
    with tempfile.TemporaryDirectory(prefix="lowercache-run-") as tmp:
        where = os.path.join(tmp, "observation.json")
        child_env = {**env, ENV_RECORD: where, ENV_OUT: os.pathsep.join(os.path.abspath(o) for o in command.outs)}
        started = time.perf_counter()
        code, out, err, how = _run_child(command, child_env, settings)
        cost = time.perf_counter() - started
        _set_status(store, command, "process", "ran", how)
        try:
            with open(where) as f:
                observation = json.load(f)
        except (OSError, ValueError):
            observation = None
    why = _unrecordable(code, out, err, observation, command, env)
    if why is not None:
        store.add_counts({KIND: {"miss": 1}})
        _set_status(store, command, "record", "none", why)
        return code
    try:
        _store(store, command, settings, env, observation, out, err, cost)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a lowercache fault never fails the command
        print(f"lowercache: warning: the run was not recorded ({e})", file=sys.stderr)
    return code


def _unrecordable(code: int, out: bytes, err: bytes, observation: Any, command: Command, env: dict[str, str]) -> str | None:
    if code != 0:
        return f"the command exited with {code}"
    if err == b"\0too long":
        return f"the command printed more than {MAX_STREAM} bytes on a stream, or its reader went away"
    if not isinstance(observation, dict):
        return "the command was not seen (not a Python process, or it left through os._exit or exec)"
    if observation.get("python") != python_identity() or not _runs_our_python(command.argv, env, command.cwd):
        return "the command does not start lowercache's own Python (its interpreter could change unseen)"
    if observation.get("refused"):
        return f"the command {observation['refused'][0]}"
    return None


def _store(store: Any, command: Command, settings: Settings, env: dict[str, str], observation: dict[str, Any],
           out: bytes, err: bytes, cost: float) -> None:
    places = Places(command.root)
    blobs = {"stdout": out, "stderr": err}
    outputs = []
    for path in observation["outputs"]:
        state = path_state(path, hashed=False)  # its kind: the file is read once, below
        entry: dict[str, Any] = {"ref": places.ref(path), "kind": state["kind"]}
        if state["kind"] == "file":
            data = read_file(path)
            name = f"file/{len(outputs)}"
            blobs[name] = data
            entry.update(blob=name, digest=digest(data), mode=stat.S_IMODE(os.stat(path).st_mode))
        elif state["kind"] == "other":
            raise ValueError(f"{path} is not a regular file")
        outputs.append(entry)
    record = {
        "version": RECORD_VERSION,
        "argv": command.argv,
        "python": observation["python"],
        "identity": identity(settings, env),
        "inputs": observation["inputs"],
        "recorded_ns": observation["recorded_ns"],
        "outputs": outputs,
        "cost": cost,
        "result": _result(outputs, out, err),
    }
    _check(record)
    old = _load(store, command.key())

    @judged_once
    def changed(previous: dict[str, Any]) -> str | None:
        _check(previous)
        return identity_changed(previous.get("identity"), record["identity"]) or inputs_changed(
            previous["inputs"], Places(command.root), previous["recorded_ns"], command.cwd, env)

    previous = old.meta if old is not None else None
    verdict(previous, changed, [], lambda previous: _written(previous) == _written(record), WORDS, command.root).stamp(record)
    if old is not None:
        record["earlier"] = kept_earlier(previous, record, lambda r: r["result"], changed, lambda result, meta: store.put(
            KIND, command.earlier_key(result), Entry(meta=meta, blobs=old.blobs, cost=old.cost)))
    store.put(KIND, command.key(), Entry(meta=record, blobs=blobs, cost=cost))
    store.add_counts({KIND: {"miss": 1}})
    _set_status(store, command, "record", record["status"], record["reason"])


def _written(record: dict[str, Any]) -> list[Any]:
    return [[o["ref"], o["kind"], o.get("digest"), o.get("mode")] for o in record["outputs"]]


def _result(outputs: list[dict[str, Any]], out: bytes, err: bytes) -> str:
    """What a replay gives: the files and both streams. Names an earlier record."""
    return digest_json({"files": _written({"outputs": outputs}), "stdout": digest(out), "stderr": digest(err)})

