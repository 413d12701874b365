"""The toolchain part of every key: versions and sources that shape the output.

A key includes the interpreter's version, the version of every distribution
whose code a lowering imports (:data:`STACK`; tests/process/test_toolchain_stack.py
lowers a model of each target family in a fresh interpreter and fails on an
import from a distribution that is neither there nor in :data:`NOT_STACK`), a
hash of the sources of the packages whose code does the lowering
(:data:`HASHED_PACKAGES`: an edit in place or an editable install changes the
key even when the version string does not) and a hash of lowercache's own
byte-shaping code (:data:`BYTE_SHAPING`: the lowering flow, the speed-ups, and
the code that makes keys and stored forms), as torch's compile cache hashes
its own code: an upgrade that changes a step's code misses instead of serving
what the old code produced. Each module counts as its syntax tree without
docstrings, so an edit to a docstring or a comment keeps every key, and an
edit to code that shapes no bytes (the CLI, the record, ``run``, the remote
transport) keeps them too.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import posix
import struct
import sys
import tempfile
from typing import Any

import xxhash

from .digests import stat_key

# lowercache's modules whose code decides the bytes a step stores, or the keys it is stored under, relative to the
# package: whole rooms (a trailing "/") and single modules. Nothing else is hashed: a module added elsewhere shapes no
# key until named here. tests/unit/test_toolchain.py checks that whatever these import from lowercache is named here
# or below.
BYTE_SHAPING = ("lowering/", "speedups/", "targets/", "delegation.py", "cache/digests.py", "cache/hashing.py", "cache/records.py",
                "cache/steps.py", "cache/toolchain.py")
# lowercache modules that byte-shaping code imports but that make no stored lowering, each with the reason.
NOT_BYTE_SHAPING = {
    "lowering/check/numerics.py": "the numerics check reads a lowering; its own key holds its code, so an edit re-runs checks",
    "lowering/check/numerics_layers.py": "part of the numerics check (as lowering/check/numerics.py)",
    "lowering/check/numerics_report.py": "part of the numerics check (as lowering/check/numerics.py)",
    "cache/store.py": "moves and checks bytes other code made: every entry is read back against its digest",
    "errors.py": "exception types: a step that raises stores nothing",
    "precheck.py": "checks that MODEL names a file and the target is known; loads and makes nothing",
    "config.py": "reads settings; those that shape bytes (target, speed-ups, options) are key parts of their own",
}
# Distributions whose code runs in a lowering, by version (besides the four named parts: torch, executorch, tosa-tools,
# Vela). A distribution whose modules a lowering imports is here or in NOT_STACK (tests/process/test_toolchain_stack.py).
STACK = ("torchao", "numpy", "ml_dtypes", "sympy", "mpmath", "networkx", "flatbuffers", "ruamel.yaml", "ruamel.yaml.clib",
         "packaging", "typing_extensions", "filelock", "Jinja2", "MarkupSafe", "tabulate", "zstandard")
# Distributions a lowering imports that make none of its bytes, each with the reason.
NOT_STACK = {
    "lowercache": "its byte-shaping code is hashed as code (lowercache_src); the rest makes no stored lowering",
    "diskcache": "the local store: every entry is read back against its digest",
    "xxhash": "makes keys and digests; a change of its output changes keys (a miss), never the bytes stored",
    "redis": "the shared store's transport: every entry is read back against its digest",
    "cryptography": "imported by redis's client; moves no lowering bytes",
    "platformdirs": "says where the cache lives",
    "tqdm": "progress bars",
    "colorama": "imported by torch's inductor, when installed, to colour log lines",
    "wcwidth": "imported by tabulate, when installed, to measure printed columns",
}
# Packages whose code does the lowering, hashed whole outside test directories, by content: Python, and the data files
# it reads (ExecuTorch's operator YAML and flatbuffer schemas, the flatc it runs, torchgen's templates).
HASHED_PACKAGES = ("torch", "torchgen", "functorch", "executorch", "torchao", "ethosu", "tosa_serializer")
# What a hashed package holds that a lowering neither reads nor runs as a file (C and C++ headers and sources, build
# files, type stubs, bytecode), and compiled libraries: torch's alone are 450 MB, whose reading would cost a new
# machine seconds before its first hit; a release changes them with the version, which is in the key.
NOT_READ_AT_RUN = (".h", ".hpp", ".cuh", ".cu", ".c", ".cc", ".cpp", ".cmake", ".pyi", ".pyc", ".so", ".dylib", ".dll",
                   ".a", ".lib", ".md")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MEMO_VERSION = 1


def version(dist: str) -> str:
    import importlib.metadata  # not at the top: its import (email, ...) is a tenth of a direct-mode hit

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def versions(dists: tuple[str, ...], memo: _PartsMemo | None = None) -> dict[str, str]:
    """Each distribution's version, as :func:`version` says it, kept in a memo (``toolchain-parts.json``) while no
    directory on ``sys.path`` and no distribution's metadata file has moved (an install, an upgrade, a removal moves
    them): a direct-mode hit does not pay for ``importlib.metadata``'s import and its search (50-100 ms). One entry per
    search path: the installed script, ``python -m lowercache``, a script under ``lowercache run`` each search another
    path, and with one entry for all, each replaced the other's and the next hit of the other kind searched again."""
    memo = memo or _PartsMemo()
    where = [[d, *_stamp(d)] for d in sys.path]
    name = repr((dists, sys.path))
    known = memo.get("versions", name)
    if (isinstance(known, dict) and known.get("where") == where and isinstance(known.get("found"), dict)
            and set(known["found"]) == set(dists)
            and all(isinstance(v, list) and len(v) == 3 and _stamp(v[1]) == v[2] for v in known["found"].values())):
        return {dist: str(known["found"][dist][0]) for dist in dists}
    import importlib.metadata

    found = {}
    for dist in dists:
        try:
            meta = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = ["absent", "", _stamp("")]
            continue
        path = getattr(meta, "_path", None)  # PathDistribution's own directory: where its METADATA is read from
        if path is None:
            return {dist: version(dist) for dist in dists}  # found another way: no memo
        metadata = os.path.join(os.fspath(path), "METADATA" if os.path.isfile(os.path.join(os.fspath(path), "METADATA")) else "PKG-INFO")
        found[dist] = [meta.version, metadata, _stamp(metadata)]
    memo.put("versions", name, {"where": where, "found": found})
    return {dist: str(found[dist][0]) for dist in dists}


