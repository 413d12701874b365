"""The phases of a lowering as ``lower`` shows them: a counter at a terminal, a line each in a log, the table at the end.

The flow says which stage starts (``export``, ``hash``, ``quantize``,
``to_edge``, ``to_executorch``, the checks) and which cached step starts
and ends. Each phase is timed here, from its start to the next one's (the
lookup of the whole lowering counts to ``cache lookup``), so the counter,
the log lines and the table say the same names and the same seconds, and
the table's total is the sum of its rows. The cached steps are said by the
phase they ran in; ``-v`` adds every step, and the passes, observers and
decompositions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from .output import STEP_WORDS, counted, served

# Stage names as the flow gives them, and as a user reads them (ExecuTorch's own API names where it has one).
NAMES = {"load": "load the model", "export": "export", "backend": "import the backend", "hash": "cache lookup",
         "quantize": "quantize", "to_edge": "to_edge",
         "to_executorch": "to_executorch", "check": "numerics check", "layers": "per-layer check"}
# The phase each kind of cached step runs in.
PHASE_OF = {"reexport": "export", "flow": "hash", "quantize": "quantize", "tosa": "to_edge", "vela": "to_edge", "xnnpack": "to_edge", "regions": "to_edge",
            "check": "check", "reference": "check", "layers": "layers"}


def planned(quantized: bool, check: str) -> list[str]:
    """The phases a cold lowering runs, in order: what the counter counts to."""
    return ["load", "export", "hash", "backend", *(["quantize"] if quantized else []), "to_edge", "to_executorch",
            *(["check"] if check else []), *(["layers"] if check == "layers" else [])]


@dataclass
class Phases:
    """Times each phase and says it: ``say(line)`` for a log (one line per finished phase), ``show(text)`` for a terminal's
    status (the running phase, and the step inside it)."""

    plan: list[str]
    say: Callable[[str], None] | None = None
    show: Callable[[str], None] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    running: str = ""
    started: float = 0.0
    backend: str = ""  # the ExecuTorch backend the lowering imports, as its family names it ("Arm", "XNNPACK")

    def label(self, name: str) -> str:
        """How a user reads phase ``name``: the backend's import names the backend."""
        return f"import the {self.backend} backend" if name == "backend" and self.backend else NAMES.get(name, name)

    def counter(self, name: str) -> str:
        index = self.plan.index(name) + 1 if name in self.plan else len(self.seconds) + 1
        return f"[{index}/{max(len(self.plan), index)}] {self.label(name)}"

    def begin(self, name: str) -> None:
        self.end()
        self.running, self.started = name, time.perf_counter()
        if self.show is not None:
            self.show(self.counter(name))

    def end(self) -> None:
        """The running phase is over: its time kept, and said in a log."""
        if not self.running:
            return
        took = time.perf_counter() - self.started
        self.seconds[self.running] = self.seconds.get(self.running, 0.0) + took
        if self.say is not None:
            self.say(f"{self.counter(self.running)}: {took:.2f} s")
        self.running = ""

    def listener(self, phase: str, record: Any, label: str) -> None:
        """The flow's listener: a stage starts, or a cached step (shown beside its phase at a terminal)."""
        if phase == "stage":
            self.begin(label)
        elif phase == "start" and self.show is not None and self.running:
            kind, _, name = label.partition(": ")
            self.show(f"{self.counter(self.running)}: {STEP_WORDS.get(kind, kind)}, {name}")


def table(phases: Phases, records: list[dict[str, Any]], verbose: bool) -> tuple[Table, str]:
    """The table at the end, its rows the phases in the order they ran, and the line under it (total, work saved)."""
    from .cache.steps import BULK_KINDS, listed, outcome_counts

    steps = listed(records)
    grid = Table(title="lowercache: where the time went")
    for column, justify in (("phase", "left"), ("seconds", "right"), ("from the cache", "left"), ("saved", "right")):
        grid.add_column(column, justify=justify)  # type: ignore[arg-type]
    for name, seconds in phases.seconds.items():
        mine = [r for r in steps if PHASE_OF.get(r["kind"], "to_edge") == name]
        saved = sum(r["saved"] for r in mine if r["outcome"] == "hit")
        grid.add_row(phases.label(name), f"{seconds:.2f}", _outcomes(mine), f"{saved:.2f}" if saved else "")
        for r in mine if verbose else ():
            grid.add_row(f"  {r['kind']}: {r['name']}", f"{r['seconds']:.2f}", r["outcome"], f"{r['saved']:.2f}" if r["saved"] else "")
    for kind in sorted(BULK_KINDS) if verbose else ():  # passes, observers, decompositions: internals
        bulk = [r for r in records if r["kind"] == kind]
        if bulk:
            counts = ", ".join(f"{n} {o}" for o, n in sorted(outcome_counts(bulk)[kind].items()))
            grid.add_row(f"  {kind}: {counted(len(bulk), 'step')}", f"{sum(r['seconds'] for r in bulk):.2f}", counts,
                         f"{sum(r['saved'] for r in bulk):.2f}")
    total = sum(phases.seconds.values())
    saved = sum(r["saved"] for r in records if r["outcome"] == "hit")
    line = f"total {total:.2f} s" + (f"; {saved:.2f} s of work served from the cache" if saved else "")
    return grid, line


def _outcomes(records: list[dict[str, Any]]) -> str:
    """``TOSA: 2 hits, 1 miss; Vela: 1 miss`` for a phase's cached steps (a lone step: ``re-export: hit``)."""
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        counts.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        counts[r["kind"]][r["outcome"]] += 1
    return served(counts)


def progress(console: Console, plan: list[str], backend: str = "") -> Any:
    """A context giving the :class:`Phases` of one lowering (through ``backend``'s family): a spinner with the counter at
    a terminal, plain lines in a log."""
    import contextlib

    @contextlib.contextmanager
    def shown() -> Any:
        if not console.is_interactive:  # a log, or a terminal that cannot redraw (TERM=dumb)
            import sys

            phases = Phases(plan, say=lambda line: print(f"lowercache: {line}", file=sys.stderr, flush=True), backend=backend)
            yield phases  # a phase that fails is not said to end: its error line follows
            phases.end()
            return
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from .record.recorder import own_thread

        before = set(threading.enumerate())
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            for thread in set(threading.enumerate()) - before:  # rich's redraw thread, started by entering: ours, not the factory's
                thread.name = "lowercache-progress"
                own_thread(thread)
            task = bar.add_task(NAMES["load"], total=None)
            phases = Phases(plan, show=lambda text: bar.update(task, description=text), backend=backend)
            yield phases
            phases.end()

    return shown()
