"""What ``fork`` carries from the warm server into a request's child, and how the child takes the client's instead.

A child forked from the server inherits the server's process state, not the
client's: its umask, CPU set, resource limits, nice value and scheduling
policy, locale, time zone, ignored and blocked signals, cgroup, user and
groups, capabilities and namespaces. A new process started by the client (or
the client itself, for ``lower``) would have the client's. So the client
sends its own (:func:`capture`, cheap: no torch, no ctypes), and the child
takes each one it can and then checks that it holds (:func:`adopt`); for any
it cannot (raising a hard limit or the priority without privilege, another
namespace), :class:`Unadoptable` says which, and the request is declined:
the client runs it itself. See docs/server.md.
"""

from __future__ import annotations

import _locale
import os
import resource
import signal
import time
from typing import Any

# Each resource limit by name; a child takes the client's (raising a hard limit needs privilege).
RLIMITS = {name: getattr(resource, name) for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
# The main thread's stack was laid out at the server's exec by its own limit: a child cannot take another one.
_FIXED_AT_EXEC = ("RLIMIT_STACK",)
LOCALE_CATEGORIES = ("LC_CTYPE", "LC_COLLATE", "LC_TIME", "LC_NUMERIC", "LC_MONETARY", "LC_MESSAGES")
# Namespaces a process is in: a child in the server's would see another file system, network or process tree.
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")
# /proc/self/status lines no unprivileged child can change: credentials and confinement.
_FIXED_STATUS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
_DAY = 86400


class Unadoptable(Exception):
    """The child cannot take this part of the client's process state: the request is declined."""


def _status() -> dict[str, str]:
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                found[name] = " ".join(value.split())
    except OSError:
        pass
    return found


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _namespaces() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in NAMESPACES:
        try:
            found[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            found[name] = None
    return found


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def time_zone(instants: list[int]) -> list[Any]:
    """What the C library's time zone makes of ``instants``: names, offsets, and each instant's local offset and zone."""
    return [list(time.tzname), time.timezone, time.altzone, time.daylight,
            [[t, time.localtime(t).tm_gmtoff, time.localtime(t).tm_zone] for t in instants]]


def capture() -> dict[str, Any]:
    """This process's state that a forked child would otherwise take from the server (JSON-ready)."""
    status = _status()
    now = int(time.time()) // _DAY * _DAY
    return {
        "umask": _umask(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "rlimits": {name: list(resource.getrlimit(number)) for name, number in RLIMITS.items()},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "sched": [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority],
        "locale": {name: _locale.setlocale(getattr(_locale, name)) for name in LOCALE_CATEGORIES},
        "tz": time_zone([0, now, now + 182 * _DAY]),
        "signals": {"ignored": status.get("SigIgn", ""), "blocked": status.get("SigBlk", "")},
        "fixed": {name: status.get(name) for name in _FIXED_STATUS},
        "namespaces": _namespaces(),
        "root": list(_root()),
        "personality": _read("/proc/self/personality"),
        "cgroup": _read("/proc/self/cgroup"),
    }


def _root() -> tuple[int, int]:
    st = os.stat("/")
    return st.st_dev, st.st_ino


def check(value: Any) -> str | None:
    """Why ``value`` is not a :func:`capture` a server takes (a request field is checked before any of it is used), or None."""
    if not isinstance(value, dict) or set(value) != set(_FIELDS):
        return "an object with the client's process state"
    for name, valid in _FIELDS.items():
        if not valid(value[name]):
            return f"an object with the client's process state (bad {name!r})"
    return None


def _ints(value: Any, count: int | None = None) -> bool:
    return (isinstance(value, list) and (count is None or len(value) == count) and len(value) <= 4096
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


def _text_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and "\0" not in value and len(value) <= 1 << 16)


def _texts(value: Any, names: tuple[str, ...]) -> bool:
    return isinstance(value, dict) and set(value) == set(names) and all(_text_or_none(v) for v in value.values())


def _tz(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 5 and isinstance(value[0], list) and len(value[0]) == 2
            and all(isinstance(v, str) for v in value[0]) and _ints(value[1:4])
            and isinstance(value[4], list) and len(value[4]) == 3
            and all(isinstance(v, list) and len(v) == 3 and _ints(v[:2]) and isinstance(v[2], str) for v in value[4]))


_FIELDS: dict[str, Any] = {
    "umask": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0o777,
    "cpus": lambda v: _ints(v) and all(0 <= c < 1 << 16 for c in v),
    "rlimits": lambda v: isinstance(v, dict) and set(v) == set(RLIMITS) and all(_ints(x, 2) for x in v.values()),
    "nice": lambda v: isinstance(v, int) and not isinstance(v, bool) and -20 <= v <= 19,
    "sched": lambda v: _ints(v, 2),
    "locale": lambda v: _texts(v, LOCALE_CATEGORIES),
    "tz": _tz,
    "signals": lambda v: _texts(v, ("ignored", "blocked")),
    "fixed": lambda v: _texts(v, _FIXED_STATUS),
    "namespaces": lambda v: _texts(v, NAMESPACES),
    "root": lambda v: _ints(v, 2),
    "personality": _text_or_none,
    "cgroup": _text_or_none,
}


def _mask(text: str) -> set[int]:
    """The signal numbers of a /proc status mask (hex, bit 0 is signal 1)."""
    try:
        bits = int(text, 16)
    except ValueError:
        return set()
    return {n + 1 for n in range(bits.bit_length()) if bits >> n & 1}


def _signals(wanted: dict[str, str]) -> None:
    """The client's ignored signals ignored, the rest as the interpreter starts them, and the client's blocked ones blocked."""
    ignored, now = _mask(wanted["ignored"]), _mask(_status().get("SigIgn", ""))
    for number in sorted(ignored ^ now):
        if number in ignored:
            handler: Any = signal.SIG_IGN
        elif number == signal.SIGINT:
            handler = signal.default_int_handler
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(number, handler)
        except (OSError, ValueError) as e:
            raise Unadoptable(f"signal {number}'s disposition ({e})") from None
    signal.pthread_sigmask(signal.SIG_SETMASK, _mask(wanted["blocked"]))
    found = _status()
    if _mask(found.get("SigIgn", "")) != ignored or _mask(found.get("SigBlk", "")) != _mask(wanted["blocked"]):
        raise Unadoptable("the ignored or blocked signals")


def _rlimits(wanted: dict[str, list[int]]) -> None:
    for name, number in RLIMITS.items():
        limits = tuple(wanted[name])
        if resource.getrlimit(number) == limits:
            continue
        if name in _FIXED_AT_EXEC:
            raise Unadoptable(f"resource limit {name} (the server started under another)")
        try:
            resource.setrlimit(number, limits)
        except (OSError, ValueError) as e:
            raise Unadoptable(f"resource limit {name} ({e})") from None
        if resource.getrlimit(number) != limits:
            raise Unadoptable(f"resource limit {name}")


def _priority(nice: int, sched: list[int]) -> None:
    policy, priority = sched
    try:
        if [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority] != sched:
            os.sched_setscheduler(0, policy, os.sched_param(priority))
        if os.getpriority(os.PRIO_PROCESS, 0) != nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        raise Unadoptable(f"the scheduling priority (nice {nice}: {e.strerror})") from None
    if os.getpriority(os.PRIO_PROCESS, 0) != nice or os.sched_getscheduler(0) != policy:
        raise Unadoptable(f"the scheduling priority (nice {nice})")


def _cgroup_mounts() -> dict[str, str]:
    """Each cgroup hierarchy's name as /proc/self/cgroup names it (``""`` for cgroup2) -> where it is mounted."""
    mounts: dict[str, str] = {}
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            mounts.setdefault("", fields[4])
        elif tail[0] == "cgroup":
            options = tail[2].split(",")
            names = [o for o in options if o.startswith("name=")] or sorted(
                o for o in options if o not in ("rw", "ro", "nosuid", "nodev", "noexec", "relatime", "clone_children")
                and "=" not in o)
            mounts.setdefault(",".join(names), fields[4])
    return mounts


def _cgroup(wanted: str | None) -> None:
    """Move this process into the client's cgroups (a new process would run, and be limited, there)."""
    if wanted is None or _read("/proc/self/cgroup") == wanted:
        return
    mounts = _cgroup_mounts()
    ours = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in (_read("/proc/self/cgroup") or "").splitlines() if line.count(":") >= 2}
    for line in wanted.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or ours.get(parts[1]) == parts[2]:
            continue
        mount = mounts.get(",".join(sorted(parts[1].split(","))) if not parts[1].startswith("name=") else parts[1])
        if mount is None or ".." in parts[2].split("/"):
            raise Unadoptable(f"the cgroup {parts[2]}")
        try:
            with open(os.path.join(mount, parts[2].lstrip("/"), "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            raise Unadoptable(f"the cgroup {parts[2]} ({e.strerror})") from None
    if _read("/proc/self/cgroup") != wanted:
        raise Unadoptable("the cgroups")


def _locale_and_time(wanted_locale: dict[str, str | None], tz: list[Any]) -> None:
    for name, value in wanted_locale.items():
        category = getattr(_locale, name)
        try:
            if value is not None and _locale.setlocale(category) != value:
                _locale.setlocale(category, value)
        except _locale.Error:
            raise Unadoptable(f"the locale ({name}={value})") from None
        if _locale.setlocale(category) != value:
            raise Unadoptable(f"the locale ({name}={value})")
    time.tzset()  # after the client's TZ is in the environment: the C library and the time module read it again
    if time_zone([at[0] for at in tz[4]]) != tz:
        raise Unadoptable(f"the time zone ({tz[0][0]})")


def adopt(wanted: dict[str, Any]) -> None:
    """Take the client's process state ``wanted`` (a checked :func:`capture`), with its environment already in place.

    Raises :class:`Unadoptable` naming the first part that cannot be taken or
    does not hold afterwards. Call in a single-threaded child: affinity, the
    signal mask and the priority are per thread, and threads started later
    inherit them.
    """
    fixed = {name: value for name, value in _status().items() if name in _FIXED_STATUS}
    for name in _FIXED_STATUS:
        if fixed.get(name) != wanted["fixed"][name]:
            raise Unadoptable(f"the user, groups, capabilities or confinement ({name})")
    ours = _namespaces()
    for name in NAMESPACES:
        if ours[name] != wanted["namespaces"][name]:
            raise Unadoptable(f"the {name} namespace")
    if list(_root()) != wanted["root"]:
        raise Unadoptable("the root directory")
    if _read("/proc/self/personality") != wanted["personality"]:
        raise Unadoptable("the execution domain (setarch)")
    _cgroup(wanted["cgroup"])
    os.umask(wanted["umask"])
    try:
        os.sched_setaffinity(0, wanted["cpus"])
    except OSError as e:
        raise Unadoptable(f"the CPU set ({e.strerror})") from None
    if sorted(os.sched_getaffinity(0)) != wanted["cpus"]:
        raise Unadoptable("the CPU set")
    _rlimits(wanted["rlimits"])
    _priority(wanted["nice"], wanted["sched"])
    _locale_and_time(wanted["locale"], wanted["tz"])
    _signals(wanted["signals"])
    if _umask() != wanted["umask"]:
        raise Unadoptable("the umask")


def thread_default(server_threads: int, server_cpus: int, client_cpus: int) -> int:
    """torch's default thread count in a new process on ``client_cpus`` CPUs, from the server's on ``server_cpus``.

    torch's OpenMP default is the number of CPUs the process may run on; where
    the server's default was not that, only an equal CPU count says it.
    """
    if client_cpus == server_cpus:
        return server_threads
    if server_threads == server_cpus:
        return client_cpus
    raise Unadoptable(f"torch's default thread count on {client_cpus} CPUs")
