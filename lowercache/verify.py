"""``lowercache verify``: prove the cache returns what stock ExecuTorch would.

The model is lowered three ways: the reference, as stock ExecuTorch lowers it
(no cache and every exact speed-up off: only partition order, the documented
deliberate difference, stays), then through the configured cache with the
configured speed-ups, and through a fresh empty cache. Every artifact of the
two cached runs is compared byte for byte with the reference. A mismatch
names the artifact, the first differing offset and the step that served it,
so a wrong hit can be traced to its entry.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from typing import Any

from . import api
from .config import Settings
from .lowering.flow import Artifacts
from .lowering.loading import LoadedModel


@dataclass
class Mismatch:
    run: str  # "cache" or "fresh cache"
    artifact: str
    offset: int | None  # first differing byte; None when the artifact is missing on one side
    served_by: str

    def __str__(self) -> str:
        where = "missing on one side" if self.offset is None else f"first difference at byte {self.offset}"
        return f"{self.run}: {self.artifact} differs from the stock lowering ({where}); served by {self.served_by}"


def served_by(artifact: str, records: list[dict[str, Any]]) -> str:
    """Which step produced ``artifact`` in a run: the flow when it hit, else the partition's step."""
    flow = next((r for r in records if r["kind"] == "flow"), None)
    if flow is not None and flow["outcome"] == "hit":
        return f"flow {flow['name']} (hit, key {flow['key'][:12]})"
    m = re.match(r"partition_(\d+)\.(tosa|vela)", artifact)
    if m:
        kind = "tosa" if m.group(2) == "tosa" else "vela"
        step = next((r for r in records if r["kind"] == kind and r["name"] == f"partition {m.group(1)}"), None)
        if step is not None:
            return f"{kind} partition {m.group(1)} ({step['outcome']}, key {step['key'][:12]})"
    if flow is not None:
        return f"flow {flow['name']} ({flow['outcome']})"
    return "unknown"


def first_difference(a: bytes, b: bytes) -> int | None:
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def compare(run: str, got: Artifacts, reference: Artifacts) -> list[Mismatch]:
    out = []
    for name in sorted(set(got.files) | set(reference.files)):
        if name not in got.files or name not in reference.files:
            out.append(Mismatch(run, name, None, served_by(name, got.records)))
            continue
        offset = first_difference(got.files[name], reference.files[name])
        if offset is not None:
            out.append(Mismatch(run, name, offset, served_by(name, got.records)))
    return out


def verify(model: LoadedModel, target: str, settings: Settings, **options: Any) -> list[Mismatch]:
    """Lower three ways and return every mismatch against the stock reference."""
    subject = model.program if model.program is not None else model.module

    def run(s: Settings) -> Artifacts:
        return api.lower(subject, model.example_inputs, target=target, settings=s, name=model.name, listener=_quiet, **options)

    reference = run(Settings(cache_dir=settings.cache_dir, disable=True, speedups="none"))
    mismatches = compare("cache", run(settings), reference)
    with tempfile.TemporaryDirectory(prefix="lowercache-verify-") as fresh:
        mismatches += compare("fresh cache", run(Settings(cache_dir=fresh)), reference)
    return mismatches


def _quiet(phase: str, record: Any, label: str) -> None:
    """A listener, so Vela's summary is not re-printed three times."""
