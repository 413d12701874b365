"""``lowercache watch``: lower again on every save of the model or of a project file it read, and say what changed.

Each lowering is the ``lower`` command line, run the way ``lowercache lower``
runs (direct mode, then the warm server, else in this process: the CLI
hands that path in as ``runner``), so a watched lowering is byte for byte
the one ``lower`` would write. Which files to watch comes from direct
mode's record of the lowering (:func:`lowercache.direct.recorded_files`):
the model file, the project's modules it imported and the files it opened,
never site-packages. Files are polled (stat, then a content digest when
the stat moved): no dependency, and an editor's save-by-rename is seen.

After each lowering it prints what was served and what ran, and for
Ethos-U targets Vela's estimate against the previous lowering
(:mod:`lowercache.estimates`). A failed lowering prints its one error line
and the watch goes on; Ctrl-C ends it (exit 0).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from . import delegation, direct, estimates
from .cache.digests import stat_key
from .config import Settings
from .errors import LowercacheError
from .lowering.check import numerics_report
from .targets import resolve
from .output import counted, served
from .record.places import path_state

Runner = Callable[[list[str]], object]  # a command line -> its exit code


@dataclass
class Plan:
    """What to lower, where, and with which ``lower`` options."""

    model: str
    targets: list[str]
    out_dir: Path
    lower_options: list[str] = field(default_factory=list)
    per_tensor: bool = False
    calibration: Optional[str] = None
    system_config: Optional[str] = None
    memory_mode: Optional[str] = None
    interval: float = 0.5
    max_runs: Optional[int] = None

    @property
    def model_file(self) -> str:
        path = self.model if self.model.endswith(".pt2") else self.model.rpartition(":")[0]
        return os.path.abspath(path)

    def out_for(self, target: str) -> Path:
        """DIR with one target; DIR/<target>/ with several."""
        return self.out_dir if len(self.targets) == 1 else self.out_dir / target


def plan(model: str, targets: list[str], out_dir: Path, **options: Any) -> Plan:
    """A checked plan: known targets (each once, by their canonical names), Vela options they take, a model file that exists."""
    vela = {k: options.get(k) for k in ("system_config", "memory_mode")}
    names = list(dict.fromkeys(resolve(t, **vela).name for t in targets))
    result = Plan(model=model, targets=names, out_dir=out_dir, **options)
    if not model.endswith(".pt2") and not model.rpartition(":")[0]:
        raise LowercacheError(f"bad model {model!r}; expected path/to/file.py:factory or a .pt2 file")
    if not os.path.isfile(result.model_file):
        raise LowercacheError(f"model file not found: {result.model_file}")
    return result


# -- files -------------------------------------------------------------------------------------------


def _state(path: str) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(stat key, content digest), as direct mode records them; (None, None) for a missing or unreadable file."""
    try:
        state = path_state(path)
    except OSError:
        return None, None
    if state["kind"] != "file":
        return None, None
    return tuple(state["stat"]), state["digest"]


class Files:
    """The watched files and their content at the start of the last lowering."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[Optional[tuple[int, ...]], Optional[str]]] = {}

    def snapshot(self, paths: set[str]) -> dict[str, tuple[Optional[tuple[int, ...]], Optional[str]]]:
        return {p: _state(p) for p in paths}

    def track(self, paths: set[str], baseline: dict[str, tuple[Optional[tuple[int, ...]], Optional[str]]]) -> None:
        """Watch ``paths`` from here on, judged against ``baseline`` (the content the lowering read) where it has them."""
        self.states = {p: baseline[p] if p in baseline else _state(p) for p in paths}

    def changed(self) -> list[str]:
        """Files whose content differs from the tracked state; a stat that moved without a content change is just noted."""
        found = []
        for path, (key, content) in self.states.items():
            try:
                now_key: Optional[tuple[int, ...]] = tuple(stat_key(os.stat(path)))
            except OSError:
                now_key = None
            if now_key == key:
                continue
            new_key, new_content = _state(path)
            if new_content == content:
                self.states[path] = (new_key, content)
            else:
                found.append(path)
        return found


# -- one lowering ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One target's lowering: exit code, ``--json`` summary, the lines to pass on, wall seconds."""

    target: str
    code: object
    summary: Optional[dict[str, Any]]
    errors: list[str]
    warnings: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.code in (0, None) and self.summary is not None


def _last_json(text: str) -> Optional[dict[str, Any]]:
    """The ``--json`` summary: the last object printed starting at a line's start (the factory may print too)."""
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n")]
    for start in reversed(starts):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict) and "step_counts" in value:
            return value
    return None


def lower_once(plan: Plan, target: str, runner: Runner) -> Outcome:
    """Run ``lower ... --json`` for one target with its output captured."""
    args = ["lower", plan.model, "--target", target, "--out", str(plan.out_for(target)), "--json", *plan.lower_options]
    stdout, stderr = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = runner(args)
    seconds = time.perf_counter() - started
    lines = [line.rstrip() for line in stderr.getvalue().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("lowercache: error:")]
    if code not in (0, None) and not errors:
        errors = lines[-1:] or [f"lowercache: error: the lowering exited with status {code}"]
    warnings = [line for line in lines if line.startswith("lowercache: warning:")]
    return Outcome(target, code, _last_json(stdout.getvalue()), errors, warnings, seconds)


