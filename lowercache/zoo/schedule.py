"""Run a build: direct-mode hits first, in this process and without torch; the rest on an executor, ``-j`` at a time.

A pair's outcome is ``hit`` (served from the cache: by a direct-mode record
here, or a flow hit in a worker), ``miss`` (lowered), ``failed`` (its
one-line cause kept) or ``skipped`` (not run: the build stopped first). The
first failure stops the build (running workers are interrupted, nothing
new starts) unless ``keep_going``; Ctrl-C stops it the same way. Either
way the report is written, and the exit code says what happened: 0 all
built, 1 some failed, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .. import direct
from ..output import check_output_dir
from . import local, report
from .buildfile import Build, Pair
from .progress import Progress

INTERRUPTED = 130


@dataclass
class Options:
    """``lowercache build``'s options, as plain values."""

    jobs: Optional[int] = None
    keep_going: bool = False
    executor: str = "local"
    ray_address: Optional[str] = None
    cache_dir: Optional[str] = None  # absolute: workers run in the build file's directory
    remote: Optional[str] = None
    no_direct: bool = False
    compare: Optional[Path] = None

    def lower_options(self) -> list[str]:
        """What every worker's ``lower`` gets besides the pair's own options."""
        return [
            *(["--cache-dir", self.cache_dir] if self.cache_dir else []),
            *(["--remote", self.remote] if self.remote else []),
            *(["--no-direct"] if self.no_direct else []),
        ]


@dataclass
class Outcome:
    state: str
    how: str = ""
    seconds: float = 0.0
    error: Optional[str] = None


@dataclass
class Result:
    """What ``run`` returns: the exit code, each pair's outcome and the report's paths."""

    code: int
    outcomes: dict[Pair, Outcome] = field(default_factory=dict)
    reports: tuple[Path, ...] = ()


@contextlib.contextmanager
def _in_directory(path: Path):
    """Model, calibration and output paths are relative to the build file's directory, as ``lower`` run there sees them."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _direct_hit(pair: Pair, options: list[str]) -> Optional[float]:
    """Seconds a direct-mode answer took, or None when the pair needs a worker (no confirmed record, a changed input)."""
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = direct.serve(pair.lower_args(options))
    return time.perf_counter() - started if code == 0 else None


def _flow_outcome(out_dir: Path) -> Optional[tuple[str, str]]:
    """(hit or miss, direct or worker) from the pair's ``manifest.json``; None when there is none to read."""
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
        flow = next(s for s in manifest["steps"] if s["kind"] == "flow")
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    how = "direct" if (manifest.get("direct") or {}).get("outcome") == "hit" else "worker"
    return ("hit" if flow["outcome"] == "hit" else "miss"), how


def _executor(options: Options, jobs: int, cwd: str, syspath: list[str]) -> Any:
    if options.executor == "ray":
        from .onray import RayExecutor

        return RayExecutor(jobs, cwd, syspath, options.lower_options(), options.ray_address)
    return local.LocalExecutor(jobs, cwd, syspath, options.lower_options())


