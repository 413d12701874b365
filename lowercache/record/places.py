"""Where a recorded path is and what it holds: portable path references, path states, and the check that a path still holds them.

Records name files relative to the project root (or site-packages) so a copy
of the project elsewhere can hit, and prove a file unchanged by its stat
where that is safe (git's racy-clean rule), else by its content digest.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
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

    def search_path(self) -> list[list[str]]:
        """This process's module search path (``sys.path``, ``""`` as the working directory), entry by entry as references."""
        return [self.ref(os.path.abspath(p or ".")) for p in sys.path]

    def path(self, ref: Any) -> str:
        if not (isinstance(ref, list) and len(ref) == 2 and all(isinstance(p, str) for p in ref)):
            raise ValueError("bad path reference")
        anchor, rel = ref
        if anchor == "abs":
            return rel
        if anchor not in self.anchors or os.path.isabs(rel):
            raise ValueError("bad path reference")
        return os.path.normpath(os.path.join(self.anchors[anchor], rel))


# Every field of a stat result a caller can observe, but the access time (reading a file moves it).
STAT_FIELDS = ("mode", "ino", "dev", "nlink", "uid", "gid", "size", "mtime_ns", "ctime_ns", "blocks", "blksize", "rdev")
MAX_HOPS = 40  # links followed in one chain, as the kernel's ELOOP bound


def stat_meta(st: os.stat_result, fields: Any) -> dict[str, int]:
    """The observed stat ``fields`` (of :data:`STAT_FIELDS`) of ``st``; ``mode`` is the permission bits (the kind is kept apart)."""
    if not set(fields) <= set(STAT_FIELDS):
        raise ValueError("bad stat field")
    return {f: (stat.S_IMODE(st.st_mode) if f == "mode" else getattr(st, f"st_{f}")) for f in sorted(fields)}


def link_chain(path: str, lst: os.stat_result) -> list[str]:
    """The text of each link met resolving ``path``'s last component (``lst``: its lstat), hop by hop; empty for a non-link.

    A link's text is what ``os.readlink``, ``os.path.realpath`` and ``Path.resolve()`` show, so each hop is an input
    of its own: ``checkpoints/latest -> step_2`` re-pointed changes the chain even where both targets hold the same names.
    """
    return _hops(path, lst)[0]


def _hops(path: str, lst: os.stat_result) -> tuple[list[str], list[os.stat_result]]:
    """:func:`link_chain`, and the lstat of each hop after the first."""
    chain: list[str] = []
    seen: list[os.stat_result] = []
    while stat.S_ISLNK(lst.st_mode) and len(chain) < MAX_HOPS:
        text = os.readlink(path)
        chain.append(text)
        path = os.path.join(os.path.dirname(path), text)
        try:
            lst = os.lstat(path)
        except OSError:
            break  # a dangling link ends here
        seen.append(lst)
    return chain, seen


def hop_dirs(path: str) -> list[str]:
    """The directory of ``path`` and of every hop its links resolve through: a model file that is a link into another
    directory has the data it reads beside its target."""
    dirs = [os.path.dirname(path)]
    try:
        chain = link_chain(path, os.lstat(path))
    except OSError:
        return dirs
    for text in chain:
        path = os.path.join(os.path.dirname(path), text)
        dirs.append(os.path.dirname(path))
    return list(dict.fromkeys(dirs))


# File systems whose files the kernel makes up when read (process and machine state, not a project's data).
_PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "pstore",
                        "efivarfs", "fusectl", "binfmt_misc", "mqueue", "nsfs", "selinuxfs", "rpc_pipefs", "devpts"})
_pseudo_devices: frozenset[int] | None = None


def pseudo_devices() -> frozenset[int]:
    """The device numbers of the mounted kernel file systems (``/proc/self/mountinfo``; none where there is no such file)."""
    global _pseudo_devices
    if _pseudo_devices is None:
        found = set()
        try:
            with open("/proc/self/mountinfo", "rb") as f:
                for line in f:
                    fields, _, rest = line.partition(b" - ")
                    parts = fields.split()
                    if len(parts) > 2 and rest.split(b" ", 1)[0].decode(errors="replace") in _PSEUDO_FS:
                        major, _, minor = parts[2].partition(b":")
                        found.add(os.makedev(int(major), int(minor)))
        except (OSError, ValueError):
            pass
        _pseudo_devices = frozenset(found)
    return _pseudo_devices


