"""Fresh references shared across one test run: a command a test runs as its fresh reference (``lowercache lower
--no-cache --no-server`` of a project, ExecuTorch's own script) runs once per run for the same inputs, in whichever
xdist worker needs it first; the others get its outputs.

The key is everything the command's outputs may follow: lowercache's sources and the installed toolchain, the command
line, the working directory, the whole environment, and the content of the trees the command reads (each entry's
path, type and mode, each file's bytes, each link's target and what it resolves to; a ``__pycache__`` file only where
its code is not what its source compiles to). Paths below the places a test owns (its temporary directory, the
per-module source snapshot, the per-worker cache home) are written relative to them, so that tests which build the same
project in their own directories share one reference. A test that changes its project (a model edited, a link
re-pointed, a variable set) changes the key and gets a fresh run.

The directory lives for one run: the controller makes it, hands it to the xdist workers, and removes it at the end
(``tests/conftest.py``), so no reference outlives the run. Outside such a run every call runs its command. An entry
is JSON (never unpickled) behind its own sha256, written atomically; a per-key file lock makes the second worker wait
for the first one's result instead of running the command again.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import glob
import hashlib
import importlib.util
import json
import marshal
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

from . import ROOT

OPTION = "lowercache_references"  # the xdist workerinput entry that carries the run's directory
_DISTRIBUTIONS = ("torch", "executorch", "torchao", "tosa-tools", "ethos-u-vela")
_TEXT = (".json", ".txt", ".log")
# pytest's and xdist's own bookkeeping (the test's name, the worker's): a command run by hand has none, and with them no
# two tests or workers could share a reference.
_BOOKKEEPING = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_")  # outputs whose paths are rewritten like the key's; any other must name no place

_state: dict[str, Path | None] = {"directory": None}


def begin(directory: str | Path | None) -> None:
    """Use ``directory`` for this process (``None``: share nothing)."""
    _state["directory"] = Path(directory) if directory else None


def directory() -> Path | None:
    return _state["directory"]


@functools.lru_cache(maxsize=1)
def _sources() -> bytes:
    """lowercache's sources and the toolchain's versions, read once per process: no test edits either."""
    digest = hashlib.sha256()
    for name in _DISTRIBUTIONS:
        try:
            digest.update(f"{name}={metadata.version(name)}\n".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=absent\n".encode())
    package = ROOT / "lowercache"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.digest()


def _normal(text: str, places: Mapping[str, str]) -> str:
    for path, name in sorted(places.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, name)
    return text


def _tree(digest, root: Path, places: Mapping[str, str], seen: set[str], ignore: frozenset[str]) -> None:
    """Every entry below ``root`` but those named in ``ignore`` or at an ignored path (what a link resolves to as well,
    once), by type, mode and content."""
    real = os.path.realpath(root)
    if real in seen:
        return
    seen.add(real)
    digest.update(b"tree " + _normal(str(root), places).encode() + b"\0")
    if not root.exists():
        digest.update(b"absent\0")
        return
    entries = [root] if not root.is_dir() else []
    for folder, dirs, files in os.walk(root):
        kept = sorted(name for name in dirs + files
                      if name not in ignore and name != "__pycache__" and os.path.join(folder, name) not in ignore)
        dirs[:] = [name for name in dirs if name in kept]
        entries.extend(Path(folder, name) for name in kept)
    for path in entries:
        info = path.lstat()
        rel = str(path.relative_to(root)) if path != root else "."
        digest.update(f"{rel}\0{stat.S_IFMT(info.st_mode)}\0{stat.S_IMODE(info.st_mode)}\0".encode())
        if stat.S_ISLNK(info.st_mode):
            digest.update(_normal(os.readlink(path), places).encode() + b"\0")
            _tree(digest, Path(os.path.realpath(path)), places, seen, ignore)
        elif stat.S_ISREG(info.st_mode):
            data = path.read_bytes()
            digest.update(hashlib.sha256(data).digest())
            if path.suffix == ".py" and (path.parent / "__pycache__").is_dir():
                _bytecode(digest, path, data, info)


def _bytecode(digest, path: Path, source: bytes, info: os.stat_result) -> None:
    """A ``.py`` file's cached bytecode, which Python runs instead of its source while the mtime and size it recorded
    are the source's: in the key only then, and only where its code is not what the source compiles to. Python writes
    one beside every module it imports, naming the path it compiled in its code; one that holds just the source's code,
    or that Python would not run, changes nothing, and the same project in another test's directory, or after an
    earlier run, shares a key."""
    for cached in sorted((path.parent / "__pycache__").glob(f"{glob.escape(path.stem)}.*.pyc")):
        data = cached.read_bytes()
        if not _outdated(data, info) and not _compiles_to(source, data, cached.name):
            digest.update(f"{cached.name}\0{int(info.st_mtime)}\0".encode() + hashlib.sha256(data).digest())


def _outdated(cached: bytes, info: os.stat_result) -> bool:
    """Bytecode checked by timestamp whose recorded mtime or size is not the source's: Python compiles the source
    instead (``SourceLoader.get_code``). Bytecode checked by the source's hash is never taken for outdated here."""
    if len(cached) < 16 or int.from_bytes(cached[4:8], "little") != 0:
        return False
    recorded = int.from_bytes(cached[8:12], "little"), int.from_bytes(cached[12:16], "little")
    return recorded != (int(info.st_mtime) & 0xFFFFFFFF, info.st_size & 0xFFFFFFFF)


_COMPILED: dict[tuple[bytes, bytes, str], bool] = {}  # by the digests of source and bytecode: each is compiled once


