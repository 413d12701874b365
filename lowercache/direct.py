"""Direct mode: answer an unchanged ``lowercache lower`` without importing torch or running the model factory.

As ccache's direct mode skips the preprocessor, a normal ``lower`` run
records what its model factory (and the export that runs the model's
``forward``) read: the model file and every module outside the standard
library and site-packages, files opened (an audit hook sees them), files
looked at, directories listed, module names looked up, environment
variables read; plus the interpreter, the machine, the toolchain identity,
the settings that shape the result, and the flow key the run produced. A
later run whose recorded inputs all hash the same writes the flow entry
for that key, from the store, without importing torch.

A record is not used when it cannot be trusted: the factory did something
no record can capture (a network connection, a subprocess, a write, a
chdir), or the first re-run with identical inputs produced another flow
key (an unseeded random generator, the time): such a record is untrusted
for good. Every record waits for that first re-run before it is used. See
docs/direct-mode.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from . import estimates
from .cache.digests import digest, digest_json
from .cache.store import Entry
from .config import Settings, check_with_min_snr, load_settings, parse_check
from .errors import LowercacheError
from .lowering.check import numerics_report
from .targets import resolve
from .output import Report, check_output_dir, report, run_summary, write_files
from .record.places import Places, hop_dirs, project_root
from .record.recorder import Recorder, initial_environ, keep_initial_environ, listen
from .record.trust import (UNSEEN, Words, check_inputs, elsewhere, from_earlier, identity, identity_changed, inputs_changed, judged_once,
                           kept_earlier, put_status, status_lines, verdict)

KIND = "direct"
T = TypeVar("T")
RECORD_VERSION = 2
# How direct-mode records say the one confirm rule (``record/trust.py``).
WORDS = Words(
    who="the factory",
    same="gives the same flow key",
    gave_same="gave the same flow key",
    elsewhere="lowered differently in another directory",
    differed="identical inputs lowered differently (another flow key): the factory reads something direct mode "
             "cannot see, such as an unseeded random generator or the time",
)


# -- the request: which record answers it ------------------------------------------------------------


@dataclass
class Request:
    """A ``lower`` command as given: what names its record."""

    model: str
    target: str
    out_dir: str
    per_tensor: bool = False
    calibration: str | None = None
    cache_dir: str | None = None
    no_cache: bool = False
    remote: str | None = None
    no_direct: bool = False
    as_json: bool = False
    system_config: str | None = None
    memory_mode: str | None = None
    check: str | None = None  # as given (None: the setting's); then the check the run makes, "" (none), "outputs" or "layers"
    # (lowering/check/numerics.py): its own record, which names the check's entries
    min_snr: str | float | None = None
    cwd: str = field(default_factory=os.getcwd)

    @property
    def root(self) -> str:
        return project_root(self.cwd)

    def key(self) -> str:
        """The record's key: the model and calibration as given, the working directory relative to the project root, target, flags."""
        return digest_json(
            {
                "version": RECORD_VERSION,
                "model": self.model,
                "cwd": os.path.relpath(self.cwd, self.root),
                "target": self.target,
                "per_tensor": self.per_tensor,
                "calibration": self.calibration,
                "vela": [self.system_config, self.memory_mode],
                **({"check": True} if self.check == "outputs" else {"check": self.check} if self.check else {}),
            }
        )

    def earlier_key(self, flow_key: str) -> str:
        """Where an earlier confirmed record of this command is kept, by the flow key it answers with."""
        return digest_json({"earlier": self.key(), "flow": flow_key})

    def history_name(self) -> str:
        """The name ``lower`` records run history under (as ``cli._model_name``)."""
        if self.model.endswith(".pt2"):
            return os.path.abspath(self.model)
        path, _, factory = self.model.rpartition(":")
        return f"{os.path.abspath(path)}:{factory}"

    def snr_floor(self) -> float | None:
        """``--min-snr`` as a number (a ``ValueError`` for text that is none)."""
        return float(self.min_snr) if self.min_snr is not None else None

    def settings(self) -> Settings:
        settings = load_settings(
            cache_dir=Path(self.cache_dir) if self.cache_dir else None,
            disable=True if self.no_cache else None,
            remote=self.remote,
            direct=False if self.no_direct else None,
            check=parse_check(self.check, "--check") if self.check is not None else None,
        )
        settings.check = check_with_min_snr(settings.check, self.min_snr)
        return settings