def report(outcome: Outcome, out_dir: Path) -> str:
    """One line: how the lowering was answered, what the cache served, how long it took, where it went."""
    summary = outcome.summary or {}
    saved = summary.get("saved_seconds", 0) or 0
    counts = served(summary.get("step_counts") or {})
    if summary.get("direct") == "hit":
        how = f"served from the direct-mode record (no factory run) in {outcome.seconds:.2f} s"
    elif summary.get("flow") == "hit":
        how = f"served from the cache in {outcome.seconds:.2f} s ({counts}), {saved:.2f} s of work saved"
    else:
        how = f"lowered in {outcome.seconds:.2f} s ({counts})" + (f", {saved:.2f} s of work from the cache" if saved else "")
    return f"{outcome.target}: {how} -> {out_dir}"


# -- the loop ------------------------------------------------------------------------------------------


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def _forget_modules(paths: set[str]) -> None:
    """Drop the watched files' modules from ``sys.modules``: a lowering in this process (``--no-server``) imports them afresh."""
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if isinstance(origin, str) and os.path.abspath(origin) in paths:
            del sys.modules[name]


def drop_bytecode(paths: list[str]) -> None:
    """Remove the cached bytecode of changed Python files before they are imported again.

    Python trusts ``__pycache__`` while the source's mtime (in whole seconds)
    and size match what it recorded, so a save within the same second that
    keeps the size (``8`` -> ``9``) would import the old code: lowered stale,
    and recorded by direct mode under the new file's digest.
    """
    import importlib.util

    for path in paths:
        if not path.endswith(".py"):
            continue
        with contextlib.suppress(ValueError, NotImplementedError, OSError):
            cached = Path(importlib.util.cache_from_source(path))
            for pyc in cached.parent.glob(f"{Path(path).stem}.*.pyc"):
                pyc.unlink()


@contextlib.contextmanager
def _interrupts() -> Iterator[list[bool]]:
    """Ctrl-C raises KeyboardInterrupt and is remembered: a lowering that swallows it (through the server: exit 130) still ends the watch."""
    seen = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        seen[0] = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def run(plan: Plan, runner: Runner, settings: Settings, emit: Callable[[str], None]) -> int:
    """Lower every target now and after every change, until Ctrl-C (0) or ``max_runs`` rounds (0 if the last succeeded)."""
    files = Files()
    read_by: dict[str, list[str]] = {}  # target -> the files its latest successful lowering read
    fixed = {plan.model_file} | ({os.path.abspath(plan.calibration)} if plan.calibration else set())
    rounds, last_ok = 0, True
    with _interrupts() as interrupted:
        try:
            previous = {t: estimates.read(plan.out_for(t), t) for t in plan.targets}  # the output already there is the first baseline
            checked_before = {t: numerics_report.read(plan.out_for(t)) for t in plan.targets}
            changed: list[str] = []
            while True:
                watched = fixed.union(*read_by.values())
                baseline = files.snapshot(watched)
                _forget_modules(watched)
                if changed:
                    emit(f"[{_stamp()}] changed: {', '.join(os.path.relpath(p) for p in sorted(changed))}")
                    drop_bytecode(changed)
                last_ok = True
                for target in plan.targets:
                    emit(f"[{_stamp()}] lowering {plan.model} for {target} ...")
                    outcome = lower_once(plan, target, runner)
                    if interrupted[0]:
                        raise KeyboardInterrupt
                    for line in outcome.warnings:
                        emit(f"  {line}")
                    if not outcome.ok:
                        last_ok = False
                        for line in outcome.errors:
                            emit(f"  {line}")
                        continue
                    emit(f"  {report(outcome, plan.out_for(target))}")
                    said = delegation.line((outcome.summary or {}).get("delegation"))
                    if said is not None:
                        emit(f"  {said}")
                    estimate = estimates.read(plan.out_for(target), target)
                    if estimate is not None:
                        before = previous.get(target)
                        emit(f"  Vela estimate{' (against the previous lowering)' if before else ''}:")
                        for line in estimates.describe(estimate, before):
                            emit(f"    {line}")
                        previous[target] = estimate
                    checked = (outcome.summary or {}).get("numerics")
                    if checked is not None:  # lower --check: the TOSA reference model against the float model
                        emit(f"  numerics{' (against the previous lowering)' if checked_before.get(target) else ''}:")
                        for line in numerics_report.describe(checked, checked_before.get(target)):
                            emit(f"    {line}")
                        checked_before[target] = checked
                    read_by[target] = direct.recorded_files(plan.model, target, plan.per_tensor, plan.calibration, settings,
                                                            plan.system_config, plan.memory_mode)
                files.track(fixed.union(*read_by.values()), baseline)
                rounds += 1
                if plan.max_runs is not None and rounds >= plan.max_runs:
                    return 0 if last_ok else 1
                emit(f"[{_stamp()}] watching {_listing(files.states)} (Ctrl-C stops)")
                changed = _wait_for_change(files, plan.interval)
        except KeyboardInterrupt:
            emit(f"[{_stamp()}] stopped watching")
            return 0


def _listing(paths: dict[str, Any], most: int = 6) -> str:
    names = [os.path.relpath(p) for p in sorted(paths)]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{counted(len(names), 'file')}: {', '.join(names[:most])}{more}"


def _wait_for_change(files: Files, interval: float) -> list[str]:
    """Poll until a watched file's content changes, then a moment more for the editor to finish writing."""
    while True:
        changed = files.changed()
        if changed:
            time.sleep(min(interval, 0.2))
            return sorted(set(changed) | set(files.changed()))
        time.sleep(interval)
