"""When a record may answer: the identity it was made under, the one confirm rule, and what became of it.

Shared by direct mode's ``lower`` records and ``lowercache run``'s command
records. A record answers only when the interpreter, machine, toolchain and
settings (:func:`identity`) and every recorded input are as they were, and
only once confirmed: a re-run with identical inputs produced the same result
(:func:`verdict`). What a lookup found and what a record became is kept for
``explain`` (:func:`put_status`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .. import startup
from ..cache.digests import digest, digest_json
from ..cache.toolchain import toolchain_parts
from ..config import Settings
from .places import Places, entries, named, relinked, same_installed, same_state

R = TypeVar("R")
# Variables native code reads at start-up (threads, CPU kernels, hash seed): recorded for every factory.
NATIVE_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ATEN_CPU_CAPABILITY", "PYTHONHASHSEED")


def _cpu_digest() -> str:
    """The CPU's feature flags: torch picks its kernels (and so some float results) by them."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return digest(b" ".join(sorted(line.split(b":", 1)[1].split())))
    except OSError:
        pass
    return ""


def env_digest(value: str | None) -> str | None:
    """Values are kept as digests: an environment holds secrets, and records travel to the remote."""
    return None if value is None else digest(value.encode("utf-8", "surrogateescape"))


def identity(settings: Settings, environ: dict[str, str] | Any) -> dict[str, Any]:
    """What the result depends on besides the factory's inputs: interpreter and its start-up, machine, toolchain, settings."""
    return {
        "python": sys.version,
        "cache_tag": sys.implementation.cache_tag,
        "machine": os.uname().machine,
        "cpu": _cpu_digest(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "toolchain": toolchain_parts(),
        "speedups": settings.speedups,
        "native_env": {name: env_digest(environ.get(name)) for name in NATIVE_ENV},
        "startup": startup.state(environ),
    }


def identity_changed(recorded: Any, now: dict[str, Any]) -> str | None:
    """Which parts of the interpreter, machine, toolchain and settings identity differ, or None."""
    if recorded == now:
        return None
    recorded = recorded if isinstance(recorded, dict) else {}
    if recorded.get("startup") != now.get("startup"):
        return startup.changed(recorded.get("startup"), now["startup"], "the record's")
    parts = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    return f"the {', '.join(parts)} changed"


def inputs_changed(inputs: dict[str, Any], places: Places, recorded_ns: int, cwd: str, environ: dict[str, str] | Any) -> str | None:
    """What differs between recorded inputs (variables, files, listings, module lookups) and now, or None.

    Shared by ``lower``'s records and ``lowercache run``'s command records (``run/replay.py``).
    """
    for name, value in inputs["env"].items():
        if name == "<listed>":
            if value != digest_json(sorted(environ)):
                return "the environment's variables changed (the factory listed them)"
        elif env_digest(environ.get(name)) != value:
            return f"environment variable {name} changed"
    for ref, state in inputs["files"]:
        path = places.path(ref)
        if not same_state(path, state, recorded_ns):
            return f"{os.path.relpath(path, cwd) if ref[0] == 'root' else path} changed{relinked(path, state)}"
    for ref, state in inputs["listings"]:
        if not same_state(places.path(ref), state, recorded_ns, listing=True):
            return f"directory {places.path(ref)} changed"
    for ref, name, found in inputs["lookups"]:
        if named(entries(places.path(ref)), name) != found:
            return f"what module {name} resolves to changed"
    for ref, *state in inputs["installed"]:
        path = places.path(ref)
        if not same_installed(path, state):
            return f"installed code changed: {path}"
    return None


def roots(location: dict[str, Any]) -> list[str]:
    """The project roots where the record's inputs gave its result (the one it was made in, when it says no more)."""
    found = location.get("roots")
    if isinstance(found, list) and all(isinstance(r, str) for r in found):
        return sorted({location["root"], *found})
    return [location["root"]]


def elsewhere(location: dict[str, Any], root: str, opted_in: bool, words: "Words") -> str | None:
    """Why a record made at ``location`` cannot answer in project ``root``, or None when it can.

    In the directory it was made in (or confirmed in), always. Elsewhere only once the same inputs gave the same
    result from a second directory, since no list of names covers every way code learns where it is
    (``find_spec(__name__).origin``, ``inspect.getfile``, a traceback); or when the user vouches for it
    (``portable_records``) and no source of the user's names its place. Never once the same inputs gave another
    result in another directory.
    """
    made = roots(location)
    if root in made:
        return None
    head = f"the project is in another directory than the record's ({location['root']}), and"
    if location.get("bound"):
        return f"{head} the same inputs {words.elsewhere}"
    if len(made) >= 2 or (opted_in and not location["why"]):
        return None
    because = f" ({location['why']})" if location["why"] else ""
    return f"{head} the record is confirmed in no second directory yet{because}"


def check_inputs(inputs: Any) -> None:
    """Recorded inputs read from a store, checked field by field (``ValueError`` when malformed)."""
    if not (
        isinstance(inputs, dict)
        and all(isinstance(inputs.get(k), list) for k in ("files", "listings", "lookups", "syspath", "installed"))
        and isinstance(inputs.get("env"), dict)
        and isinstance(inputs.get("location"), dict)
        and isinstance(inputs["location"].get("root"), str)
        and isinstance(inputs["location"].get("portable"), bool)
        and isinstance(inputs["location"].get("why"), str)
        and all(isinstance(s, list) and len(s) == 2 and isinstance(s[1], dict) for s in inputs["files"] + inputs["listings"])
        and all(isinstance(s, list) and len(s) == 3 and isinstance(s[1], str) and isinstance(s[2], list) for s in inputs["lookups"])
        and all(isinstance(s, list) and len(s) == 3 and isinstance(s[1], list) and isinstance(s[2], str) for s in inputs["installed"])
    ):
        raise ValueError("the record is malformed")


@dataclass(frozen=True)
class Words:
    """How a kind of record says its rule: who ran, and what "the same result" is."""

    who: str  # "the factory", "the command"
    same: str  # "gives the same flow key"
    gave_same: str  # "gave the same flow key"
    differed: str  # why identical inputs that gave another result are untrusted for good
    elsewhere: str  # "lowered differently in another directory": the result depends on where the project is


@dataclass(frozen=True)
class Verdict:
    """``untrusted`` (never used), ``unconfirmed`` (waits for a re-run with the same inputs) or ``confirmed`` (used)."""

    status: str
    reason: str
    for_good: bool = False
    roots: tuple[str, ...] = ()  # the project roots where these inputs gave this result (none: the record's own)
    bound: bool = False  # the same inputs gave another result in another directory

    def stamp(self, record: dict[str, Any]) -> None:
        """Write the verdict into the record about to be stored, and where it may answer (:func:`elsewhere`)."""
        record["status"], record["reason"] = self.status, self.reason
        if self.for_good:
            record["for_good"] = True
        location = record["inputs"]["location"]
        location["roots"] = sorted({location["root"], *self.roots})
        location["bound"] = self.bound
        location["portable"] = len(location["roots"]) >= 2 and not self.bound


def verdict(previous: dict[str, Any] | None, changed: Callable[[dict[str, Any]], str | None], refused: list[str],
            same_result: Callable[[dict[str, Any]], bool], words: Words, root: str) -> Verdict:
    """The one confirm rule, for every kind of record: a record is used only once a re-run with the same inputs gave the same result.

    ``previous``: the record this run replaces, if any; ``changed(previous)``:
    what differs between its inputs and this run's, judged as a lookup judges
    it (so a run that merely touched other paths, say a bytecode file it wrote
    the first time, still confirms), or None; a malformed previous record
    raises and confirms nothing. ``refused``: what this run did that no record
    can capture. ``same_result(previous)``: whether it produced what this run did.
    ``root``: this run's project root. A previous record made in another directory
    confirms as well (its inputs compared relative to the root), and then the record
    answers in any directory; another result there binds the record to its place.
    """
    if previous is not None and previous.get("status") == "untrusted" and previous.get("for_good"):
        return Verdict("untrusted", str(previous.get("reason", "untrusted")), for_good=True)
    if refused:
        return Verdict("untrusted", f"{words.who} {refused[0]}")
    since = None
    if previous is not None:
        try:
            since = changed(previous)
        except (ValueError, KeyError, TypeError):
            previous = None
    if previous is None or previous.get("status") == "untrusted" or since is not None:
        note = f" ({since} since the previous record)" if since else ""
        return Verdict("unconfirmed", f"recorded{note}; used once a re-run with the same inputs {words.same}")
    assert previous is not None
    was = previous["inputs"]["location"]
    moved = root not in roots(was)
    if not same_result(previous):
        if moved:
            return Verdict("unconfirmed", f"recorded; the same inputs {words.elsewhere} ({was['root']}), so it answers only "
                                          f"where it was made, once a re-run there {words.same}", bound=True)
        return Verdict("untrusted", words.differed, for_good=True)
    there = f", in another directory ({was['root']}) too" if moved else ""
    return Verdict("confirmed", f"a re-run with the same inputs {words.gave_same}{there}", roots=tuple(roots(was)),
                   bound=bool(was.get("bound")))


# Earlier confirmed records a command keeps besides its latest one, as ccache's manifest keeps several results: going
# back to inputs seen before (an edit undone, another branch checked out) is answered without running anything again.
KEPT_EARLIER = 4


def judged_once(changed: Callable[[dict[str, Any]], str | None]) -> Callable[[dict[str, Any]], str | None]:
    """``changed`` answering once per record: :func:`verdict` and :func:`kept_earlier` both ask it of the replaced
    record, and each answer is a stat pass over every input that record names. A record that raises is asked again."""
    since: dict[int, str | None] = {}

    def once(previous: dict[str, Any]) -> str | None:
        if id(previous) not in since:
            since[id(previous)] = changed(previous)
        return since[id(previous)]

    return once


def kept_earlier(old: dict[str, Any] | None, record: dict[str, Any], result_of: Callable[[dict[str, Any]], str],
                 changed: Callable[[dict[str, Any]], str | None], keep: Callable[[str, dict[str, Any]], None]) -> list[str]:
    """The results of the earlier records the new ``record`` keeps, newest first (its ``earlier`` list).

    ``old``: the record it replaces; kept (``keep(result, old_without_its_list)``
    stores it under its result) when it was confirmed for other inputs and
    another result, then followed by the ones it kept. None once ``record`` is
    untrusted: its run did what no record sees, which an earlier record may not
    have shown. ``result_of(record)``: what names a record's result (direct
    mode: the flow key; ``run``: its outputs' digest). ``changed``: as
    :func:`verdict`'s.
    """
    if old is None or record["status"] == "untrusted":
        return []
    try:
        replaced = result_of(old)
        moved = old.get("status") == "confirmed" and replaced != result_of(record) and changed(old) is not None
    except (ValueError, KeyError, TypeError):
        return []
    kept = [k for k in earlier(old) if k != result_of(record)]
    if moved:
        keep(replaced, {k: v for k, v in old.items() if k != "earlier"})
        kept = [replaced, *(k for k in kept if k != replaced)]
    return kept[:KEPT_EARLIER]


def earlier(record: dict[str, Any]) -> list[str]:
    """The results of the earlier records ``record`` names, newest first (read from a store: checked)."""
    found = record.get("earlier")
    if not isinstance(found, list):
        return []
    return [k for k in found[:KEPT_EARLIER] if isinstance(k, str)]


def from_earlier(latest: dict[str, Any], load: Callable[[str], R | None], why_not: Callable[[R], str | None]) -> tuple[R | None, str]:
    """The newest earlier record ``latest`` names that can answer (``why_not`` None), and ""; else None and what a
    lookup adds to the latest record's reason about them, for ``explain``. ``load(result)``: the record kept under
    that result, or None when it is missing or names another result."""
    whys: list[str | None] = []
    for result in earlier(latest):
        found = load(result)
        whys.append("missing or malformed" if found is None else why_not(found))
        if whys[-1] is None:
            return found, ""
    return None, earlier_said(whys)


def earlier_said(whys: list[str | None]) -> str:
    """What a lookup adds to the latest record's reason about the earlier ones it tried, for ``explain``."""
    if not whys:
        return ""
    return f"; {len(whys)} earlier record{'s' if len(whys) > 1 else ''} did not answer either (the newest: {whys[0]})"


def put_status(store: Any, name: str, outcome: str, reason: str) -> None:
    """Remember what a lookup found or a record became, for ``explain`` (``lowercache run``'s records too)."""
    if getattr(store, "writable", False):
        store.put_record(name, {"time": time.time(), "outcome": outcome, "reason": reason})


def status_lines(store: Any, name: Callable[[str], str], prefix: str = "") -> list[str]:
    """The remembered lookup and record outcomes (``name("lookup")``, ``name("record")``), one line each."""
    lines = []
    for which, label in (("lookup", "latest lookup"), ("process", "latest run"), ("record", "latest record")):
        status = store.get_record(name(which))
        if isinstance(status, dict):
            lines.append(f"{prefix}{label}: {status.get('outcome')}: {status.get('reason')}")
    return lines


# What no record sees, said by ``explain`` (docs/direct-mode.md, Limits).
UNSEEN = ("cannot see: what another process reads for the code, a file read through a descriptor opened before the "
          "recording began; the stat of an entry only a library listed; access times")