def _stamp(path: str) -> list[int]:
    """A path's ``stat_key``, or ``[]`` when it cannot be stat'ed.

    Through ``posix.stat``, not ``os.stat``: a recorder listening in the process (``lowercache run``'s) watches
    ``os.stat``, and these stats (of every ``sys.path`` entry, the script's directory among them) are the memo's, not
    the command's; heard, the directory's mtime became an input, and a replay's write into it made the next run miss.
    """
    try:
        return stat_key(posix.stat(path)) if path else []
    except OSError:
        return []


# Directories a source digest does not enter: tests, bytecode, and a source checkout's build outputs (an editable install
# of ExecuTorch maps the package to its checkout). Hidden directories (``.git``) are left out too: no module lives there.
SKIP_DIRS = frozenset({"test", "tests", "__pycache__", "cmake-out", "pip-out", "buck-out"})


def source_digest(root: str, skip_dirs: frozenset[str] = SKIP_DIRS,
                  suffixes: tuple[str, ...] = (".py",), memo: _PartsMemo | None = None, every_file: bool = False) -> str:
    """Digest of every file under ``root`` whose name ends in one of ``suffixes`` (``every_file``: every file but those
    named in :data:`NOT_READ_AT_RUN`): relative path and content, in sorted order.

    Kept in a memo (``toolchain-parts.json``) with the stat of every directory
    and file it read: while no directory has moved (a file added, removed or
    renamed moves its directory) the memo's list of files stands without a
    walk, and while no file has moved either, the digest stands without a read
    (the hashed packages' 6,100 files and 1,300 directories: a stat each, 15-25 ms).
    """
    memo = memo or _PartsMemo()
    suffixes = () if every_file else suffixes
    place = root if suffixes == (".py",) else f"{root}|{'|'.join(suffixes) or '*'}"
    known = memo.get("sources", place)
    if (isinstance(known, dict) and isinstance(known.get("dirs"), list) and isinstance(known.get("files"), str)
            and isinstance(known.get("stats"), str) and isinstance(known.get("digest"), str)):
        files = known["files"].split("\n") if known["files"] else []
        if _stats(root, known["dirs"]) == known.get("dirs_stats") and _stats(root, files) == known["stats"]:
            return known["digest"]
    dirs, files = _listing(root, skip_dirs, suffixes)
    dirs_stats, stats = _stats(root, dirs), _stats(root, files)
    h = xxhash.xxh3_128()
    each = {}  # file -> its own digest, for saying which files a change of the whole digest came from
    for rel in files:
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            content = f.read()
        h.update(content)
        each[rel] = xxhash.xxh3_64_hexdigest(content)
    digest = h.hexdigest()
    # Kept only when nothing moved while it was read: a file added between the walk and the directories' stats is seen
    # by the second walk, one added after them moves a directory.
    if stats and (_listing(root, skip_dirs, suffixes), _stats(root, dirs), _stats(root, files)) == ((dirs, files), dirs_stats, stats):
        memo.put("sources", place, {"dirs": dirs, "dirs_stats": dirs_stats, "files": "\n".join(files), "stats": stats,
                                    "digest": digest})
        _note_changes(place, digest, each)
    return digest