_VALUE_OPTIONS = {"--target": "target", "-t": "target", "--out": "out_dir", "-o": "out_dir", "--cache-dir": "cache_dir",
                  "--calibration": "calibration", "--remote": "remote", "--system-config": "system_config",
                  "--memory-mode": "memory_mode", "--min-snr": "min_snr"}
_FLAG_OPTIONS = {"--no-cache": "no_cache", "--per-tensor": "per_tensor", "--no-direct": "no_direct", "--json": "as_json",
                 "--no-server": None}


def parse_lower(args: list[str]) -> Request | None:
    """A plain ``lower`` command line, or None for anything else (which the full CLI then handles, errors included)."""
    args = list(args)
    while args and args[0] in ("-v", "--verbose"):
        args.pop(0)
    if not args or args[0] != "lower":
        return None
    values: dict[str, Any] = {}
    positional: list[str] = []
    rest = iter(args[1:])
    for arg in rest:
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in _VALUE_OPTIONS:
            value = inline if eq else next(rest, None)
            field_name = _VALUE_OPTIONS[name]
            if value is None or field_name in values:
                return None
            values[field_name] = value
        elif name in _FLAG_OPTIONS and not eq:
            if _FLAG_OPTIONS[name] is not None:
                values[_FLAG_OPTIONS[name]] = True
        elif name == "--check":
            mode = inline if eq else "outputs"  # ``--check`` alone is outputs
            if mode not in numerics_report.MODES or "check" in values:
                return None
            values["check"] = mode
        elif arg.startswith("-"):
            return None
        else:
            positional.append(arg)
    if len(positional) != 1 or "target" not in values or "out_dir" not in values:
        return None
    if "calibration" in values:
        values["calibration"] = str(Path(values["calibration"]))  # as the CLI's Path option gives it to start()
    return Request(model=positional[0], **values)


# -- recording ---------------------------------------------------------------------------------------


class LowerRecorder(Recorder):
    """The recorder of one ``lower`` run: its factory, and the model's export."""

    def __init__(self, request: Request, settings: Settings):
        super().__init__(request.root, settings)
        self.request = request

    def beside(self) -> list[str]:
        """Directories whose every file native code may read: the model file's, and its link's target's when it is one."""
        path = self.request.model if self.request.model.endswith(".pt2") else self.request.model.rpartition(":")[0]
        return hop_dirs(os.path.join(self.request.cwd, path)) if path else []

    def unswept(self) -> list[str]:
        """Directories the sweep leaves out: the output directory (lowercache writes it) and the cache."""
        return [os.path.join(self.request.cwd, self.request.out_dir), str(self.settings.cache_dir)]


@contextlib.contextmanager
def recording(request: Request, settings: Settings, before: Callable[[], None] = lambda: None) -> Iterator[LowerRecorder | None]:
    """Direct mode around one ``lower``: a (paused) recorder for it, or None when direct mode is off or nothing could
    be stored. The run loads with :func:`recorded`, lowers with :func:`listening` and stores the record with
    :func:`finish`; a run that fails leaves no record.

    ``before``: called first when there will be a record (the lowering's own imports, so that the backstop
    below Python, started next, does not trace them).
    """
    if not settings.direct or settings.disable or settings.read_only:
        yield None
        return
    before()
    request.check = settings.check
    recorder = _recorder(request, settings)
    try:
        yield recorder
    finally:
        recorder.close()


def likely_hit(request: Request, settings: Settings) -> bool:
    """Whether the run of ``request`` will most likely hit its flow step: its record (unconfirmed, or one that cannot
    answer in this directory) names inputs that are all unchanged, so the run will export the same program. An
    untrusted record says nothing (a factory that reads the time gives a new key each run). A guess that only orders
    imports (``lowerer``): the flow key decides."""
    from .cache.tiers import open_store

    try:
        store = open_store(settings)
    except LowercacheError:
        return False
    if store is None:
        return False
    try:
        record = _load(store, request.key())
        if record is None or record.get("status") not in ("unconfirmed", "confirmed"):
            return False
        syspath = Places(request.root).search_path()
        return _changed(record, request, settings, syspath, initial_environ()) is None
    except (ValueError, KeyError, TypeError):
        return False
    finally:
        store.close()


def _recorder(request: Request, settings: Settings) -> LowerRecorder:
    recorder = LowerRecorder(request, settings)
    recorder.watch_below()
    listen(recorder)  # one lowering at a time; a failed run's recorder is dropped
    if request.calibration is not None:
        recorder.add_file(request.calibration)
    return recorder


def recorded(recorder: LowerRecorder | None, load: Callable[[str], T], model: str) -> T:
    """``load(model)`` (import the model file, run its factory) with the recorder listening."""
    if recorder is None:
        return load(model)
    recorder.paused = False
    try:
        return load(model)
    finally:
        recorder.pause()


def listening(recorder: LowerRecorder | None, listener: Callable[[str, Any, str], None]) -> Callable[[str, Any, str], None]:
    """The flow's listener, also telling the recorder which stage runs (only the export is recorded)."""
    if recorder is None:
        return listener

    def both(phase: str, record: Any, label: str) -> None:
        if phase == "stage":
            recorder.stage(label)
        listener(phase, record, label)

    return both


def finish(recorder: LowerRecorder | None, records: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """Store the record of a finished run; ``manifest["direct"]`` says what became of it."""
    if recorder is None:
        return
    recorder.close()
    flow = next((r for r in records if r.get("kind") == "flow"), None)
    if flow is None or flow.get("outcome") not in ("hit", "miss"):
        manifest["direct"] = {"record": "none", "reason": "the flow step was not cached"}
        return
    from .cache.tiers import open_store

    try:
        store = open_store(recorder.settings)
    except LowercacheError:
        return
    try:
        _store_record(recorder, store, flow, manifest)
    finally:
        store.close()


def _store_record(recorder: LowerRecorder, store: Any, flow: dict[str, Any], manifest: dict[str, Any], how: str = "") -> None:
    """Store the record this run made, judged by the one confirm rule. ``how``: a background confirmation's note; it
    stores only a settled record (confirmed, or untrusted for good: another flow key). A record of changed inputs, or one
    the background run refused (it ran where no command did: output to /dev/null, long after), waits for a run that
    lowers: stored, the refusal would drop the record, and the next run would record afresh instead of confirming."""
    request = recorder.request
    inputs = recorder.inputs()
    ident = identity(recorder.settings, recorder.initial_env)
    record = {
        "version": RECORD_VERSION,
        "request": {"model": request.model, "target": request.target, "per_tensor": request.per_tensor, "calibration": request.calibration},
        "identity": ident,
        "inputs": inputs,
        "recorded_ns": time.time_ns(),
        "flow": {"name": flow["name"], "key": flow["key"]},
        "manifest": {k: v for k, v in manifest.items() if k in _KEPT_MANIFEST},
    }
    key = request.key()
    old = _load(store, key)
    changed = judged_once(lambda previous: _changed(previous, request, recorder.settings, recorder.syspath, recorder.initial_env))
    found = verdict(
        old,
        changed,
        recorder.unrecordable,
        lambda previous: previous.get("flow", {}).get("key") == record["flow"]["key"],
        WORDS,
        request.root,
    )
    if how:
        if found.status != "confirmed" and not found.for_good:
            manifest["direct"] = {"record": "unconfirmed", "reason": found.reason}
            return
        found = dataclasses.replace(found, reason=f"{found.reason} ({how})")
    found.stamp(record)
    record["earlier"] = kept_earlier(old, record, lambda r: r["flow"]["key"], changed, lambda flow_key, meta: store.put(
        KIND, request.earlier_key(flow_key), Entry(meta=meta)))
    store.put(KIND, key, Entry(meta=record))
    manifest["direct"] = {"record": record["status"], "reason": record["reason"]}
    if recorder.below_counts:
        manifest["backstop"] = recorder.below_counts
    _set_status(store, request, "record", record["status"], record["reason"])


_KEPT_MANIFEST = ("model", "target", "quantization", "toolchain", "speedups", "key_parts", "numerics")


# -- confirming in the background ---------------------------------------------------------------------


def confirm(args: list[str], key_of: Callable[[LowerRecorder], str | None]) -> str:
    """Settle the unconfirmed record of the ``lower`` command line ``args`` as its re-run would, without lowering.

    ``key_of(recorder)`` imports the model file and runs its factory and the export with the recorder listening,
    and gives the flow key. The warm server does this when idle (``server/loop.py``), in a child that became the
    request's client again, so the next run is a hit. The rule is the one of every confirmation (``verdict``):
    the same inputs and start-up state, the same key; another key makes the record untrusted. What became of it
    is returned for the server's log.
    """
    request = parse_lower(args)
    if request is None:
        return "not a plain lower command"
    settings = request.settings()
    if not settings.direct or settings.disable or settings.read_only:
        return "direct mode is off"
    request.check = settings.check
    from .cache.tiers import open_store

    store = open_store(settings)
    try:
        record = _load(store, request.key())
        if record is None or record.get("status") != "unconfirmed":
            return "nothing to confirm"
        syspath = Places(request.root).search_path()
        try:
            since = _changed(record, request, settings, syspath, initial_environ())
        except (ValueError, KeyError, TypeError) as e:
            return f"its record is unusable ({e})"
        if since is not None:
            return f"not confirmed: {since} since it was recorded"
        recorder = _recorder(request, settings)
        try:
            key = key_of(recorder)
        finally:
            recorder.close()
        if key is None:
            return "not confirmed: the program cannot be keyed"
        said: dict[str, Any] = dict(record["manifest"])
        _store_record(recorder, store, {"name": record["flow"]["name"], "key": key}, said, "in the background, by the warm server")
        return f"{said['direct']['record']}: {said['direct']['reason']}"
    finally:
        store.close()


# -- answering ---------------------------------------------------------------------------------------


def _load(store: Any, key: str) -> dict[str, Any] | None:
    entry = store.get(KIND, key)
    if entry is None or entry.blobs or not isinstance(entry.meta, dict) or entry.meta.get("version") != RECORD_VERSION:
        return None
    return entry.meta


def _status_name(request: Request, which: str) -> str:
    return f"direct/{which}/{request.target.strip().lower()}/{request.history_name()}"


def _set_status(store: Any, request: Request, which: str, outcome: str, reason: str) -> None:
    """``which``: ``lookup`` (what the latest run's lookup found) or ``record`` (what the latest record became)."""
    put_status(store, _status_name(request, which), outcome, reason)



def _changed(
    record: dict[str, Any], request: Request, settings: Settings, syspath: list[list[str]], environ: dict[str, str] | Any
) -> str | None:
    """What differs between the record and now, or None when every recorded input is the same.

    ``syspath`` and ``environ``: the module search path and environment the process started with.
    """
    _check_shape(record)
    why = identity_changed(record.get("identity"), identity(settings, environ))
    if why is not None:
        return why
    inputs = record["inputs"]
    if inputs["syspath"] != syspath:
        return "the module search path changed"
    return inputs_changed(inputs, Places(request.root), record["recorded_ns"], request.cwd, environ)



def _elsewhere(record: dict[str, Any], request: Request, settings: Settings) -> str | None:
    """Why the record cannot answer in this project's directory (``record/trust.py``'s rule), or None."""
    _check_shape(record)
    return elsewhere(record["inputs"]["location"], request.root, settings.portable_records, WORDS)


def _check_shape(record: dict[str, Any]) -> None:
    """A record read from a store is checked field by field before any of it is used."""
    flow = record.get("flow")
    if not (
        isinstance(flow, dict)
        and isinstance(flow.get("key"), str)
        and isinstance(record.get("recorded_ns"), int)
        and isinstance(record.get("manifest"), dict)
    ):
        raise ValueError("the record is malformed")
    check_inputs(record.get("inputs"))



def serve(args: list[str]) -> int | None:
    """Answer ``lowercache lower`` from a direct record: the exit code, or None to run the normal path.

    Runs before anything imports torch. Any doubt (no record, a changed
    input, an untrusted record, a missing or corrupt entry, a bad record) is
    None: the normal path then lowers, and records afresh.
    """
    keep_initial_environ()
    request = parse_lower(args)
    if request is None:
        return None
    started = time.perf_counter()
    from .errors import show_warnings_in_one_line

    show_warnings_in_one_line()
    try:
        settings = request.settings()
        if not settings.direct or settings.disable:
            return None
        request.check = settings.check
        min_snr = request.snr_floor()
        resolve(request.target)
        check_output_dir(request.out_dir)
        from .cache.tiers import open_store

        store = open_store(settings)
    except (LowercacheError, ValueError):
        return None  # the normal path reports it, in its words
    try:
        return _answer(request, settings, store, started, min_snr)
    finally:
        store.close()



def lookup(request: Request, settings: Settings, store: Any, environ: dict[str, str] | None = None) -> tuple[dict[str, Any], Entry] | str:
    """The record and flow entry that would answer ``request`` in this process now, or why none would.

    ``environ``: the environment the command started with (default: as :func:`serve` took it).
    """
    latest = _load(store, request.key())
    if latest is None:
        return "no record"
    environ = environ if environ is not None else initial_environ()
    syspath: list[list[str]] = []
    record, why = latest, _why_not(latest, request, settings, syspath, environ)
    if why is not None:  # an earlier record may answer: the inputs went back to ones lowered before

        def load(flow_key: str) -> dict[str, Any] | None:
            found = _load(store, request.earlier_key(flow_key))
            return found if found is not None and isinstance(found.get("flow"), dict) and found["flow"].get("key") == flow_key else None

        found, said = from_earlier(latest, load, lambda r: _why_not(r, request, settings, syspath, environ))
        record, why = (found, None) if found is not None else (latest, why + said)
    if why is not None:
        return why
    flow = store.get("flow", record["flow"]["key"])
    if flow is None:
        return "its flow entry is missing or corrupt"
    return record, flow


def _why_not(record: dict[str, Any], request: Request, settings: Settings, syspath: list[list[str]], environ: Any) -> str | None:
    """Why ``record`` cannot answer ``request`` now, or None. ``syspath``: the search path, found on first need (an
    empty list until then, filled in place)."""
    try:
        if record.get("status") != "confirmed":
            return f"the record is {record.get('status')}: {record.get('reason')}"
        why = _elsewhere(record, request, settings)
        if why is not None:
            return why
        if not syspath:
            syspath.extend(Places(request.root).search_path())
        return _changed(record, request, settings, syspath, environ)
    except (ValueError, KeyError, TypeError) as e:
        return f"the record is unusable ({e})"


def _answer(request: Request, settings: Settings, store: Any, started: float, min_snr: float | None = None) -> int | None:
    found = lookup(request, settings, store)
    checked = None
    if not isinstance(found, str) and request.check:
        checked = numerics_report.stored(store, found[0]["manifest"].get("numerics"), found[0]["flow"]["key"], request.check)
        found = found if checked is not None else "its numerics check is not stored"
    if isinstance(found, str):
        if found != "no record":
            _set_status(store, request, "lookup", "not used", found)
        return None
    record, flow = found
    tier = store.last_tier
    seconds = time.perf_counter() - started
    manifest = _manifest(record, flow, tier, seconds)
    manifest.pop("numerics", None)
    if checked is not None:
        manifest["numerics"] = checked[0]
        manifest["step_counts"]["check"] = {"hit": 1}
        if "layers" in checked[0]:
            manifest["step_counts"]["layers"] = {"hit": 1}
    manifest["model"] = request.history_name()  # this checkout's path, not the recording one's
    remote = getattr(store, "remote", None)
    if remote is not None:
        manifest["remote"] = remote.stats()
    try:
        written = write_files(flow.blobs, manifest, request.out_dir)
    except LowercacheError as e:
        print(f"lowercache: error: {e}", file=sys.stderr)
        return 2
    _set_status(store, request, "lookup", "hit", f"served from the record (flow entry {record['flow']['key'][:12]}, {tier} tier)")
    _count(store, request, record, flow, seconds, checked is not None, checked is not None and "layers" in checked[0])
    said = _report(request, manifest, written, seconds, min_snr)
    if said.short is not None:
        print(f"lowercache: error: {said.short}", file=sys.stderr)
        return 1
    return 0


def _manifest(record: dict[str, Any], flow: Entry, tier: str, seconds: float) -> dict[str, Any]:
    step = {"kind": "flow", "name": record["flow"]["name"], "outcome": "hit", "key": record["flow"]["key"],
            "parts": record["manifest"].get("key_parts", {}), "seconds": round(seconds, 4), "saved": round(max(flow.cost - seconds, 0.0), 4),
            "output": flow.digest(), "note": "direct", "tier": tier, "nodes": {}}
    return {
        **record["manifest"],
        "stages": {"direct": round(seconds, 4)},
        "steps": [step],
        "step_counts": {"flow": {"hit": 1}},
        "nodes": {},
        "passes": [],
        "files": {name: {"size": len(data), "xxh3_128": digest(data)} for name, data in sorted(flow.blobs.items())},
        "direct": {"outcome": "hit", "torch_imported": "torch" in sys.modules},
        **({"delegation": flow.meta["delegation"]} if "delegation" in flow.meta else {}),
    }


def _count(store: Any, request: Request, record: dict[str, Any], flow: Entry, seconds: float, checked: bool = False,
           layers: bool = False) -> None:
    """Counters and run history, as a flow hit of the normal path would leave them."""
    from .cache import history

    store.add_counts({"flow": {"hit": 1}, "direct": {"hit": 1}, **({"check": {"hit": 1}} if checked else {}),
                      **({"layers": {"hit": 1}} if layers else {})}, max(flow.cost - seconds, 0.0))
    step = {"kind": "flow", "name": record["flow"]["name"], "outcome": "hit", "key": record["flow"]["key"],
            "parts": record["manifest"].get("key_parts", {}), "seconds": seconds}
    history.record_run(store, request.history_name(), record["flow"]["name"], [step])


def command_seconds() -> float | None:
    """Seconds since this process started (``/proc/self/stat``), as a shell's ``time`` counts the command; None off Linux.

    Said instead of the time since the record was looked up, which leaves out
    the interpreter's start and lowercache's imports: most of a hit.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            started = int(f.read().rsplit(b") ", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _report(request: Request, manifest: dict[str, Any], written: list[Path], seconds: float, min_snr: float | None) -> Report:
    """Print what a hit says (as a full lowering's report, with the line on direct mode for its table) and return it."""
    took = command_seconds()
    run = run_summary(manifest, request.out_dir, written, flow="hit", direct="hit", step_counts=manifest["step_counts"],
                      seconds=round(seconds, 4), saved_seconds=manifest["steps"][0]["saved"])
    said = report(run, estimates.outcome(manifest.get("delegation"), Path(request.out_dir), request.target), manifest.get("numerics"),
                  written, request.out_dir, min_snr)
    print(f"lowercache: direct mode: served from the record, no factory run{f' ({took:.2f} s)' if took is not None else ''}",
          file=sys.stderr)
    for line in said.lines:
        print(f"lowercache: {line}", file=sys.stderr)
    print(json.dumps(said.summary, indent=2, sort_keys=True) if request.as_json else said.wrote)
    return said


# -- what a record names (``lowercache watch`` polls it) ----------------------------------------------


def recorded_files(model: str, target: str, per_tensor: bool, calibration: str | None, settings: Settings,
                   system_config: str | None = None, memory_mode: str | None = None) -> list[str]:
    """The files the latest record of this ``lower`` says its factory read, outside site-packages and lowercache.

    That is the model file, the project's modules it imported and the files
    it opened: what a re-lowering would see change. Empty when there is no
    record (direct mode off, caching disabled, nothing recorded yet) or it
    cannot be read.
    """
    from .cache.tiers import open_store

    request = Request(model=model, target=target, out_dir="", per_tensor=per_tensor, calibration=calibration,
                      system_config=system_config, memory_mode=memory_mode, check=settings.check)
    try:
        store = open_store(settings)
    except LowercacheError:
        return []
    if store is None:
        return []
    try:
        record = _load(store, request.key())
    finally:
        store.close()
    if record is None:
        return []
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    try:
        _check_shape(record)
        places = Places(request.root)
        paths = {places.path(ref) for ref, state in record["inputs"]["files"] if ref[0] in ("root", "abs") and state.get("kind") == "file"}
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(p for p in paths if not p.startswith(package))


# -- explain -----------------------------------------------------------------------------------------


def explain(store: Any, model: str, target: str) -> list[str]:
    """What direct mode did with the latest ``lower`` of MODEL on a target, and why."""
    request = Request(model=model, target=target, out_dir="")
    lines = status_lines(store, lambda which: _status_name(request, which), "direct mode, ") or ["direct mode: no record of this model yet"]
    return [*lines, f"direct mode {UNSEEN}"]