def is_system(st: os.stat_result) -> bool:
    """A device node (``/dev/null``, ``/dev/urandom``) or a file of a kernel file system (``/proc``, ``/sys``): known by
    what it is, not by where, so a project under ``/dev/shm`` is a project like any other."""
    return stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or st.st_dev in pseudo_devices()


def on_system(path: str) -> bool:
    """:func:`is_system` of the path, or, when it is gone (``/proc/self/fd/3`` of a descriptor since closed), of the
    nearest directory above it that is there: a file of a kernel file system is no input even once it has vanished."""
    while True:
        try:
            return is_system(os.lstat(path))
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent


def read_file(path: str) -> bytes:
    """The bytes of a file lowercache reads for itself, past a backstop's filter where one may be installed (it is only
    where ``tracer`` was imported: never on a hit)."""
    tracer = sys.modules.get(f"{__package__}.tracer")
    if tracer is not None and os.path.isabs(path):
        return tracer.read_heard(path)
    with open(path, "rb") as f:
        return f.read()


def _file_digest(path: str) -> str:
    return digest(read_file(path))


def installed_state(path: str, known: dict[str, Any] | None = None) -> list[Any]:
    """An installed module file as a record keeps it: its ``stat_key`` (the fast check here) and its content digest
    (the check on another machine, or after a copy that kept the bytes).

    ``known``: digests found before, by path, with the stat they were found under (:class:`InstalledDigests`); one
    whose stat is unchanged stands for the file's content, as a lookup's stat check does."""
    st = os.stat(path)
    stamp = stat_key(st)
    found = (known or {}).get(path)
    if isinstance(found, list) and len(found) == 2 and found[0] == stamp and isinstance(found[1], str):
        return [stamp, found[1]]
    state = [stamp, _file_digest(path)]
    if known is not None and max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - RACY_NS:
        known[path] = state  # only once its stat is past the racy window: a later edit in that tick would keep it
    return state


class InstalledDigests:
    """The installed files' digests a record read before, under their stats, in ``<default cache>/toolchain-installed.json``
    (lowercache's own memo: never an input): making a record reads only the files that moved since (about 1,300 files
    otherwise, 0.1-0.2 s per record). Any fault means reading them again."""

    def __init__(self) -> None:
        from ..config import default_cache_dir

        self.path = default_cache_dir() / "toolchain-installed.json"
        try:
            loaded = json.loads(self.path.read_text())
            self.known: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def state(self, path: str) -> list[Any]:
        """:func:`installed_state`, from the memo while the file's stat stands."""
        before = self.known.get(path)
        found = installed_state(path, self.known)
        self.changed = self.changed or self.known.get(path) is not before
        return found

    def save(self) -> None:
        """Written atomically when it changed; concurrent writers each keep what they found (the last one's file stays)."""
        if not self.changed:
            return
        from ..cache.toolchain import write_memo

        self.known = {path: found for path, found in self.known.items() if os.path.exists(path)}  # gone: old venvs
        write_memo(self.path, self.known)


def same_installed(path: str, recorded: Any) -> bool:
    """Whether an installed module file is as :func:`installed_state` found it: the same stat, else the same bytes.

    No racy-clean rule: installed code is not written while a record is made (an install during the window moves the
    site directory's listing, itself an input)."""
    if not (isinstance(recorded, list) and len(recorded) == 2):
        return False
    try:
        if stat_key(os.stat(path)) == recorded[0]:
            return True
        return _file_digest(path) == recorded[1]
    except OSError:
        return False