def _listing(root: str, skip_dirs: frozenset[str], suffixes: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The directories under ``root`` and the files in them named ``*suffixes`` (none: every file but
    :data:`NOT_READ_AT_RUN`), relative to it, in walk order."""
    dirs, files = [], []
    prefix = os.path.join(root, "")
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in skip_dirs and not d.startswith("."))
        dirs.append(directory[len(prefix):] if directory.startswith(prefix) else "")
        files += [os.path.join(dirs[-1], name) for name in sorted(names)
                  if (name.endswith(suffixes) if suffixes else not name.endswith(NOT_READ_AT_RUN))]
    return dirs, files


def _note_changes(place: str, digest: str, each: dict[str, str]) -> None:
    """Keep each file's digest (``toolchain-files.json``, read only here) and, under the new digest, the files that
    differ from the last ones seen at ``place``: what ``explain`` names when a toolchain part changed."""
    from ..config import default_cache_dir

    path = default_cache_dir() / "toolchain-files.json"
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) and known.get("version") == _MEMO_VERSION else {}
    except (OSError, ValueError):
        known = {}
    before = known.get(place)
    if isinstance(before, dict) and isinstance(before.get("digest"), str) and isinstance(before.get("files"), dict):
        moved = sorted(rel for rel in set(before["files"]) | set(each) if before["files"].get(rel) != each.get(rel))
        if moved:
            named = moved[:_NAMED_CHANGES] + ([f"{len(moved) - _NAMED_CHANGES} more"] if len(moved) > _NAMED_CHANGES else [])
            _PartsMemo().put("changes", digest, {"from": before["digest"], "files": named})
    known = {k: v for k, v in known.items() if k != "version" and os.path.isdir(k.split("|")[0])}
    known.update({"version": _MEMO_VERSION, place: {"digest": digest, "files": each}})
    write_memo(path, known)  # a read-only or full cache directory: explain names no files


def changed_files(before: str, after: str) -> list[str]:
    """The files whose change took a source digest from ``before`` to ``after``, when this machine saw that change
    happen; else none."""
    found = _PartsMemo().get("changes", after)
    if isinstance(found, dict) and found.get("from") == before and isinstance(found.get("files"), list):
        return [str(name) for name in found["files"]]
    return []


def write_memo(path: Any, value: Any) -> None:
    """Write a memo file (JSON) atomically, for lowercache's memos beside the default cache (processes share them); a
    read-only or full cache directory writes nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".toolchain-")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError:
        pass


_NAMED_CHANGES = 5
_KEPT_CHANGES = 50
_KEPT_PATHS = 16
_STAT = struct.Struct("<5q")


