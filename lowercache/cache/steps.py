"""Build steps: pure functions of named key parts, served from the store.

A step declares its inputs as *named parts* (digests or short strings); its
key is the digest of those parts and its kind. The parts are recorded with
the outcome, so ``lowercache explain`` can say which part changed (Bazel's
action keys, ccache's debug mode). The output digest is recorded too: a later
step that takes this output as a part gets the same key whenever the output is
the same, however it was produced (early cutoff, as in Salsa and Skyframe).

Outcomes:
- ``hit``: served from the store, the step's code did not run;
- ``miss``: ran and was stored;
- ``skip``: nothing to do (used by steps that can prove they do not apply);
- ``bypass``: ran uncached, because the step could not be keyed safely or
  asked for side effects (debug dumps) that a hit would not reproduce.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterator, Protocol

from .digests import digest_json
from .store import Entry, Store

log = logging.getLogger("lowercache")


@dataclass
class StepRecord:
    """What happened to one step in one run."""

    kind: str
    name: str
    outcome: str
    key: str = ""
    parts: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    saved: float = 0.0
    output: str = ""
    note: str = ""
    tier: str = ""  # for hits: "local", "remote", "memory" (seen earlier this run) or "run ahead" (run/ahead.py)
    nodes: dict[str, int] = field(default_factory=dict)  # passes: nodes retraced / copied by their retrace

    def to_json(self) -> dict[str, Any]:
        """The record as ``dataclasses.asdict`` gives it. A lowering has hundreds of records, and asdict's generic deep
        copy cost about 10 ms per lowering; a record of plain values (all of them, in practice) is copied field by field."""
        out = {name: getattr(self, name) for name in _RECORD_FIELDS}
        parts, nodes = self.parts, self.nodes
        plain = type(parts) is dict and type(nodes) is dict and all(isinstance(v, _ATOMS) for v in (*parts.values(), *nodes.values()))
        if not plain or not all(isinstance(v, _ATOMS) for k, v in out.items() if k not in ("parts", "nodes")):
            return asdict(self)
        out["parts"], out["nodes"] = dict(parts), dict(nodes)
        return out


_RECORD_FIELDS = tuple(f.name for f in fields(StepRecord))
_ATOMS = (str, int, float, bool, type(None))


# Kinds with one step per observer or node: counted in manifests and history, not listed.
BULK_KINDS = frozenset({"qparams", "pass", "decomp"})


def listed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records worth listing one by one (all but bulk kinds)."""
    return [r for r in records if r["kind"] not in BULK_KINDS]


