"""The toolchain part of every key: versions and sources that shape the output.

A key includes the versions of torch, executorch, tosa-tools and Vela, a hash
of the Arm backend's Python sources (a local patch to a pass changes the key
even when the version string does not) and a hash of lowercache's own sources
that produce results (the cache engine, the lowering flow, the speed-ups), as
torch's compile cache hashes its own code: an upgrade that changes a step's
code misses instead of serving what the old code produced.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import xxhash

# lowercache's rooms whose code decides what a step produces (not the CLI, the benchmark or the docs).
_PRODUCING_ROOMS = ("cache", "lowering", "speedups")


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


@functools.lru_cache(maxsize=1)
def lowercache_digest() -> str:
    """Digest of the sources of lowercache's producing rooms (about 50 files: a few milliseconds, once per process)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return xxhash.xxh3_128_hexdigest("".join(source_digest(os.path.join(package, room)) for room in _PRODUCING_ROOMS).encode())