def _stats(root: str, names: list[str]) -> str:
    """One digest of the ``stat_key`` of every name under ``root``, in order (a missing one counts as such).

    Relative to an open ``root``, through ``posix.stat`` (as :func:`_stamp`): a stat of a short name is a quarter
    cheaper than of the whole path, and these are thousands."""
    h = xxhash.xxh3_128()
    try:
        fd = posix.open(root or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return ""
    try:
        for name in names:
            try:
                st = posix.stat(name or ".", dir_fd=fd)
                h.update(_STAT.pack(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
            except OSError:
                h.update(b"-")
    finally:
        posix.close(fd)
    return h.hexdigest()


def toolchain_parts() -> dict[str, str]:
    """Named toolchain parts, of the packages where the import system finds them now: an imported package's own
    directory, else where its import would find it (without importing it: importing the Arm backend costs seconds).

    Computed once per process for each set of places, so that parts found early (before a recorder's backstop starts,
    which would trace each of their thousands of stats) agree with the parts a lowering finds later, after a script
    changed its search path and imports a package from elsewhere.
    """
    return _parts_at(package_dirs())


def package_dirs() -> tuple[str, ...]:
    """ExecuTorch's directory, then each of :data:`HASHED_PACKAGES`' ("" for one not installed).

    Looked up again only when the search path, the finders or the set of those packages imported changed: a search
    stats each path entry, and keys ask for the parts hundreds of times a lowering."""
    names = ("executorch", *HASHED_PACKAGES)
    return _dirs_for(names, tuple(sys.path), tuple(map(id, sys.meta_path)), tuple(name in sys.modules for name in names))


@functools.lru_cache(maxsize=8)
def _dirs_for(names: tuple[str, ...], *_state: Any) -> tuple[str, ...]:
    return tuple(map(package_dir, names))


def forget_parts() -> None:
    """Find the toolchain parts again on the next call (a forked server child: files may have changed since the warm-up)."""
    _parts_at.cache_clear()
    _dirs_for.cache_clear()


@functools.lru_cache(maxsize=4)
def _parts_at(dirs: tuple[str, ...]) -> dict[str, str]:
    executorch_dir, hashed = dirs[0], dirs[1:]
    if not executorch_dir:
        raise ModuleNotFoundError("No module named 'executorch'")
    memo = _PartsMemo()  # read once: it holds every part below
    found = versions(("torch", "executorch", "tosa-tools", "ethos-u-vela", *STACK), memo)
    parts = {
        "python": f"{sys.implementation.name} {sys.version.split()[0]}",
        "torch": found["torch"],
        "executorch": found["executorch"],
        "tosa_tools": found["tosa-tools"],
        "vela": found["ethos-u-vela"],
        "stack": ", ".join(f"{dist} {found[dist]}" for dist in STACK),
        "arm_backend_src": source_digest(os.path.join(executorch_dir, "backends", "arm"), memo=memo),
    }
    for package, found in zip(HASHED_PACKAGES, hashed):
        parts[f"{package}_src"] = source_digest(found, memo=memo, every_file=True)
    parts["lowercache_src"] = lowercache_digest()
    return parts


def hashed_package_dirs() -> tuple[str, ...]:
    """Where the packages hashed whole are, each with a trailing separator."""
    return tuple(os.path.join(found, "") for found in package_dirs()[1:] if found)


def in_toolchain_part(path: str, dirs: tuple[str, ...]) -> bool:
    """Whether the toolchain part's source digests count ``path``: in one of the hashed package ``dirs``
    (:func:`hashed_package_dirs`), outside the directories a digest skips, and not a file kind it leaves out."""
    root = next((d for d in dirs if path.startswith(d)), None)
    if root is None or path.endswith(NOT_READ_AT_RUN):
        return False
    inside = path[len(root):].split(os.sep)[:-1]
    return not any(part in SKIP_DIRS or part.startswith(".") for part in inside)


def package_dir(name: str) -> str:
    """Where a package's code is, found without importing it ("" when it is not installed: its digest is of nothing).

    A namespace package (ExecuTorch is one) has a portion in each search path entry that holds its directory, and its
    search locations follow the path as it changes: a script that puts a vendored copy first would move them while the
    modules this process runs stay where they were imported from. Once a submodule is imported, its portion is the
    package's directory."""
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if len(locations) > 1 and spec is not None and spec.origin is None:
        imported = _imported_portion(name, locations)
        if imported:
            return imported
    return locations[0] if locations else ""


def _imported_portion(name: str, locations: list[str]) -> str:
    """The portion of namespace package ``name`` its first imported submodule came from ("" if none is imported)."""
    prefixes = {os.path.join(location, ""): location for location in locations}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(name + "."):
            continue
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), None)
        portion = next((location for prefix, location in prefixes.items() if where and where.startswith(prefix)), None)
        if portion:
            return portion
    return ""


def code_digest(source: bytes) -> str:
    """Digest of a module's code as its syntax tree, without docstrings (and so without comments or layout)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return xxhash.xxh3_128_hexdigest(ast.dump(tree, include_attributes=False).encode())


def byte_shaping_modules(package: str = _PACKAGE) -> list[str]:
    """The declared byte-shaping modules found in ``package``, as ``/``-separated paths relative to it, sorted."""
    found = []
    for declared in BYTE_SHAPING:
        if not declared.endswith("/"):
            found += [declared] if os.path.isfile(os.path.join(package, declared)) else []
            continue
        for directory, dirs, files in os.walk(os.path.join(package, declared)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.relpath(os.path.join(directory, f), package).replace(os.sep, "/") for f in files if f.endswith(".py")]
    return sorted(set(found) - set(NOT_BYTE_SHAPING))


def package_digest(package: str, remember: bool = True) -> str:
    """Digest of the code of ``package``'s byte-shaping modules, as syntax trees; ``remember``: keep module digests in the memo."""
    memo = _Memo(remember)
    h = xxhash.xxh3_128()
    for module in byte_shaping_modules(package):
        h.update(module.encode() + b"\0" + memo.digest(os.path.join(package, module)).encode() + b"\0")
    memo.save()
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def lowercache_digest() -> str:
    """Digest of the code of lowercache's byte-shaping modules, as syntax trees: a docstring or comment edit keeps every key.

    Parsing the modules takes too long for a direct-mode hit, so
    each module's digest is kept in a memo file beside the default cache,
    under its stat (``stat_key``: an edit changes the ctime).
    """
    return package_digest(_PACKAGE)


def memo_prefixes() -> tuple[str, ...]:
    """Where the memos below (and their temporary files) live: lowercache's own bookkeeping, which any process that imports
    it may read and write, so neither an input nor an output of a command a recorder watches."""
    from ..config import default_cache_dir

    where = str(default_cache_dir()) + os.sep
    return (where + "toolchain-", where + ".toolchain-")


class _Memo:
    """Module digests by path and stat, in ``<default cache>/toolchain-digests.json``; any fault means parsing again."""

    def __init__(self, remember: bool = True) -> None:
        from ..config import default_cache_dir

        self.path = default_cache_dir() / "toolchain-digests.json"
        self.remember = remember
        self.changed = False
        if not remember:
            self.entries: dict[str, Any] = {}
            return
        try:
            loaded = json.loads(self.path.read_text())
            valid = isinstance(loaded, dict) and loaded.get("version") == _MEMO_VERSION and isinstance(loaded.get("modules"), dict)
            self.entries = loaded["modules"] if valid else {}
        except (OSError, ValueError):
            self.entries = {}

    def digest(self, path: str) -> str:
        stamp = stat_key(os.stat(path))
        known = self.entries.get(path)
        if isinstance(known, list) and len(known) == 2 and known[0] == stamp and isinstance(known[1], str):
            return known[1]
        with open(path, "rb") as f:
            digest = code_digest(f.read())
        self.entries[path] = [stamp, digest]
        self.changed = True
        return digest

    def save(self) -> None:
        if not (self.changed and self.remember):
            return
        write_memo(self.path, {"version": _MEMO_VERSION, "modules": self.entries})  # on a fault the next process parses again


class _PartsMemo:
    """Toolchain parts found before, by kind and name, with what proves them current, in ``<default cache>/toolchain-parts.json``;
    any fault means finding them again (as :class:`_Memo`)."""

    def __init__(self) -> None:
        from ..config import default_cache_dir

        self.path = default_cache_dir() / "toolchain-parts.json"
        try:
            loaded = json.loads(self.path.read_text())
            self.entries = loaded if isinstance(loaded, dict) and loaded.get("version") == _MEMO_VERSION else {}
        except (OSError, ValueError):
            self.entries = {}

    def get(self, kind: str, name: str) -> Any:
        found = self.entries.get(kind)
        return found.get(name) if isinstance(found, dict) else None

    def put(self, kind: str, name: str, value: Any) -> None:
        """Keep ``value``; written at once, atomically (processes share the file: the last writer's entries stay)."""
        fresh = _PartsMemo().entries  # what another process wrote meanwhile
        kept = fresh.get(kind) if isinstance(fresh.get(kind), dict) else {}
        if kind == "sources":  # trees since removed (temporary copies, old environments) would make every read slower
            kept = {place: known for place, known in kept.items() if os.path.isdir(place.split("|")[0])}
        if kind == "changes":  # the latest changes are the ones explain is asked about
            kept = dict(list(kept.items())[-_KEPT_CHANGES + 1:])
        if kind == "versions":  # one per search path: the latest (temporary directories on a path come and go)
            kept = dict(list({k: v for k, v in kept.items() if k != name}.items())[-_KEPT_PATHS + 1:])
        fresh.update({"version": _MEMO_VERSION, kind: {**kept, name: value}})
        self.entries = fresh
        write_memo(self.path, fresh)
