"""``lowercache verify``: prove the cache returns what stock ExecuTorch would.

The model is lowered three ways in this process: the reference, as stock
ExecuTorch lowers it (no cache and every exact speed-up off: only partition
order, the documented deliberate difference, stays), then through the
configured cache with the configured speed-ups, and through a fresh empty
cache. Every artifact of the two cached runs is compared byte for byte with
the reference. A mismatch names the artifact, the first differing offset and
the step that served it, so a wrong hit can be traced to its entry.

``lowercache verify`` also checks what ``lower`` would serve now
(:func:`served_now`): the reference again, lowered in a new process with the
user's environment (this process may be a child of the warm server), the
direct-mode record's answer, and the warm server's answer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import api, direct, startup
from .config import Settings
from .errors import LowercacheError
from .lowering.flow import Artifacts
from .lowering.loading import LoadedModel


@dataclass
class Mismatch:
    run: str  # "cache" or "fresh cache"
    artifact: str
    offset: int | None  # first differing byte; None when the artifact is missing on one side
    served_by: str
    up_to_names: bool = False  # a TOSA flatbuffer that is stock's graph but for tensor names and order

    def __str__(self) -> str:
        where = "missing on one side" if self.offset is None else f"first difference at byte {self.offset}"
        if self.up_to_names:
            where += "; the same graph but for tensor names and order"
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
            names_only = name.endswith(".tosa") and _equal_up_to_names(got.files[name], reference.files[name])
            out.append(Mismatch(run, name, offset, served_by(name, got.records), names_only))
    return out


def expected(mismatches: list[Mismatch], target: str) -> tuple[list[Mismatch], list[Mismatch]]:
    """The mismatches that fail verification, and those the ``regions`` speed-up is documented to give.

    With ``regions`` on, an Ethos-U partition's TOSA is stock's graph but for
    tensor names and constant order (``lowering/replay/regionsplice.py``); its
    ``.pte`` holds Vela's stream, which those do not reach, and is still
    compared byte for byte. Any other difference fails.
    """
    from .speedups import registry
    from .targets import family_of

    allowed = any(registry.is_on(name) for name in family_of(target).renamed_under)
    notes = [m for m in mismatches if allowed and m.up_to_names and m.artifact.endswith(".tosa")]
    return [m for m in mismatches if m not in notes], notes


def _equal_up_to_names(a: bytes, b: bytes) -> bool:
    from .lowering.replay.tosacanon import equal_up_to_names

    try:
        return equal_up_to_names(a, b)
    except Exception:  # noqa: BLE001  (bytes that are no TOSA flatbuffer: simply different)
        return False


class Progress:
    """What ``verify`` is doing, one line as each part starts (``[2/6] lowering through the cache``): it runs for minutes."""

    def __init__(self, settings: Settings, say: Callable[[str], None]) -> None:
        self.total = 5 + (settings.server and not _in_server())
        self.done = 0
        self.say = say

    def __call__(self, what: str) -> None:
        self.done += 1
        self.say(f"[{self.done}/{self.total}] {what}")


def _in_server() -> bool:
    """Whether this process is a child of the warm server (its cached lowering is then the server's answer)."""
    return "lowercache.server" in sys.modules


def verify(model: LoadedModel, target: str, settings: Settings, progress: Callable[[str], None] = lambda what: None,
           **options: Any) -> tuple[list[Mismatch], Artifacts]:
    """Lower three ways: every mismatch against the stock reference, and that reference (``served_now`` compares with it)."""
    subject = model.program if model.program is not None else model.module

    def run(s: Settings) -> Artifacts:
        return api.lower(subject, model.example_inputs, target=target, settings=s, name=model.name, listener=_quiet, **options)

    progress("lowering as stock ExecuTorch does (no cache, every speed-up off)")
    stock = run(Settings(cache_dir=settings.cache_dir, disable=True, speedups="none"))
    progress("lowering through the cache")
    mismatches = compare("cache", run(settings), stock)
    progress("lowering through an empty cache")
    with tempfile.TemporaryDirectory(prefix="lowercache-verify-") as fresh:
        mismatches += compare("fresh cache", run(Settings(cache_dir=fresh)), stock)
    return mismatches, stock


def lower_in_new_process(model: str, target: str, args: list[str], env: dict[str, str]) -> Artifacts:
    """``lowercache lower`` as a new process of this interpreter, with its flags: the files it wrote but the manifest,
    and the manifest's steps as the records (which step served each file)."""
    with tempfile.TemporaryDirectory(prefix="lowercache-verify-") as out:
        command = [sys.executable, *startup.interpreter_args(), "-m", "lowercache.cli", "lower", model, "-t", target, "-o", out, *args]
        result = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise LowercacheError(f"lowercache lower {' '.join(args)} failed in a new process: {last}")
        files = {p.name: p.read_bytes() for p in sorted(Path(out).iterdir()) if p.is_file() and p.name != "manifest.json"}
        return Artifacts(files, records=json.loads((Path(out) / "manifest.json").read_text()).get("steps", []))


def served_now(model: str, target: str, settings: Settings, reference: Artifacts, calibration: str | None,
               args: list[str], environ: dict[str, str], system_config: str | None = None,
               memory_mode: str | None = None, progress: Callable[[str], None] = lambda what: None) -> tuple[list[Mismatch], list[str]]:
    """What ``lower`` would serve now, each compared with a stock lowering in a new process: mismatches and what was checked.

    ``args``: the options as given (``--cache-dir``, ``--remote``,
    ``--calibration``, Vela's), for the new processes; ``environ``: the environment
    the command started with (before torch set variables of its own).
    """
    env = {k: v for k, v in environ.items() if k not in ("LOWERCACHE_SPEEDUPS", "LOWERCACHE_DIRECT")}
    progress("lowering as stock again, in a new process with your environment")
    stock = lower_in_new_process(model, target, [*args, "--no-cache", "--no-server"], {**env, "LOWERCACHE_SPEEDUPS": "none"})
    mismatches = compare("stock in this process", reference, stock)
    checked = ["stock in a new process"]
    request = direct.Request(model=model, target=target, out_dir="", calibration=calibration, system_config=system_config,
                             memory_mode=memory_mode)
    progress("comparing the direct-mode record's answer")
    store = _store(settings)
    found = direct.lookup(request, settings, store, environ) if store is not None else "no cache"
    if store is not None:
        store.close()
    if isinstance(found, str):
        checked.append(f"direct record: none answers ({found})")
    else:
        record, flow = found
        served = [{"kind": "flow", "name": record["flow"]["name"], "outcome": "hit", "key": record["flow"]["key"]}]
        mismatches += compare("direct record", Artifacts(dict(flow.blobs), records=served), stock)
        checked.append(f"direct record (flow entry {record['flow']['key'][:12]})")
    if _in_server():  # the cached run above was the server's answer
        checked.append("the server's answer (this process)")
    elif settings.server:
        progress("lowering through the warm server")
        mismatches += compare("server", lower_in_new_process(model, target, [*args, "--no-direct"], env), stock)
        checked.append("the server's answer")
    return mismatches, checked


def _store(settings: Settings) -> Any:
    from .cache.tiers import open_store

    try:
        return open_store(settings)
    except LowercacheError:
        return None


def _quiet(phase: str, record: Any, label: str) -> None:
    """A listener, so Vela's summary is not re-printed three times."""
