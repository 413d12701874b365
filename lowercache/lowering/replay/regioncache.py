"""Region states at the split, as cache entries: their keys, and reading and writing them.

A region's state after the pipeline's prefix depends on its own content and
on the facts its producers hand it pass by pass, and those come from the
regions before it. So a state is keyed by the chain: the region's own key
parts (``regions.region_parts``: ``region.nodes``, ``region.constants``,
``region.boundary``), ``upstream`` (the names and keys of every region
before it, in graph order), the compile spec, the pass insertions, the
pipeline version and the toolchain. ``lowercache explain`` names the parts
that changed. An entry holds the region's program (``regionstore``) and, for
each of its outputs, the metadata it carried after each prefix pass (its
``trail``), which a region downstream that re-runs adopts pass by pass.
"""

from __future__ import annotations

import logging
from typing import Any

from . import regions, regionstore
from ..stored.programstore import FormatError
from ...cache.digests import digest_json
from ...cache.steps import Session, StepRecord, step_key
from .. import arithmetic

log = logging.getLogger("lowercache")

KIND = "region"
_UNTRACKED = regionstore.DROPPED_META  # a trail keeps what the stored form keeps
_SCALARS = (int, float, bool, str, type(None))


def chain_parts(program: Any, depth: int, order: list[str], fixed: dict[str, str]) -> list[dict[str, str]]:
    """The key parts of every region's state at the split, in ``order`` (graph order); ``fixed``: the parts all
    share (compile spec, pass insertions, pipeline version)."""
    own = regions.region_parts(program, depth)
    chain: list[list[str]] = []
    computed_with = arithmetic.step_parts()  # one lowering's: the same for every region
    out = []
    for name in order:
        parts = {f"region.{k}": v for k, v in own[name].items() if k != "toolchain"}
        parts["upstream"] = digest_json(chain)
        parts.update(fixed)
        parts.update(computed_with)
        out.append(parts)
        chain.append([name, digest_json(own[name])])
    return out


class Trail:
    """What one region's outputs carried after each prefix pass: per output, ``(pass index, metadata)`` where it
    changed. Recorded as the pipeline runs; stored with the region and read back by a region downstream that re-runs."""

    def __init__(self, outputs: int) -> None:
        self.metas: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in range(outputs)]
        self.refs: list[list[Any]] = [[] for _ in range(outputs)]  # the values last seen, held so their ids stay theirs

    def note(self, index: int, metas: list[dict[str, Any]]) -> None:
        """The outputs' metadata after pass ``index`` (a snapshot is kept where it differs from the last one).

        Most passes leave an output's metadata as it was: the same values,
        and the same entries in its nested dicts. That is checked by
        identity first; only a changed value is compared by content.
        """
        for k, (kept, meta) in enumerate(zip(self.metas, metas)):
            refs = _refs(meta)
            if len(refs) == len(self.refs[k]) and all(a is b for a, b in zip(refs, self.refs[k])):
                continue
            self.refs[k] = refs
            meta = {key: v for key, v in meta.items() if key not in _UNTRACKED}
            if not kept or not _same(kept[-1][1], meta):
                kept.append((index, regions.copied_meta(meta)))

    def to_json(self) -> list[list[list[Any]]]:
        """The stored form; FormatError if some metadata cannot be stored."""
        return [[[index, regionstore.encode_meta(meta)] for index, meta in kept] for kept in self.metas]


def _refs(meta: dict[str, Any]) -> list[Any]:
    """The keys and values of ``meta`` and of the dicts nested in it, as objects."""
    out: list[Any] = []
    for key, value in meta.items():
        out += [key, value]
        if isinstance(value, dict):
            out += [x for item in value.items() for x in item]
    return out


def _same(a: Any, b: Any) -> bool:
    """Whether two metadata values are equal as stored: fake values by dtype, shape, strides and grad."""
    from torch._subclasses.fake_tensor import FakeTensor

    if a is b:
        return True
    if isinstance(a, FakeTensor) or isinstance(b, FakeTensor):
        return (isinstance(a, FakeTensor) and isinstance(b, FakeTensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return False
        if all(type(x) in _SCALARS for x in a):  # per-channel scales: hundreds of floats
            return all(type(x) in _SCALARS for x in b) and list(a) == list(b)
        return all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain equality: count it as changed
        return False


class ServedTrail:
    """A stored trail, decoded once: the metadata of output ``k`` after pass ``index``."""

    def __init__(self, forms: Any, outputs: int, mode: Any) -> None:
        if not isinstance(forms, list) or len(forms) != outputs:
            raise FormatError("the stored trail does not match the outputs")
        self.metas: list[list[tuple[int, dict[str, Any]]]] = []
        for steps in forms:
            if not isinstance(steps, list) or not steps:
                raise FormatError("bad stored trail")
            decoded = []
            for step in steps:
                if not (isinstance(step, list) and len(step) == 2 and type(step[0]) is int):
                    raise FormatError("bad stored trail")
                decoded.append((step[0], regionstore.decode_meta(step[1], mode)))
            self.metas.append(decoded)

    def meta(self, output: int, index: int) -> dict[str, Any]:
        found = None
        for at, meta in self.metas[output]:
            if at > index:
                break
            found = meta
        if found is None:
            raise FormatError(f"the stored trail starts after pass {index}")
        return regions.copied_meta(found)


def fetch(session: Session | None, parts: dict[str, str], like: Any) -> tuple[Any, dict[str, Any]] | str:
    """The stored state for ``parts`` (program, extra), or why there is none (a corrupt entry: a warning too)."""
    if session is None or session.store is None:
        return "no cache"
    entry = session.store.get(KIND, step_key(KIND, parts))
    if entry is None:
        return "no stored state"
    try:
        return regionstore.decode(entry, like)
    except FormatError as err:
        log.warning("stored region state unreadable (%s); the region re-runs", err)
        return f"stored state unreadable ({err})"


def keep(session: Session | None, name: str, parts: dict[str, str], program: Any, inputs: list[str], trail: Trail) -> str:
    """Store a region's state: its program, its inputs' placeholder names in extraction order, its outputs' trail;
    what happened, for the record."""
    if not writable(session):
        return "not stored (no writable cache)"
    try:
        entry = regionstore.encode(program, {"inputs": inputs, "trail": trail.to_json()})
    except FormatError as err:
        log.info("region %s not stored (%s)", name, err)
        return f"not stored ({err})"
    if not session.store.put(KIND, step_key(KIND, parts), entry):
        return "not stored (the cache did not take it)"
    return "stored"


def writable(session: Session | None) -> bool:
    """Whether states can be stored in ``session``'s cache (following regions to store them costs time)."""
    return session is not None and session.store is not None and session.store.writable


def note(session: Session | None, name: str, outcome: str, parts: dict[str, str], why: str) -> None:
    """One region's verdict as a step record: ``hit`` (served) or ``miss`` (re-ran), with its key parts."""
    if session is not None:
        session.records.append(StepRecord(kind=KIND, name=name, outcome=outcome, key=step_key(KIND, parts), parts=dict(parts), note=why))
