"""The toolchain part of every key: versions and sources that shape the output.

A key includes the versions of torch, executorch, tosa-tools and Vela, a hash
of the Arm backend's Python sources (a local patch to a pass changes the key
even when the version string does not) and a hash of lowercache's own sources
that produce results (the cache engine, the lowering flow, the speed-ups), as
torch's compile cache hashes its own code: an upgrade that changes a step's
code misses instead of serving what the old code produced.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from typing import Any

import xxhash

from .digests import stat_key

# lowercache's rooms whose code decides what a step produces (not the CLI, the benchmark or the docs).
_PRODUCING_ROOMS = ("cache", "lowering", "speedups")
# Modules in those rooms whose code cannot change an artifact's bytes: the remote tiers' transport, the run history,
# which tiers to open, the index file's upkeep, the pass census (research, reached from a test and a benchmark), and the
# numerics check (it reads a lowering; its own key has its code).
_NOT_PRODUCING = frozenset({"cache/remote.py", "cache/history.py", "cache/tiers.py", "cache/dbfile.py", "lowering/census.py",
                            "lowering/numerics.py"})
_MEMO_VERSION = 1


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def source_digest(root: str, skip_dirs: frozenset[str] = frozenset({"test", "tests", "__pycache__"})) -> str:
    """Digest of every .py file under ``root``: relative path and content, in sorted order."""
    h = xxhash.xxh3_128()
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def toolchain_parts() -> dict[str, str]:
    """Named toolchain parts, computed once per process."""
    # Found without importing it: importing the Arm backend costs seconds.
    executorch_dir = importlib.util.find_spec("executorch").submodule_search_locations[0]
    return {
        "torch": version("torch"),
        "executorch": version("executorch"),
        "tosa_tools": version("tosa-tools"),
        "vela": version("ethos-u-vela"),
        "arm_backend_src": source_digest(os.path.join(executorch_dir, "backends", "arm")),
        "lowercache_src": lowercache_digest(),
    }


def code_digest(source: bytes) -> str:
    """Digest of a module's code as its syntax tree, without docstrings (and so without comments or layout)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return xxhash.xxh3_128_hexdigest(ast.dump(tree, include_attributes=False).encode())


def producing_modules() -> list[str]:
    """The producing rooms' modules, as paths relative to the package, sorted."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for room in _PRODUCING_ROOMS:
        for directory, dirs, files in os.walk(os.path.join(package, room)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.relpath(os.path.join(directory, f), package) for f in files if f.endswith(".py")]
    return sorted(m for m in found if m.replace(os.sep, "/") not in _NOT_PRODUCING)


@functools.lru_cache(maxsize=1)
def lowercache_digest() -> str:
    """Digest of the code of lowercache's producing modules, as syntax trees: a docstring or comment edit keeps every key.

    Parsing the modules takes too long for a direct-mode hit, so
    each module's digest is kept in a memo file beside the default cache,
    under its stat (``stat_key``: an edit changes the ctime).
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    memo = _Memo()
    h = xxhash.xxh3_128()
    for module in producing_modules():
        h.update(module.replace(os.sep, "/").encode() + b"\0" + memo.digest(os.path.join(package, module)).encode() + b"\0")
    memo.save()
    return h.hexdigest()


class _Memo:
    """Module digests by path and stat, in ``<default cache>/toolchain-digests.json``; any fault means parsing again."""

    def __init__(self) -> None:
        from ..config import default_cache_dir

        self.path = default_cache_dir() / "toolchain-digests.json"
        self.changed = False
        try:
            loaded = json.loads(self.path.read_text())
            valid = isinstance(loaded, dict) and loaded.get("version") == _MEMO_VERSION and isinstance(loaded.get("modules"), dict)
            self.entries: dict[str, Any] = loaded["modules"] if valid else {}
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
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".toolchain-")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _MEMO_VERSION, "modules": self.entries}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only or full cache directory: the next process parses again
