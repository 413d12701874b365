"""Where a recorded path is and what it holds: portable path references, path states, and the check that a path still holds them.

Records name files relative to the project root (or site-packages) so a copy
of the project elsewhere can hit, and prove a file unchanged by its stat
where that is safe (git's racy-clean rule), else by its content digest.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from ..cache.digests import digest, digest_json, stat_key

# A file changed less than this before its stat was recorded may change again
# without changing its timestamps (coarse file-system clocks): it is hashed.
RACY_NS = 2_000_000_000


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


def site_dirs() -> dict[str, str]:
    """site-packages (pure and platform): the anchors a record names installed files by."""
    import sysconfig

    paths = sysconfig.get_paths()
    return {name: os.path.normpath(paths[name]) for name in ("purelib", "platlib")}


def stdlib_dirs() -> tuple[str, ...]:
    """The standard library's directories: the interpreter's identity covers what is read there."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(os.path.normpath(paths[name]) for name in ("stdlib", "platstdlib"))


class Places:
    """Turns absolute paths into portable references (``["root", rel]``, ``["purelib", rel]``, ``["abs", path]``) and back."""

    def __init__(self, root: str):
        self.anchors = {"root": os.path.normpath(root), **site_dirs()}

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


def stat_meta(st: os.stat_result, fields: Any) -> dict[str, int]:
    """The observed stat ``fields`` (``mode``, ``uid``, ``gid``, ``mtime_ns``) of ``st``."""
    if not set(fields) <= {"mode", "uid", "gid", "mtime_ns"}:
        raise ValueError("bad stat field")
    return {f: (stat.S_IMODE(st.st_mode) if f == "mode" else getattr(st, f"st_{f}")) for f in sorted(fields)}


def is_system(st: os.stat_result) -> bool:
    """A device node (``/dev/null``, ``/dev/urandom``) or a file of a kernel file system (``/proc``, ``/sys``)."""
    return stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or os.major(st.st_dev) == 0 and _kernel_fs(st.st_dev)


def _kernel_fs(dev: int) -> bool:
    """Whether device ``dev`` holds one of the kernel's own file systems (``/proc/self/mountinfo``)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields, _, rest = line.partition(b" - ")
                parts = fields.split()
                major, _, minor = parts[2].partition(b":")
                if os.makedev(int(major), int(minor)) == dev:
                    return rest.split(b" ", 1)[0] in (b"proc", b"sysfs", b"cgroup", b"cgroup2", b"devpts", b"debugfs",
                                                       b"tracefs", b"securityfs", b"bpf", b"mqueue", b"nsfs")
    except (OSError, ValueError, IndexError):
        pass
    return False


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


def entries(directory: str) -> list[str] | None:
    """The directory's entries, None when it cannot be listed."""
    try:
        return os.listdir(directory)
    except OSError:
        return None


def named(found: list[str] | None, name: str) -> list[str]:
    """The entries a module ``name`` could be found as (None: the directory is unreadable)."""
    if found is None:
        return ["<unreadable>"]
    return sorted(e for e in found if e == name or e.startswith(name + "."))


def size(path: str) -> int:
    """The file's size, 0 when it cannot be seen."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