def run(build: Build, pairs: list[Pair], options: Options, console: Any = None, emit: Callable[[str], None] = print) -> Result:
    """Build ``pairs``; write the report into the output root; never raises for a failing pair."""
    previous = report.load(options.compare) if options.compare else None
    out_root = build.root / build.out
    check_output_dir(out_root)
    jobs = options.jobs or (len(pairs) if options.executor == "ray" else local.default_jobs(max(p.memory for p in pairs)))
    result = Result(code=0)
    started = time.perf_counter()
    syspath = list(sys.path)
    lower_options = options.lower_options()
    with _in_directory(build.root), Progress(pairs, console, emit) as progress:
        executor = None
        try:
            pending: deque[Pair] = deque()
            for pair in pairs:
                seconds = None if options.no_direct else _direct_hit(pair, lower_options)
                if seconds is None:
                    pending.append(pair)
                else:
                    result.outcomes[pair] = Outcome("hit", "direct", seconds)
                    progress.set(pair, "hit", "direct mode", seconds)
            stopping = False
            executor = _executor(options, jobs, str(build.root), syspath) if pending else None
            while executor is not None and ((pending and not stopping) or executor.busy()):
                while pending and not stopping and executor.free():
                    pair = pending.popleft()
                    executor.submit(pair)
                    progress.set(pair, "running", executor.name)
                for pair, raw in executor.finished(wait=0.25):
                    outcome = _settle(pair, raw, executor.name, options, str(build.root), syspath)
                    result.outcomes[pair] = outcome
                    progress.set(pair, outcome.state, outcome.error or outcome.how, outcome.seconds)
                    if outcome.state == "failed" and not options.keep_going:
                        stopping = True
                        for stopped in executor.cancel():
                            result.outcomes[stopped] = Outcome("skipped", error="stopped: another pair failed")
                            progress.set(stopped, "skipped", "stopped: another pair failed")
                progress.tick()
        except KeyboardInterrupt:
            result.code = INTERRUPTED
            for stopped in executor.cancel() if executor is not None else []:
                result.outcomes[stopped] = Outcome("skipped", error="interrupted")
                progress.set(stopped, "skipped", "interrupted")
        finally:
            if executor is not None:
                executor.close()
        for pair in pairs:
            if pair not in result.outcomes:
                why = "interrupted" if result.code == INTERRUPTED else "not started: another pair failed"
                result.outcomes[pair] = Outcome("skipped", error=why)
                progress.set(pair, "skipped", why)
    seconds = time.perf_counter() - started
    rows = [report.entry(p.name, p.target, p.out, o.state, o.how, o.seconds, o.error, build.root)
            for p, o in ((p, result.outcomes[p]) for p in pairs)]
    meta = {"build_file": str(build.path), "executor": options.executor, "jobs": jobs, "seconds": round(seconds, 3),
            "interrupted": result.code == INTERRUPTED}
    changes = None
    if previous is not None:
        meta["compared_with"] = str(options.compare)
        changes = report.compare(previous, rows)
        if build.max_snr_drop is not None:
            meta["regressions"] = report.regressions(previous, rows, build.max_snr_drop)
    result.reports = report.write(out_root, rows, meta, changes)
    failed = [r for r in rows if r["outcome"] == "failed"]
    if (failed or meta.get("regressions")) and result.code == 0:
        result.code = 1
    _summary(rows, seconds, changes, result, emit, meta.get("regressions", []))
    return result


def _settle(pair: Pair, raw: dict[str, Any], executor: str, options: Options, cwd: str, syspath: list[str]) -> Outcome:
    """A finished worker's outcome, read from the output it wrote (after fetching it, when a Ray task wrote it elsewhere)."""
    seconds = float(raw.get("seconds", 0.0))
    if raw.get("code") != 0:
        return Outcome("failed", executor, seconds, raw.get("error") or f"exited with status {raw.get('code')}")
    found = _flow_outcome(Path(cwd) / pair.out)
    if found is None and executor == "ray":  # the task ran on another machine: the shared tier has the result
        from .onray import fetch

        fetched = fetch(pair, cwd, syspath, options.lower_options())
        if fetched.get("code") != 0:
            return Outcome("failed", executor, seconds, fetched.get("error"))
        found = _flow_outcome(Path(cwd) / pair.out)
        seconds += float(fetched.get("seconds", 0.0))
    if found is None:
        return Outcome("failed", executor, seconds, f"no manifest.json in {pair.out} after the lowering")
    state, how = found
    if executor == "ray":
        how = f"ray ({raw.get('host', '?')})"
    return Outcome(state, how, seconds)


def _summary(rows: list[dict[str, Any]], seconds: float, changes: Optional[list[str]], result: Result, emit: Callable[[str], None],
             regressions: list[str] = ()) -> None:
    emit(report.tally(rows, f" in {seconds:.1f}s"))
    for r in rows:
        if r["outcome"] == "failed":
            emit(f"failed: {r['model']} on {r['target']}: {r.get('error')}")
    if changes is not None:
        emit("changes since the compared build:" if changes else "no changes since the compared build")
        for line in changes:
            emit(f"  {line}")
    for line in regressions:
        emit(f"numerics regression: {line}")
    emit(f"report: {result.reports[0]} and {result.reports[1].name}")
    if result.code == INTERRUPTED:
        emit("interrupted")