def _compiles_to(source: bytes, cached: bytes, name: str) -> bool:
    """Whether ``cached`` (a ``__pycache__`` file named ``name``) holds this interpreter's code of ``source``, file name
    aside: code objects compare all else (instructions, constants, names, line and column positions)."""
    memo = (hashlib.sha256(source).digest(), hashlib.sha256(cached).digest(), name)
    if memo not in _COMPILED:
        level = int(name.rsplit(".opt-", 1)[1].split(".")[0]) if ".opt-" in name else 0
        same = False
        if f".{sys.implementation.cache_tag}." in name and cached[:4] == importlib.util.MAGIC_NUMBER:
            try:
                same = marshal.loads(cached[16:]) == compile(source, "<source>", "exec", dont_inherit=True, optimize=level)
            except Exception:  # noqa: BLE001 - unreadable bytecode or source: kept in the key
                same = False
        _COMPILED[memo] = same
    return _COMPILED[memo]


def _named(env: Mapping[str, str]) -> list[Path]:
    """Trees the interpreter reads at start because a variable names them: each ``PYTHONPATH`` entry (a
    ``sitecustomize`` there runs in every process), the user base, the start-up file, lowercache's config file."""
    named = [Path(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return named + [Path(env[name]) for name in ("PYTHONUSERBASE", "PYTHONSTARTUP", "LOWERCACHE_CONFIG") if env.get(name)]


def key(argv: Sequence[str], cwd: Path, env: Mapping[str, str], trees: Sequence[Path], outputs: Sequence[Path],
        places: Mapping[str, str], ignore: frozenset[str] = frozenset()) -> str:
    digest = hashlib.sha256(_sources())
    parts = {
        "argv": [_normal(str(arg), places) for arg in argv],
        "cwd": _normal(str(cwd), places),
        "env": sorted((name, _normal(value, places)) for name, value in env.items()),
        "outputs": [_normal(str(path), places) for path in outputs],
    }
    digest.update(json.dumps(parts).encode())
    seen: set[str] = set()
    ignore = ignore | {os.fspath(path) for path in outputs}  # the command writes them: no input
    for tree in [*trees, *_named(env)]:
        _tree(digest, Path(tree), places, seen, ignore)
    return digest.hexdigest()


def _load(path: Path) -> dict | None:
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    stored, payload = blob[:64], blob[64:]
    if hashlib.sha256(payload).hexdigest().encode() != stored:
        return None
    return json.loads(payload)


def _save(path: Path, entry: dict) -> None:
    payload = json.dumps(entry).encode()
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as tmp:
        tmp.write(hashlib.sha256(payload).hexdigest().encode() + payload)
    os.replace(tmp.name, path)


def _entry(result: subprocess.CompletedProcess, outputs: Sequence[Path], places: Mapping[str, str]) -> dict | None:
    """What is stored of a successful run, or ``None`` when an output names a place and so cannot be shared."""
    files = []
    for path in outputs:
        data = path.read_bytes()
        if path.suffix in _TEXT:
            data = _normal(data.decode(), places).encode()
        elif any(place.encode() in data for place in places):
            return None
        files.append(base64.b64encode(data).decode())
    return {"stdout": _normal(result.stdout, places), "stderr": _normal(result.stderr, places), "files": files}


def _restore(entry: dict, argv, outputs: Sequence[Path], places: Mapping[str, str]) -> subprocess.CompletedProcess:
    back = {name: path for path, name in places.items()}
    for path, data in zip(outputs, entry["files"]):
        raw = base64.b64decode(data)
        if path.suffix in _TEXT:
            raw = _normal(raw.decode(), back).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    return subprocess.CompletedProcess(argv, 0, _normal(entry["stdout"], back), _normal(entry["stderr"], back))


def run(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], outputs: Sequence[Path], places: Mapping[Path, str],
        trees: Sequence[Path] = (), ignore: Sequence[str] = (), timeout: float = 900) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)`` once per run for its inputs: a
    successful run's ``outputs`` (files it writes) and streams are kept and written back for the next caller with the
    same key. pytest's and xdist's own variables are left out of ``env``. ``places``: the directories the test owns,
    each with a name (the test's ``tmp_path``: ``"<tmp>"``); ``trees``: what the command reads besides the toolchain and what its variables name (default: ``cwd``);
    ``ignore``: names or paths in them that are no input (the outputs of earlier runs)."""
    argv = [str(arg) for arg in argv]
    env = {name: value for name, value in env.items() if not name.startswith(_BOOKKEEPING)}
    names = {os.fspath(path): name for path, name in places.items()}
    names.update({os.path.realpath(path): name for path, name in places.items()})

    def execute() -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout)

    folder = directory()
    if folder is None:
        return execute()
    name = key(argv, Path(cwd), env, list(trees) or [Path(cwd)], outputs, names, frozenset(ignore))
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entry = _load(folder / name)
        if entry is not None:
            _count(folder, "hits")
            return _restore(entry, argv, outputs, names)
        result = execute()
        _count(folder, "runs")
        if result.returncode == 0:
            kept = _entry(result, outputs, names)
            if kept is not None:
                _save(folder / name, kept)
        return result


def _count(folder: Path, what: str) -> None:
    """One line per lookup in a log the controller sums at the end of the run (appends of a line are atomic)."""
    with open(folder / "lookups.log", "a") as log:
        log.write(what + "\n")


def summary(folder: Path) -> str | None:
    """The run's line for the terminal summary; ``None`` when no test asked for a reference."""
    try:
        lines = (folder / "lookups.log").read_text().split()
    except OSError:
        return None
    return f"fresh references shared across the run: {lines.count('hits')} served, {lines.count('runs')} run"