def dir_listing(path: str) -> tuple[str, list[str]]:
    """The digest of a directory's entries (name; kind as ``os.scandir`` shows it without a stat; a link's text),
    and the paths of its links: each is an input of its own, since what it points at can change without the directory."""
    found, links = [], []
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_symlink():
                found.append([entry.name, "link", os.readlink(entry.path)])
                links.append(entry.path)
            else:
                kind = "dir" if entry.is_dir(follow_symlinks=False) else "file" if entry.is_file(follow_symlinks=False) else "other"
                found.append([entry.name, kind, ""])
    return digest_json(sorted(found)), sorted(links)


def _listing_digest(path: str) -> str:
    return dir_listing(path)[0]


def _stats(path: str, classify: bool = False) -> tuple[os.stat_result, list[str], os.stat_result | None, bool]:
    """``path``'s lstat, its link chain, the stat of what it resolves to (None: a dangling link), and (``classify``)
    whether it is a device node or a kernel file (:func:`is_system`), itself or at any hop: ``/proc/self/ns/pid`` ends
    outside every mount."""
    lst = os.lstat(path)
    if not stat.S_ISLNK(lst.st_mode):
        return lst, [], lst, classify and is_system(lst)  # not a link: one system call, as before links were inputs
    chain, hops = _hops(path, lst)
    system = classify and (is_system(lst) or any(is_system(h) for h in hops))
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return lst, chain, None, system
    return lst, chain, st, system or (classify and is_system(st))


def path_state(path: str, listing: bool = False, meta: Any = (), hashed: bool = True, lmeta: Any = ()) -> dict[str, Any]:
    """What ``path`` is (file with its content digest, directory, missing; ``system``: a device node or a kernel file,
    no input), the text of each link it resolves through (``link``), and its stat for a later fast check.

    ``meta``/``lmeta``: stat fields a caller observed through ``os.stat``/``os.lstat`` (:func:`stat_meta`), kept to
    compare exactly. ``hashed`` false: a file's digest is left out (None), so only an unchanged stat proves it unchanged.
    """
    try:
        lst, chain, st, system = _stats(path, classify=True)
    except (FileNotFoundError, NotADirectoryError):
        return {"kind": "missing"}
    if system:
        return {"kind": "system"}
    if st is None:
        return {"kind": "missing", "link": chain}
    try:
        if stat.S_ISDIR(st.st_mode):
            state: dict[str, Any] = {"kind": "dir"}
            if listing:
                state["digest"] = _listing_digest(path)
        elif stat.S_ISREG(st.st_mode):
            state = {"kind": "file", "digest": _file_digest(path) if hashed else None}
        else:
            return {"kind": "other"}
    except OSError:
        return {"kind": "other"}  # read by the code, unreadable now: nothing can prove it unchanged
    state["stat"] = stat_key(st)
    if chain:
        state["link"] = chain
    if meta:
        state["meta"] = stat_meta(st, meta)
    if lmeta:
        state["lmeta"] = stat_meta(lst, lmeta)
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
    A link is checked hop by hop, by its text; that costs a path that is no link nothing (its lstat is its stat).
    """
    try:
        lst, chain, st, _ = _stats(path)
    except (FileNotFoundError, NotADirectoryError):
        return recorded.get("kind") == "missing" and not recorded.get("link")
    except OSError:
        return False
    if chain != recorded.get("link", []):
        return False
    if st is None:
        return recorded.get("kind") == "missing"
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
    if kind != recorded.get("kind") or kind == "other":
        return False
    for name, seen in (("meta", st), ("lmeta", lst)):
        meta = recorded.get(name)
        if meta is not None and (not isinstance(meta, dict) or stat_meta(seen, meta) != meta):
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


def relinked(path: str, recorded: dict[str, Any]) -> str:
    """`` (a link to X, was Y)`` when the links ``path`` resolves through differ from the record's, else nothing."""
    try:
        now = link_chain(path, os.lstat(path))
    except OSError:
        now = []
    was = recorded.get("link", [])
    if now == was:
        return ""
    return f" ({_said(now)}, was {_said(was) if isinstance(was, list) else 'unreadable'})"


def _said(chain: list[str]) -> str:
    return f"a link to {' -> '.join(map(str, chain))}" if chain else "no link"


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