def outcome_counts(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Outcome counts by step kind."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        by_kind = out.setdefault(r["kind"], {})
        by_kind[r["outcome"]] = by_kind.get(r["outcome"], 0) + 1
    return out


def step_key(kind: str, parts: dict[str, str]) -> str:
    """The key of a step: its kind and every named part."""
    return digest_json({"kind": kind, "parts": parts})


Listener = Callable[[str, "StepRecord | None", str], None]


class Session:
    """One run: the store it reads and writes, and the record of every step.

    With ``store=None`` every step computes (``--no-cache``), but outputs are
    still recorded, so the flow can collect its artifacts either way.
    """

    def __init__(self, store: Store | None, listener: Listener | None = None, replay_output: bool = True):
        self.store = store
        self.replay_output = replay_output  # re-print tool output (Vela's summary), as ccache does
        self.records: list[StepRecord] = []
        self.listener = listener
        self.outputs: dict[str, list[Entry]] = {}
        self._memo: dict[tuple[str, str], Entry] = {}  # entries seen this run: no second disk read
        self._counted = 0

    def emit(self, phase: str, record: StepRecord | None, label: str) -> None:
        if self.listener is not None:
            self.listener(phase, record, label)

    def run(
        self,
        kind: str,
        name: str,
        parts: dict[str, str] | None,
        compute: Callable[[], Entry],
        note: str = "",
    ) -> Entry:
        """Serve the step from the store or compute and store it.

        ``parts=None`` means the step cannot be keyed: it runs as a bypass.
        """
        label = f"{kind}: {name}"
        self.emit("start", None, label)
        start = time.perf_counter()
        key = step_key(kind, parts) if parts is not None else ""
        entry, tier = self._fetch(kind, key) if parts is not None else (None, "")
        ahead = _ahead[0] if _ahead and parts is not None else None
        if entry is None and ahead is not None and ahead.wait(key):
            entry, tier = self._fetch(kind, key)
            tier = "run ahead" if entry is not None else tier
        if entry is not None:
            outcome = "hit"
        else:
            if ahead is not None:
                ahead.computing(key)
            begin = time.perf_counter()
            entry = compute()
            entry.cost = time.perf_counter() - begin
            outcome = "bypass" if parts is None else "miss"
        if parts is not None:
            self._keep(kind, key, entry, write=outcome == "miss")
            if ahead is not None and outcome == "miss":
                ahead.finished(key)
        seconds = time.perf_counter() - start
        record = StepRecord(
            kind=kind,
            name=name,
            outcome=outcome,
            key=key,
            parts=dict(parts or {}),
            seconds=seconds,
            saved=max(entry.cost - seconds, 0.0) if outcome == "hit" else 0.0,
            output=entry.digest(),
            note=note,
            tier=tier if outcome == "hit" else "",
        )
        self.records.append(record)
        self.outputs.setdefault(kind, []).append(entry)
        self.emit("end", record, label)
        return entry

    def _fetch(self, kind: str, key: str) -> tuple[Entry | None, str]:
        """The entry for ``key`` (seen earlier this run, else from the store) and the tier that served it."""
        if self.store is None:
            return None, ""
        entry = self._memo.get((kind, key))
        if entry is not None:
            return entry, "memory"
        entry = self.store.get(kind, key)
        return entry, self.store.last_tier

    def _keep(self, kind: str, key: str, entry: Entry, write: bool) -> None:
        """Remember ``entry`` for this run and, with ``write``, put it in the store."""
        if self.store is None:
            return
        if write:
            self.store.put(kind, key, entry)
        self._memo[(kind, key)] = entry

    def lookup(self, kind: str, name: str, parts: dict[str, str]) -> Entry | None:
        """A step's stored entry, recorded as a hit; None, with nothing recorded, when there is none.

        For steps computed together (one trace for many), with :meth:`remember`.
        """
        key = step_key(kind, parts)
        entry, tier = self._fetch(kind, key)
        if entry is None:
            return None
        self._keep(kind, key, entry, write=False)
        record = StepRecord(kind=kind, name=name, outcome="hit", key=key, parts=dict(parts), output=entry.digest(), tier=tier)
        self.records.append(record)
        return entry

    def remember(self, kind: str, name: str, parts: dict[str, str], entry: Entry) -> None:
        """Store an entry computed outside :meth:`run`, recorded as a miss."""
        key = step_key(kind, parts)
        self._keep(kind, key, entry, write=True)
        self.records.append(StepRecord(kind=kind, name=name, outcome="miss", key=key, parts=dict(parts), output=entry.digest()))

    def replace(self, kind: str, parts: dict[str, str] | None, entry: Entry) -> None:
        """Overwrite the entry a step was served with, which its consumer found unusable.

        The store checks an entry's bytes, not whether the consumer can rebuild
        them; without this every later run would warn and recompute again
        (ccache likewise overwrites a result it could not use).
        """
        if parts is not None:
            self._keep(kind, step_key(kind, parts), entry, write=True)

    def note(self, kind: str, name: str, outcome: str, seconds: float, nodes: dict[str, int] | None = None) -> None:
        """Record a step that is observed, not cached (a pass that ran or was skipped)."""
        self.records.append(StepRecord(kind=kind, name=name, outcome=outcome, seconds=seconds, nodes=dict(nodes or {})))

    def flush_counts(self) -> None:
        """Add this run's outcome counts and time saved to the store's counters, once."""
        if self.store is None:
            return
        new = self.records[self._counted :]
        self._counted = len(self.records)
        counts = outcome_counts([r.to_json() for r in new])
        remote_hits: dict[str, int] = {}
        for r in new:
            if r.tier == "remote":
                remote_hits[r.kind] = remote_hits.get(r.kind, 0) + 1
        self.store.add_counts(counts, sum(r.saved for r in new), remote_hits)

    def summary(self) -> dict[str, dict[str, int]]:
        """Outcome counts by step kind."""
        return outcome_counts([r.to_json() for r in self.records])


_active: list[Session] = []
_fallback: list[Callable[[], "Session | None"]] = []


class Ahead(Protocol):
    """A process computing this run's steps ahead of it (``run/ahead.py``), or, in that process, its announcer."""

    def wait(self, key: str) -> bool:
        """Wait while step ``key`` is being computed ahead; whether the store may now hold it."""

    def computing(self, key: str) -> None:
        """Step ``key`` missed here and is being computed."""

    def finished(self, key: str) -> None:
        """Step ``key`` is stored."""


_ahead: list[Ahead] = []


def set_ahead(ahead: Ahead | None) -> None:
    """Let every session consult ``ahead`` on a miss and tell it what it computes (None: no one)."""
    _ahead[:] = [ahead] if ahead is not None else []


def current_session() -> Session | None:
    """The innermost active session (the Arm hooks record into it).

    Outside any ``activate`` block, a process-wide fallback is used when one
    was set (``lowercache run``); if it cannot be made (a cache directory that
    cannot be opened), the process runs uncached after one warning.
    """
    if _active:
        return _active[-1]
    if not _fallback:
        return None
    try:
        return _fallback[0]()
    except Exception as e:  # lowercache run: the cache must never fail the user's script
        log.warning("caching is off for this process (%s)", e)
        uncached = Session(None)
        _fallback[:] = [lambda: uncached]
        return uncached


def set_fallback(factory: Callable[[], "Session | None"]) -> None:
    _fallback[:] = [factory]


@contextlib.contextmanager
def activate(session: Session) -> Iterator[Session]:
    _active.append(session)
    try:
        yield session
    finally:
        _active.remove(session)
