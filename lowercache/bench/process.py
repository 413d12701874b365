"""The process-level scenario (``--scenarios process``): whole commands in new processes, as a shell times them.

A user runs ``lowercache lower`` as a new process, so what they feel is fork to exit: interpreter start-up,
imports, the server or direct mode, writing the files. The in-process scenarios see none of that (the
benchmark note's scenario 7). Each cell here is one command's wall time, from the harness's fork to the
command's exit, for each phase (cold, warm, one block's structure, one block's weights, the last edit undone)
and each way of running:

- the stock script (``stockscript.py``) in a new process, copied into the project directory so that no
  lowercache code is on its import path;
- ``lowercache lower --no-server`` with direct mode off;
- ``lowercache lower`` through a warm server, direct mode off;
- for Ethos-U targets, the same through a second warm server started with ``LOWERCACHE_SPEEDUPS=all,regions``
  (region replay, docs/regions.md), client and server alike;
- ``lowercache lower`` as installed (direct mode on, server on): a warm hit is answered by direct mode, which
  imports no torch and never asks the server;
- the same at a terminal: an 80x24 pseudo-terminal as the command's stdin, stdout and stderr, ``TERM`` set and
  ``COLUMNS`` not, as a person runs it (the other columns run from a pipe, as a script or CI does);
- for the warm phase, a hit from a shared Redis (``redis-server`` on a loopback port) into an empty local cache:
  direct mode, and with ``--no-direct`` a flow hit that imports torch.

Each repetition starts from nothing: a project directory whose ``model.py`` is ``models.py`` followed by a
factory for one benchmark model (an edit rewrites its last line, as a user edits a file), empty caches, a
private socket directory per server (each started once per repetition, its start-up timed on its own),
an empty config file, and a copy of lowercache's sources on ``PYTHONPATH``: an edit to the checkout meanwhile
would otherwise make the server stale (replaced mid-figure) and change direct mode's toolchain digest.
The edit phases start from a copy of each cache as the warm phase left it; ``undo`` writes the base model back and
lowers into the cache the last edit phase left. Every ``.pte`` is compared byte for byte with the stock script's for
the same model and phase.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import select
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..speedups import registry
from ..targets import resolve
from . import stockscript
from .redisserver import RedisServer

HERE = Path(__file__).resolve().parent

PHASES: tuple[str, ...] = ("cold", "warm", "edit-structure", "edit-weights", "undo")
"""What the measured command sees: an empty cache, nothing changed, one block's structure, one block's weights, and
the last edit undone (the base model again, in the cache the edit left)."""

EDITS: dict[str, str | None] = {"cold": None, "warm": None, "edit-structure": "structure", "edit-weights": "weights",
                                "undo": None}

STOCK = "stock script"


@dataclass(frozen=True)
class Mode:
    """One way of running ``lowercache lower``: its column, extra flags and environment, and which phases it runs."""

    name: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    remote: bool = False  # a Redis row: warm only, each run into an empty local cache
    server: str = ""  # which of the repetition's servers it talks to ("": the default one)
    family_speedup: str = ""  # a column only for the families this speed-up acts on (regions: Ethos-U targets only)
    terminal: bool = False  # run at a pseudo-terminal, not from a pipe


MODES: tuple[Mode, ...] = (
    Mode("--no-server", ("--no-server",), {"LOWERCACHE_DIRECT": "0"}),
    Mode("warm server", (), {"LOWERCACHE_DIRECT": "0", "LOWERCACHE_SERVER": "1"}),
    Mode(
        "warm server, regions", (), {"LOWERCACHE_DIRECT": "0", "LOWERCACHE_SERVER": "1", "LOWERCACHE_SPEEDUPS": "all,regions"},
        server="regions", family_speedup="regions",
    ),
    Mode("direct mode", (), {"LOWERCACHE_SERVER": "1"}),
    Mode("at a terminal", (), {"LOWERCACHE_SERVER": "1", "TERM": "xterm-256color"}, terminal=True),
    Mode("Redis, direct", ("--no-server",), {}, remote=True),
    Mode("Redis, --no-direct", ("--no-server", "--no-direct"), {}, remote=True),
)
"""The lowercache columns, in report order (the stock script is the first column)."""

MODE_NOTES: dict[str, str] = {
    "--no-server": "`lowercache lower --no-server`, LOWERCACHE_DIRECT=0: one process, torch imported",
    "warm server": "`lowercache lower` through a warm server (LOWERCACHE_DIRECT=0); the client imports no torch",
    "warm server, regions": "the same through a warm server of its own, client and server with "
    "LOWERCACHE_SPEEDUPS=all,regions (region replay, Ethos-U targets only)",
    "direct mode": "`lowercache lower` as installed: direct mode on, server on; a warm hit is answered by direct "
    "mode without torch and without the server (the first re-run after a lowering confirms the record: "
    "`warm, first re-run`)",
    "at a terminal": "the same at an 80x24 pseudo-terminal (stdin, stdout and stderr), TERM=xterm-256color, no "
    "COLUMNS: as a person runs it; its own cache, the default server",
    "Redis, direct": "an empty local cache served from a shared Redis (LOWERCACHE_REMOTE, LOWERCACHE_HMAC_KEY), "
    "`--no-server`, direct mode on, after one lowering and one re-run elsewhere filled and confirmed it",
    "Redis, --no-direct": "the same, `--no-server --no-direct`: a remote flow hit, torch imported",
}

REPORT_PHASES: tuple[str, ...] = ("cold", "warm-first", "warm", "edit-structure", "edit-weights", "undo")
PHASE_LABELS: dict[str, str] = {
    "cold": "cold",
    "warm-first": "warm, first re-run",
    "warm": "warm (unchanged)",
    "edit-structure": "one block edited (structure)",
    "edit-weights": "one block's weights",
    "undo": "the edit undone",
}


def modes_for(target: str) -> tuple[Mode, ...]:
    """The lowercache columns that apply to ``target``."""
    family = resolve(target).family.name
    return tuple(m for m in MODES if not m.family_speedup or registry.applies(m.family_speedup, family))


def model_source(model: str, edit: str | None) -> str:
    """``model.py``: the benchmark's model builders and a factory for ``model``, the edit on the last line."""
    return (HERE / "models.py").read_text() + f"\n\ndef model():\n    return MODELS[{model!r}](edit=EDIT)\n\n\nEDIT = {edit!r}\n"


