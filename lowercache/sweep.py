"""What a record cannot hear, made part of it where it can be: files native code may read, and code that sees its location.

No audit event fires when C, C++ or Rust code opens a file
(``safetensors.torch.load_file``, ``torch.from_file``, a native tokenizer).
So a record (``record/recorder.py``'s ``Recorder``) also keeps the state of every file in the
project tree that such code commonly reads (weights, arrays, exported
graphs) and of every file beside the model, as git's index does: by stat,
hashed only when the stat is in doubt. The sweep is bounded; past a bound
the record is not trusted, and ``explain`` says why.

A record answers in another directory (a copy, a second clone through the
remote tier) only when the code cannot have seen where it runs: a source
that names ``__file__`` or a call of ``os.getcwd()`` ties it to its
directory (:data:`LOCATION_NAMES`).
"""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from typing import Callable, Collection, Optional

from .terminal import Relayed

# Suffixes of files native code commonly reads itself: weights, arrays, exported graphs, other frameworks' models.
NATIVE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".npz", ".onnx", ".tflite", ".pb", ".h5",
                   ".gguf", ".msgpack", ".data", ".raw", ".dat")
MAX_FILES = 2000  # files a record keeps (each is stat'ed on every hit)
MAX_ENTRIES = 100_000  # directory entries the sweep looks at
MAX_SECONDS = 1.0  # time the sweep may take at record time
HASH_BYTES = 1 << 30  # content hashed at record time up to this total; larger trees are proven unchanged by stat only
_SKIPPED_DIRS = frozenset({".git", "__pycache__"})

# Names in source text through which code can learn where it runs. Conservative by design: a name in a comment
# counts too, and only makes the record answer in its own directory.
LOCATION_NAMES = re.compile(
    rb"__file__|__cached__|__spec__|__path__|getcwd|\bcwd\b|_getframe|currentframe|co_filename|getsourcefile|getabsfile"
    rb"|inspect\.getfile|inspect\.stack|extract_stack"
)


FileId = tuple[int, int]  # a file by device and inode
MAX_STREAM_FILES = 64  # files one standard stream is said to end in (``| tee a b c``), through the server


def file_id(st: os.stat_result) -> Optional[FileId]:
    """A regular file's device and inode (None for a pipe, a terminal, a device)."""
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def written_by(stream: object) -> list[FileId]:
    """The regular files a standard stream's output ends in, by device and inode: the file itself (``> build.log``), or
    for a pipe the files the process reading it has open for writing (``| tee build.log``).

    A server child's stream is a pipe to the client, and says which files the client's ends in (``terminal.Relayed``).
    """
    if isinstance(stream, Relayed):
        return [(int(dev), int(ino)) for dev, ino in stream.files]
    try:
        st = os.fstat(stream.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # no stream, or one with no descriptor
        return []
    if stat.S_ISFIFO(st.st_mode):
        return _tee_files(f"pipe:[{st.st_ino}]")
    found = file_id(st)
    return [found] if found is not None else []


def _tee_files(pipe: str) -> list[FileId]:
    """The regular files open for writing in the processes whose standard input is ``pipe`` (Linux's ``/proc``)."""
    found: list[FileId] = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return found
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/fd/0") != pipe:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
                if flags & os.O_ACCMODE != os.O_RDONLY and (written := file_id(os.stat(f"/proc/{pid}/fd/{fd}"))):
                    found.append(written)
            except (OSError, StopIteration, ValueError, IndexError):
                continue
    return found


def streams_written() -> tuple[list[FileId], list[FileId]]:
    """What stdout and stderr each end in (:func:`written_by`); one pipe both write (``2>&1 | tee``) is followed once."""
    out = written_by(sys.stdout)
    return out, list(out) if _one_pipe(sys.stdout, sys.stderr) else written_by(sys.stderr)


def _one_pipe(a: object, b: object) -> bool:
    try:
        first, second = os.fstat(a.fileno()), os.fstat(b.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    return stat.S_ISFIFO(first.st_mode) and (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def stream_files() -> list[FileId]:
    """The files this process's stdout and stderr end in: the command's own output, which changes as it runs, so never
    swept as an input (:func:`sweep`'s ``leave_out``). What code reads of one by path is heard as any read is."""
    out, err = streams_written()
    return [*out, *err]


def _left_out(entry: os.DirEntry[str], leave_out: Collection[FileId]) -> bool:
    if not leave_out:
        return False
    try:
        return file_id(entry.stat()) in leave_out
    except OSError:
        return False


def sweep(root: str, beside: list[str], skip: list[str], user: Callable[[str], bool],
          leave_out: Collection[FileId] = ()) -> tuple[list[str], str | None]:
    """Files under ``root`` with a :data:`NATIVE_SUFFIXES` suffix, and every file (but Python sources) in ``beside``;
    every link among them too, not followed (``checkpoints/latest -> step_2``: native code may read through it).

    ``skip``: directories left out (the output, the cache); ``user``: whether a path is the user's (not
    site-packages, not the standard library); ``leave_out``: files (:func:`stream_files`) that are the command's own
    output. Returns the paths, and why none can be trusted when a bound
    (:data:`MAX_FILES`, :data:`MAX_ENTRIES`, :data:`MAX_SECONDS`) was passed (None otherwise).
    """
    deadline = time.monotonic() + MAX_SECONDS
    skipped = tuple(os.path.join(os.path.abspath(d), "") for d in skip)
    found: set[str] = set()
    for directory in beside:
        for entry in _entries(directory):
            if ((entry.is_file() or entry.is_symlink()) and not entry.name.endswith((".py", ".pyc"))
                    and not (entry.path + os.sep).startswith(skipped) and not _left_out(entry, leave_out)):
                found.add(entry.path)
    pending, seen = [root], 0
    while pending:
        directory = pending.pop()
        entries = _entries(directory)
        names = {e.name for e in entries}
        if "pyvenv.cfg" in names or {"manifest.json", "model.pte"} <= names:
            continue  # a virtual environment (covered by the toolchain's identity), or a lowering's output directory
        for entry in entries:
            seen += 1
            if (entry.path + os.sep).startswith(skipped) or not user(entry.path + os.sep):
                continue
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in _SKIPPED_DIRS:
                    pending.append(entry.path)
            elif (entry.is_symlink() or (entry.name.lower().endswith(NATIVE_SUFFIXES) and entry.is_file())) and not _left_out(
                    entry, leave_out):
                found.add(entry.path)
        if len(found) > MAX_FILES:
            return [], f"is in a project with more than {MAX_FILES} data files (weights and the like) native code could read unseen"
        if seen > MAX_ENTRIES or time.monotonic() > deadline:
            return [], f"is in a project too large to sweep for data files native code could read (over {MAX_ENTRIES} entries or {MAX_SECONDS:g} s)"
    return sorted(found), None


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []
