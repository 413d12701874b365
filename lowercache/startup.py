"""What a new interpreter's start-up takes in, and whether a warm process can answer for another one.

A warm server's child runs the client's request in a process that started
long ago, under the server's start-up: its flags (``-O`` sets ``__debug__``),
its hash seed, its environment (all of it but the variables that only say
how output is shown: ``environment.py``; native code may have read any other
while the process started or imported), the ``.pth`` files ``site`` executed
and the import finders they installed, the modules it imported. A child can stand in for the client's own interpreter only when all
of these are the client's too. This module says what they are (:func:`state`,
cheap: no torch) and why a warm process would answer differently
(:func:`why_not`), for ``lower`` and ``verify`` requests and for
``lowercache run``'s commands alike; direct-mode and ``run`` records carry
:func:`state`'s digest, so a record is confirmed and served only under equal
start-up state.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import site
import stat
import sys
import sysconfig
from typing import Any, Iterable

from . import environment
from .cache.digests import digest, digest_json, stat_key

# A server's child sets the thread count itself (server/child.py): a client's own is an input of records (record/trust.py).
SET_BY_CHILD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# ``lowercache run`` puts this directory (its ``sitecustomize``) on a command's PYTHONPATH: it says nothing of the user's.
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run", "_site")
# Flags that say how the interpreter was driven, not how it runs code (``-i``).
_NOT_RUN = ("inspect", "interactive", "n_fields", "n_sequence_fields", "n_unnamed_fields")


def interpreter_args() -> list[str]:
    """The command-line options that give a new interpreter this one's flags, ``-W`` and ``-X`` options (the server's spawn)."""
    import subprocess

    args = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]  (multiprocessing's own)
    given = {a.split("=")[0] for a in args[args.index("-X") + 1::2]} if "-X" in args else set()
    for name, value in sys._xoptions.items():
        if name not in given and name != "dev":
            args += ["-X", name if value is True else f"{name}={value}"]
    return args


def without_dir(pythonpath: str | None, directory: str) -> str | None:
    """``PYTHONPATH`` without ``directory`` (``lowercache run``'s hook) and empty entries, None when nothing is left."""
    if pythonpath is None:
        return None
    kept = [p for p in pythonpath.split(os.pathsep) if p and os.path.abspath(p) != os.path.abspath(directory)]
    return os.pathsep.join(kept) or None


def variables(environ: dict[str, str] | Any) -> dict[str, str]:
    """The variables of ``environ`` a process takes in: all but those that only say how output is shown
    (``environment.py``) and the thread counts a server's child sets, PYTHONPATH without the hook directory."""
    found = {name: value for name, value in environment.inputs(environ).items() if name not in SET_BY_CHILD}
    if "PYTHONPATH" in found:
        kept = without_dir(found.pop("PYTHONPATH"), HOOK_DIR)
        if kept is not None:
            found["PYTHONPATH"] = kept
    return found


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def site_files() -> list[list[Any]]:
    """The files ``site`` runs or that install import hooks: ``.pth`` files, editable finders, top-level modules.

    Each is named with its content's digest: ``pip install -e`` of another
    checkout rewrites ``__editable___*_finder.py`` with the same name, which
    the site-packages listing alone cannot see; and ``pip install -e .`` again
    (the quick start's first command, run twice) rewrites the same content,
    which a stat would take for a change of what runs.
    """
    found = []
    for directory in _site_dirs():
        try:
            entries = sorted(os.listdir(directory))
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith((".pth", ".py")) and not entry.startswith("__editable__"):
                continue
            path = os.path.join(directory, entry)
            try:
                regular = stat.S_ISREG(os.stat(path).st_mode)
            except OSError:
                continue
            content = file_digest(path) if regular else None
            if content is not None:
                found.append([directory, entry, content])
    return found


def top_level_site_file(path: str) -> bool:
    """Whether ``path`` lies directly in a site-packages directory (an editable finder, a one-file module): a file
    ``pip install -e .`` rewrites on every run, with the same bytes when nothing changed, so it is named by content."""
    return os.path.dirname(os.path.normpath(path)) in _site_dir_set()


@functools.lru_cache(maxsize=1)
def _site_dir_set() -> frozenset[str]:
    """The site directories, once: a server asks of each of thousands of imported files before every request."""
    return frozenset(os.path.normpath(d) for d in _site_dirs())


CUSTOMIZE = ("sitecustomize", "usercustomize")


def _pth_paths(directory: str, text: str) -> list[str]:
    """The directories a ``.pth`` file's path lines add to the search path, as ``site.addpackage`` adds them."""
    found = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or line.startswith(("import ", "import\t")):
            continue
        path = os.path.abspath(os.path.join(directory, line.rstrip()))
        if os.path.exists(path):
            found.append(path)
    return found


def _module_file(directory: str, name: str) -> str | None:
    """The file ``name`` is imported from in ``directory``, in the order the import system's file finder tries them."""
    package = os.path.join(directory, name, "__init__.py")
    if os.path.isfile(package):
        return package
    for suffix in (*importlib.machinery.EXTENSION_SUFFIXES, *importlib.machinery.SOURCE_SUFFIXES,
                   *importlib.machinery.BYTECODE_SUFFIXES):
        path = os.path.join(directory, name + suffix)
        if os.path.isfile(path):
            return path
    return None


def file_digest(path: str) -> str | None:
    """The digest of a file's content, None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return digest(f.read())
    except OSError:
        return None


def _stdlib_path() -> list[str]:
    """The standard library's entries of the search path (its zip, its directory, lib-dynload), as the interpreter set them."""
    bases = tuple(os.path.join(os.path.normpath(b), "") for b in {sys.base_prefix, sys.base_exec_prefix})
    sites = {os.path.normpath(d) for d in _site_dirs()}
    return [p for p in sys.path if p and os.path.isabs(p) and p.startswith(bases) and os.path.normpath(p) not in sites]


def start_code(environ: dict[str, str] | Any) -> list[list[Any]]:
    """The code a new interpreter under ``environ`` runs before the user's first line, with its content digests.

    ``site`` runs every ``import`` line of each ``.pth`` file, then imports
    ``sitecustomize`` and ``usercustomize`` from the first directory of the
    start-up search path that has them (``PYTHONPATH`` first; not the script's
    directory, which is added later). That happens before any audit hook can
    listen, so it is enumerated: each ``.pth`` file's content, the file each
    customize module resolves to (or none), and every module outside the
    standard library that the start-up had imported when lowercache first ran
    (what that code imported; site-packages' packages by stat, the rest by content).
    """
    if sys.flags.no_site:
        return []
    found: list[list[Any]] = []
    tail: list[str] = []
    for directory in _site_dirs():
        tail.append(directory)
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            found.append(["pth", directory, name, digest(data)])
            tail += _pth_paths(directory, data.decode("utf-8", "replace"))
    pythonpath = None if sys.flags.ignore_environment else without_dir(environ.get("PYTHONPATH"), HOOK_DIR)
    search = [*(os.path.abspath(p) for p in (pythonpath.split(os.pathsep) if pythonpath else [])), *_stdlib_path(), *tail]
    for name in CUSTOMIZE if site.ENABLE_USER_SITE else CUSTOMIZE[:1]:
        origin = next((f for f in (_module_file(d, name) for d in search) if f is not None), None)
        found.append(["customize", name, origin, file_digest(origin) if origin else None])
    return found + _started_with()


def _started_with() -> list[list[Any]]:
    """The modules outside the standard library that were imported before lowercache first ran (``lowercache.STARTED_WITH``)."""
    started_with = getattr(sys.modules.get(__name__.partition(".")[0]), "STARTED_WITH", ())  # the package's own snapshot

    stdlib = tuple(os.path.join(os.path.normpath(sysconfig.get_paths()[k]), "") for k in ("stdlib", "platstdlib"))
    sites = tuple(os.path.join(os.path.normpath(d), "") for d in _site_dirs())
    found = []
    for name in sorted(started_with):
        origin = getattr(sys.modules.get(name), "__file__", None)
        if name == "__main__" or name.split(".")[0] == "lowercache" or not isinstance(origin, str) or not os.path.isabs(origin):
            continue  # the program being run, and lowercache's own sources (in every identity by their digest)
        if top_level_site_file(origin):
            found.append(["module", name, origin, file_digest(origin)])
        elif origin.startswith(sites):  # first: a venv's site-packages is inside its platstdlib
            try:
                found.append(["module", name, origin, *stat_key(os.stat(origin))])
            except OSError:
                found.append(["module", name, origin, None])
        elif not origin.startswith(stdlib):
            found.append(["module", name, origin, file_digest(origin)])
    return found


def state(environ: dict[str, str] | Any = None) -> dict[str, Any]:
    """The interpreter's start-up state: what two processes must share to run the same code to the same result.

    Values of variables are kept as digests (an environment holds secrets, and
    records travel to the remote). The interpreter is named by its prefix and
    resolved path, so ``python`` and ``python3.11`` of one environment are one.
    """
    environ = os.environ if environ is None else environ
    return {
        "interpreter": [sys.prefix, sys.exec_prefix, os.path.realpath(sys.executable), sys.version],
        "flags": {name: getattr(sys.flags, name) for name in dir(sys.flags) if not name.startswith("_") and name not in _NOT_RUN
                  and isinstance(getattr(sys.flags, name), int)},
        "options": [list(sys.warnoptions), sorted(f"{k}={v}" for k, v in sys._xoptions.items())],
        "variables": {name: digest(value.encode("utf-8", "surrogateescape")) for name, value in sorted(variables(environ).items())},
        "site": digest_json(site_files()),
        "code": digest_json(start_code(environ)),
    }


def changed(old: dict[str, Any] | Any, new: dict[str, Any], whose: str) -> str | None:
    """What differs between two start-up states, in a user's words (``old`` is ``whose``), or None."""
    if old == new:
        return None
    if not isinstance(old, dict):
        return "the interpreter's start-up state is unknown"
    for part, label in (("interpreter", "the Python interpreter differs"), ("flags", "the interpreter's flags (-O, -B, ...) differ"),
                        ("options", "the interpreter's -W or -X options differ"),
                        ("site", "site-packages' .pth files or import finders differ"),
                        ("code", "the code the interpreter runs at start (.pth lines, sitecustomize, usercustomize) differs")):
        if old.get(part) != new.get(part):
            return f"{label} from {whose}"
    ours, theirs = old.get("variables") or {}, new.get("variables") or {}
    names = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
    return f"environment variable {names[0]} differs from {whose}" if names else f"the start-up state differs from {whose}"


def module_name(directory: str, entry: str) -> str | None:
    """The top-level module name ``entry`` of a search-path directory provides (a package, a namespace, a source or extension file)."""
    for suffix in importlib.machinery.all_suffixes():
        if entry.endswith(suffix) and len(entry) > len(suffix):
            return entry[: -len(suffix)]
    return entry if "." not in entry and os.path.isdir(os.path.join(directory, entry)) else None


def found_in(modules: dict[str, Any], looked_up: Iterable[str]) -> dict[str, list[str]]:
    """Top-level module names, each with the search-path directories its module came from (none: looked up, not found)."""
    found: dict[str, set[str]] = {name.split(".")[0]: set() for name in looked_up}
    for name, module in modules.items():
        if "." in name or module is None:
            continue
        places = list(getattr(module, "__path__", None) or [])  # a package's directories: their parent is the entry
        origin = getattr(module, "__file__", None)
        dirs = {os.path.dirname(os.path.normpath(p)) for p in places if isinstance(p, str)}
        if isinstance(origin, str) and not places:
            dirs.add(os.path.dirname(os.path.normpath(origin)))
        found.setdefault(name, set()).update(dirs)
    return {name: sorted(dirs) for name, dirs in found.items()}


def shadowed(directories: Iterable[str], cwd: str, imported: dict[str, list[str]]) -> str | None:
    """A file in ``directories`` (in search order) that a new interpreter would import in place of a module the warm one
    imported or looked for; None when there is none."""
    seen: set[str] = set()
    for directory in directories:
        directory = os.path.normpath(os.path.join(cwd, directory or "."))
        if directory in seen:
            continue
        seen.add(directory)
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for entry in sorted(entries):
            name = module_name(directory, entry)
            if name in imported and directory not in imported[name]:
                return os.path.join(directory, entry)
    return None


def why_not(env: dict[str, str], start_env: dict[str, str], path: Iterable[str], cwd: str,
            imported: dict[str, list[str]]) -> str | None:
    """Why a warm process that started with ``start_env`` would answer a request from ``env`` differently; None if it would not.

    Any variable that is an input (:func:`variables`: native code may have
    read it while the warm process imported) must be the same; ``path``: the
    directories the request's interpreter searches for modules, in order;
    ``imported``: the top-level names the warm process imported or looked
    for, with the directories each came from (:func:`found_in`).
    """
    ours, theirs = variables(env), variables(start_env)
    differ = sorted(name for name in {*ours, *theirs} if ours.get(name) != theirs.get(name))
    if differ:
        return f"environment variable {differ[0]} differs from the server's"
    shadow = shadowed(path, cwd, imported)
    if shadow is not None:
        return f"{shadow} would shadow a module the server imported"
    return None
