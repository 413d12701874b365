"""Writing a lowering's files and manifest to its output directory, and what ``lower`` says about them at the end
(imports no torch: direct mode writes and reports through it too).

Files are staged inside the directory and renamed into place; a failed
write removes what it staged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .cache.digests import digest
from .errors import LowercacheError


def counted(n: int, noun: str) -> str:
    """``1 file``, ``2 files``: a count in words, as a user reads it."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# What each kind of cached step is, in a user's words; the passes, observers and decompositions are internals (``-v``).
STEP_WORDS = {"flow": "whole lowering", "reexport": "re-export", "quantize": "quantized model", "tosa": "TOSA", "vela": "Vela", "xnnpack": "XNNPACK",
              "regions": "TOSA regions", "check": "numerics", "reference": "reference", "layers": "per-layer numerics"}


def served(counts: dict[str, dict[str, int]]) -> str:
    """``whole lowering: miss; TOSA: 2 hits, 1 miss``: what the cache served, by kind of step (``{kind: {outcome: n}}``)."""
    said = []
    for kind, outcomes in counts.items():
        if kind not in STEP_WORDS:
            continue
        total = sum(outcomes.values())
        words = ", ".join(o if total == 1 else f"{n} {o if n == 1 else o + ('es' if o.endswith('s') else 's')}"
                          for o, n in outcomes.items())
        said.append(f"{STEP_WORDS[kind]}: {words}")
    return "; ".join(said)


def run_summary(manifest: dict[str, Any], out: Any, written: list[Path], **outcome: Any) -> dict[str, Any]:
    """The ``--json`` summary's part that a lowering and a direct-mode hit share: what was lowered, where, and the files
    written, around ``outcome`` (the flow's outcome, step counts, seconds)."""
    return {"model": manifest.get("model"), "target": manifest.get("target"), "out": str(out), **outcome,
            "files": {p.name: manifest["files"].get(p.name, {}) for p in written}}


@dataclass
class Report:
    """What ``lower`` says at the end, ready to print: a full lowering's table of phases and the line under it (a
    direct-mode hit has neither), the lines for stderr (delegation, Vela's estimate, numerics; each printed after
    ``lowercache: ``), the ``--json`` summary, the line for stdout without ``--json``, and a ``--min-snr`` failure (said
    after the output is written; exit 1)."""

    lines: list[str]
    summary: dict[str, Any]
    wrote: str
    short: Optional[str] = None
    table: Any = None
    total: str = ""


def report(run: dict[str, Any], outcome: tuple[list[str], dict[str, Any]], numerics: Optional[dict[str, Any]],
           written: list[Path], out_dir: Any, min_snr: Optional[float]) -> Report:
    """The report of a lowering or a hit: ``run``, its part of the ``--json`` summary; ``outcome``, what the delegation
    and Vela's estimate say (``estimates.outcome``); ``numerics``, the check's figures, if it ran."""
    from .lowering.check import numerics_report

    said, summarized = outcome
    short = numerics_report.below(numerics, min_snr)
    return Report(lines=said + numerics_report.lines(numerics),
                  summary={**run, **summarized, **numerics_report.json_part(numerics, short)},
                  wrote=f"wrote {counted(len(written), 'file')} to {out_dir}", short=short)


def _unwritable(out: Path, why: str) -> LowercacheError:
    return LowercacheError(f"cannot write output directory {out}: {why}")


def check_output_dir(out_dir: str | os.PathLike) -> None:
    """Fail before a lowering, not after it, when ``out_dir`` cannot receive the artifacts.

    Probes the nearest existing directory on the way to ``out_dir`` with a
    temporary directory, removed at once: nothing is left behind.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise _unwritable(out, "it exists and is not a directory")
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise _unwritable(out, f"{probe} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lowercache-probe-", dir=probe))
    except OSError as e:
        raise _unwritable(out, f"{probe}: {e.strerror or e}") from None


def write_files(files: dict[str, bytes], manifest: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write ``files`` and ``manifest.json`` into ``out_dir``; a failed write removes what it staged.

    Files are staged in a temporary directory inside ``out_dir`` and each is
    renamed into place: a rename within one directory never crosses devices,
    so a mount point (a Docker or CI volume) receives output, and the
    parent's permissions do not matter. Concurrent writers each stage their
    own files and replace whole files, so they all succeed with the same
    bytes. Files of the previous lowering that this one does not write are
    removed (see :func:`_stale_files`) just before the new manifest, which
    goes last: a run killed in between leaves them still listed, for the
    next run to remove.
    """
    out = Path(out_dir)
    files = dict(files)
    files["manifest.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    created = not out.is_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
        stale = _stale_files(out, files)
        _remove_abandoned_staging(out)
        tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    except OSError as e:
        _remove_if_empty(out, created)
        raise _unwritable(out, e.strerror or str(e)) from None
    moved: list[tuple[Path, int]] = []
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for name in sorted(files, key=lambda n: n == "manifest.json"):
            if name == "manifest.json":
                for path in stale:
                    with contextlib.suppress(OSError):
                        path.unlink()
            os.replace(tmp / name, out / name)
            moved.append((out / name, (out / name).stat().st_ino))
    except BaseException as e:  # a failed write or Ctrl-C (KeyboardInterrupt): nothing staged or partial stays
        shutil.rmtree(tmp, ignore_errors=True)
        if created:  # leave no partial directory, but keep a concurrent writer's files
            for path, inode in moved:
                with contextlib.suppress(OSError):
                    if path.stat().st_ino == inode:
                        path.unlink()
        _remove_if_empty(out, created)
        if isinstance(e, OSError):
            raise _unwritable(out, e.strerror or str(e)) from None
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in sorted(files)]


STAGING_PREFIX = ".lowercache-tmp-"
ABANDONED_AFTER_S = 3600  # far longer than writing a few files takes: a staging folder this old lost its writer


def _remove_abandoned_staging(out: Path) -> None:
    """Staging folders a killed run left in ``out``; a live writer's folder is minutes old at most."""
    now = time.time()
    for path in out.glob(f"{STAGING_PREFIX}*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink() and now - path.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(path)


def _remove_if_empty(out: Path, created: bool) -> None:
    """A failed first write leaves no directory (a concurrent writer's files keep it)."""
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()


def _stale_files(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Files the previous lowering in ``out`` wrote and this one does not: a stale ``partition_1.tosa`` would pass for output.

    Only files ``out/manifest.json`` lists, with plain names, that still hold
    the bytes it records: a user's other files, or a listed file they have
    changed since, are kept.
    """
    try:
        previous = json.loads((out / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return []
    listed = previous.get("files") if isinstance(previous, dict) else None
    if not isinstance(listed, dict):
        return []
    stale = []
    for name, record in listed.items():
        if name in files or name.startswith(".") or not isinstance(record, dict) or Path(name).name != name:
            continue
        path = out / name
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size != record.get("size"):
                continue
            if digest(path.read_bytes()) == record.get("xxh3_128"):
                stale.append(path)
        except OSError:
            continue
    return stale