def lowercache_command() -> list[str]:
    """``lowercache`` as a user types it: the console script beside this interpreter (no pyenv shim in front)."""
    script = Path(sys.executable).with_name("lowercache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lowercache.cli"]


def at_a_terminal(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 7200,
                  size: tuple[int, int] = (80, 24)) -> tuple[int, str, float]:
    """Run ``cmd`` with a pseudo-terminal of ``size`` (columns, rows) as its stdin, stdout and stderr, in a session of
    its own: its exit code, everything it showed and its wall seconds, start to exit. The exit is timed by a thread that waits for it, not by the terminal closing:
    a process the command started (the server) may hold the terminal open."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    start = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=follower, stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    ended: list[float] = []
    waiter = threading.Thread(target=lambda: (process.wait(), ended.append(time.perf_counter())), daemon=True)
    waiter.start()
    shown = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(leader, 1 << 16)
                except OSError:  # the terminal's other side closed: the command has exited
                    break
                if not chunk:
                    break
                shown += chunk
            elif ended:
                break  # exited, and nothing more to read
            elif time.perf_counter() - start > timeout:
                process.kill()
                raise subprocess.TimeoutExpired(cmd, timeout, output=shown)
        waiter.join(timeout=60)
        return process.wait(timeout=60), shown.decode("utf-8", "replace"), ended[0] - start
    finally:
        os.close(leader)


def timed(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 7200, terminal: bool = False) -> float:
    """Wall seconds of one command, fork to exit, from a pipe or at a pseudo-terminal; a failure stops the benchmark
    with the command's last words.

    lowercache's warnings are passed on: a damaged or unwritable cache recomputes, so the figure is not what it seems.
    """
    if terminal:
        code, said, seconds = at_a_terminal(cmd, env, cwd, timeout)
        said = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", said)  # colour and cursor codes
    else:
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        code, said, seconds = done.returncode, done.stderr, time.perf_counter() - start
    if code:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}): {said[-2000:]}")
    for line in said.splitlines():
        if line.startswith("lowercache: warning:"):
            print(f"note: {seconds:.2f} s of `{' '.join(cmd[-3:])}` in {cwd.name}: {line}", file=sys.stderr, flush=True)
    return seconds


def served(out: Path) -> str:
    """How a lowering was served, from its manifest: ``direct hit``, or the flow step's outcome (and remote tier), and
    what region replay did (each partition's ``regions`` outcome, and how many regions were served from the cache)."""
    manifest = json.loads((out / "manifest.json").read_text())
    steps = manifest.get("steps", [])
    flow = next((s for s in steps if s.get("kind") == "flow"), {})
    tier = " (remote)" if flow.get("tier") == "remote" else ""
    if manifest.get("direct", {}).get("outcome") == "hit":
        torch = ", torch imported" if manifest["direct"].get("torch_imported") else ""
        return f"direct hit{tier}{torch}"
    text = f"flow {flow.get('outcome', '?')}{tier}"
    replay = [s.get("outcome", "?") for s in steps if s.get("kind") == "regions"]
    if replay:
        hits = sum(1 for s in steps if s.get("kind") == "region" and s.get("outcome") == "hit")
        text += "; regions " + ", ".join(replay) + (f", {hits} served" if hits else "")
    return text


class _Repetition:
    """One repetition's directories, environments and server, and what its commands measured."""

    def __init__(self, model: str, target: str, root: Path, run_dirs: dict[str, Path]):
        self.model, self.target, self.root = model, target, root
        self.modes = modes_for(target)
        self.run_dirs = run_dirs
        self.project = root / "project"
        self.project.mkdir(parents=True)
        (self.project / "export.py").write_text(stockscript.source())
        src = root / "src"
        shutil.copytree(HERE.parent, src / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
        (root / "config.toml").write_text("")
        user = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
        self.stock_env = user
        path = os.pathsep.join(p for p in (str(src), user.get("PYTHONPATH", "")) if p)
        self.env = {
            **user,
            "PYTHONPATH": path,
            "LOWERCACHE_CONFIG": str(root / "config.toml"),
            "LOWERCACHE_SERVER_IDLE_TIMEOUT": "7200",
        }
        self.lc = lowercache_command()
        self.seconds: dict[tuple[str, str], float] = {}
        self.equal: dict[tuple[str, str], bool] = {}
        self.served: dict[tuple[str, str], str] = {}
        self.flow_seconds: dict[tuple[str, str], float] = {}
        self.stock_pte: dict[str, bytes] = {}

    def write_model(self, edit: str | None) -> None:
        """Rewrite ``model.py`` only when its text changes: an unchanged file keeps its stat, as a user's would."""
        path, text = self.project / "model.py", model_source(self.model, edit)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

    def stock(self, phase: str) -> None:
        out = self.root / f"stock-{phase}.pte"
        cmd = [sys.executable, "export.py", "model.py:model", self.target, str(out)]
        self.seconds[(phase, STOCK)] = timed(cmd, self.stock_env, self.project)
        self.stock_pte[phase] = out.read_bytes()

    def lower(self, phase: str, mode: Mode, cache: Path, extra_env: dict[str, str] | None = None) -> float:
        """One timed ``lowercache lower`` into its own output directory; its bytes checked against the stock phase's."""
        out = self.root / "out" / f"{mode.name}-{phase}".replace(" ", "_").replace(",", "")
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*self.lc, "lower", "model.py:model", "-t", self.target, "-o", str(out), *mode.args]
        env = {**self.env, **mode.env, **(extra_env or {}), "LOWERCACHE_DIR": str(cache),
               "XDG_RUNTIME_DIR": str(self.run_dirs[mode.server])}
        if mode.terminal:  # a terminal's size is its own; a person rarely exports it
            env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
        seconds = timed(cmd, env, self.project, terminal=mode.terminal)
        stock_phase = phase if phase.startswith("edit") else "cold"  # warm and the Redis runs lower the base model
        self.seconds[(phase, mode.name)] = seconds
        self.equal[(phase, mode.name)] = (out / "model.pte").read_bytes() == self.stock_pte[stock_phase]
        self.served[(phase, mode.name)] = served(out)
        self.flow_seconds[(phase, mode.name)] = sum(json.loads((out / "manifest.json").read_text())["stages"].values())
        return seconds

    def server(self, action: str, name: str = "") -> float:
        """Start or stop one of the repetition's servers, in the environment of the modes that talk to it; one is
        started warm for the target's family, as a server that has served it is (docs/server.md, Lifecycle)."""
        own = next((m.env for m in self.modes if m.server == name), {}) if name else {}
        env = {**self.env, **own, "LOWERCACHE_SERVER": "1", "XDG_RUNTIME_DIR": str(self.run_dirs[name])}
        warm_for = ["--target", self.target] if action == "start" else []
        return timed([*self.lc, "server", action, *warm_for], env, self.project)

    def cache(self, mode: Mode) -> Path:
        return self.root / "cache" / mode.name.replace(" ", "_")


def _local_phases(rep: _Repetition, phases: list[str], log: Callable[[str], None]) -> None:
    """Stock and every local mode through the phases; the edit phases start from the caches the warm phase left."""
    local = [m for m in rep.modes if not m.remote]
    seeds: dict[str, Path] = {}
    for phase in (p for p in PHASES if p == "cold" or p in phases):
        rep.write_model(EDITS[phase])
        if phase.startswith("edit"):
            for mode in local:
                seed = seeds.setdefault(mode.name, rep.root / "seed" / mode.name.replace(" ", "_"))
                if not seed.exists():
                    shutil.copytree(rep.cache(mode), seed)
                shutil.rmtree(rep.cache(mode))
                shutil.copytree(seed, rep.cache(mode))
        rep.stock(phase)
        for mode in local:
            if phase == "warm":
                rep.lower("warm-first", mode, rep.cache(mode))
            rep.lower(phase, mode, rep.cache(mode))
        shown = (phase, "warm-first") if phase == "warm" else (phase,)
        log(f"    {phase}: " + ", ".join(f"{name} {s:.2f} s" for (p, name), s in rep.seconds.items() if p in shown))


def _remote_phase(rep: _Repetition, log: Callable[[str], None]) -> str | None:
    """The Redis columns' warm cells: filled and confirmed from two other local caches, then hit from empty ones.

    Returns why it was not measured, or None.
    """
    try:
        redis = RedisServer()
    except (FileNotFoundError, RuntimeError, TimeoutError) as e:
        return str(e)
    try:
        remote = {"LOWERCACHE_REMOTE": redis.url, "LOWERCACHE_HMAC_KEY": secrets.token_hex(16)}
        rep.write_model(None)
        fill = Mode("fill", ("--no-server",))
        for step in ("fill", "confirm"):  # a lowering records, a re-run with identical inputs confirms (direct-mode.md)
            rep.lower(step, fill, rep.root / "cache" / f"redis-{step}", remote)
        for mode in (m for m in rep.modes if m.remote):
            rep.lower("warm", mode, rep.cache(mode), remote)
        log("    warm from Redis: " + ", ".join(f"{m.name} {rep.seconds[('warm', m.name)]:.2f} s" for m in rep.modes if m.remote))
    finally:
        redis.kill()
    return None


def _repetition(model: str, target: str, phases: list[str], root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Every mode through every phase in fresh directories; the server is stopped however it ends."""
    names = sorted({m.server for m in modes_for(target)})
    run_dirs = {name: Path(tempfile.mkdtemp(prefix="lcb", dir="/tmp")) for name in names}  # a socket path has ~100 bytes
    rep = _Repetition(model, target, root, run_dirs)
    try:
        starts = {name: rep.server("start", name) for name in names}
        server_start = starts[""]
        log("    server start-up " + ", ".join(f"{name or 'default'} {s:.2f} s" for name, s in starts.items()))
        _local_phases(rep, phases, log)
        remote_skipped = _remote_phase(rep, log) if "warm" in phases else "warm phase not measured"
    finally:
        for name in names:
            try:
                rep.server("stop", name)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            shutil.rmtree(run_dirs[name], ignore_errors=True)
    return {
        "seconds": rep.seconds, "equal": rep.equal, "served": rep.served, "flow_seconds": rep.flow_seconds,
        "server_start": server_start, "remote_skipped": remote_skipped,
    }


def run_case(
    model: str, target: str, repeat: int, cache_root: Path, log: Callable[[str], None], phases: list[str] | None = None
) -> dict[str, Any]:
    """Measure the process-level scenario for one (model, target): one report row, medians over ``repeat``."""
    phases = list(phases or PHASES)
    reps = []
    for i in range(repeat):
        log(f"  rep {i + 1}/{repeat}")
        root = Path(cache_root) / f"process-{model}-{target}-{i}"
        shutil.rmtree(root, ignore_errors=True)
        try:
            reps.append(_repetition(model, target, phases, root, log))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    columns = [STOCK, *(m.name for m in modes_for(target))]
    shown = [p for p in REPORT_PHASES if p in phases or (p == "warm-first" and "warm" in phases) or p == "cold"]
    seconds = {p: {c: [r["seconds"][(p, c)] for r in reps if (p, c) in r["seconds"]] for c in columns} for p in shown}
    seconds = {p: {c: v for c, v in cols.items() if v} for p, cols in seconds.items()}
    medians = {p: {c: statistics.median(v) for c, v in cols.items()} for p, cols in seconds.items()}
    stock_of = {p: medians.get("warm" if p == "warm-first" else p, {}).get(STOCK) for p in shown}  # side by side
    equal = {p: {c: [r["equal"][(p, c)] for r in reps if (p, c) in r["equal"]] for c in columns[1:]} for p in shown}
    return {
        "scenario": "process",
        "model": model,
        "target": target,
        "status": "ok",
        "phases": shown,
        "columns": columns,
        "modes": {c: MODE_NOTES[c] for c in columns[1:]},
        "seconds": seconds,
        "median": medians,
        "ratio": {
            p: {c: stock_of[p] / m for c, m in cols.items() if c != STOCK and stock_of[p]} for p, cols in medians.items()
        },
        "served": {p: {c: reps[0]["served"][(p, c)] for c in columns[1:] if (p, c) in reps[0]["served"]} for p in shown},
        "flow_seconds": {
            p: {c: statistics.median(r["flow_seconds"][(p, c)] for r in reps) for c in columns[1:] if (p, c) in reps[0]["flow_seconds"]}
            for p in shown
        },
        "bytes_equal": {p: {c: v for c, v in cols.items() if v} for p, cols in equal.items()},
        "equal": all(all(v) for cols in equal.values() for v in cols.values()),
        "server_start_seconds": [r["server_start"] for r in reps],
        "remote_skipped": reps[0]["remote_skipped"],
        "command": " ".join(lowercache_command()),
    }


def _cell(row: dict[str, Any], phase: str, column: str) -> str:
    median = row["median"].get(phase, {}).get(column)
    if median is None:
        return "–"
    if column == STOCK:
        return f"{median:.2f}"
    ratio = row["ratio"][phase].get(column)
    same = "" if all(row["bytes_equal"][phase][column]) else " **bytes differ**"
    return f"{median:.2f} ({ratio:.1f}x){same}" if ratio else f"{median:.2f}{same}"


def _share(row: dict[str, Any], phase: str, column: str) -> str:
    """``flow / rest``: seconds in lowercache's flow stages (its manifest) and outside them (start-up, imports,
    the model factory, the server round trip, writing the files)."""
    wall = row["median"].get(phase, {}).get(column)
    flow = row["flow_seconds"].get(phase, {}).get(column)
    return "–" if wall is None or flow is None else f"{flow:.2f} / {max(wall - flow, 0.0):.2f}"


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The scenario's section of ``report.md``: per (model, target) the seconds and ratios, where they go, the notes."""
    lines = [
        "Whole commands in new processes, wall seconds from fork to exit (median over the repetitions); in brackets "
        "stock script / lowercache, against the stock script run in the same phase (stock has no cache, so its warm "
        "run is another cold one). Warm rows are re-runs after the cold one; the edit rows start from the caches "
        "the warm rows left.",
        "",
    ]
    for row in rows:
        starts = ", ".join(f"{s:.2f}" for s in row["server_start_seconds"])
        local = [c for c in row["columns"][1:] if any(c in row["flow_seconds"][p] for p in row["phases"])]
        lines += [
            f"### {row['model']} {row['target']}",
            "",
            f"Server start-up (`lowercache server start`, once a repetition): {starts} s. "
            f"Every .pte equal to the stock script's: **{'yes' if row['equal'] else 'NO'}**.",
            "",
            "| phase | " + " | ".join(row["columns"]) + " |",
            "|---|" + "---:|" * len(row["columns"]),
        ]
        for phase in row["phases"]:
            lines.append(f"| {PHASE_LABELS[phase]} | " + " | ".join(_cell(row, phase, c) for c in row["columns"]) + " |")
        lines += [
            "",
            "Where lowercache's time goes, seconds in the flow's stages / outside them (interpreter start-up, "
            "imports, the model factory, the server round trip, writing the files):",
            "",
            "| phase | " + " | ".join(local) + " |",
            "|---|" + "---:|" * len(local),
        ]
        for phase in row["phases"]:
            lines.append(f"| {PHASE_LABELS[phase]} | " + " | ".join(_share(row, phase, c) for c in local) + " |")
        lines += ["", "Served (first repetition): " + "; ".join(
            f"{PHASE_LABELS[p]}: " + ", ".join(f"{c} {s}" for c, s in row["served"][p].items()) for p in row["phases"]
        ) + ".", ""]
        if row["remote_skipped"]:
            lines += [f"Redis columns not measured: {row['remote_skipped']}.", ""]
    if rows:
        lines += [f"- {name}: {note}" for name, note in rows[0]["modes"].items()]
        lines += [f"- lowercache ran as `{rows[0]['command']}`; the stock script as `python export.py model.py:model TARGET out.pte`", ""]
    return lines


def text_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The console summary: per (model, target) and phase, the median seconds of every column."""
    out = []
    for row in rows:
        out.append(f"process {row['model']} {row['target']} (server start-up {min(row['server_start_seconds']):.2f} s, "
                   f"bytes equal: {'yes' if row['equal'] else 'NO'})")
        for phase in row["phases"]:
            out.append(f"  {PHASE_LABELS[phase]:<30} " + "  ".join(f"{c} {_cell(row, phase, c)}" for c in row["columns"]))
    return out
