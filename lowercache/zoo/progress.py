"""Build progress: one line per (model, target) with its state and seconds; a live ``rich`` table on a terminal, plain lines in a CI log."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .buildfile import Pair

STYLES = {"hit": "green", "miss": "cyan", "running": "yellow", "failed": "bold red", "skipped": "dim", "waiting": "dim"}


class Progress:
    """States by pair; ``show()`` redraws the table, or prints each change as a line when not a terminal."""

    def __init__(self, pairs: list[Pair], console: Optional[Console] = None, emit: Callable[[str], None] = print) -> None:
        self.pairs = pairs
        self.console = console or Console()
        self.live_mode = self.console.is_terminal
        self.emit = emit
        self.states: dict[Pair, tuple[str, str, float, Optional[float]]] = {p: ("waiting", "", time.perf_counter(), None) for p in pairs}
        self.live: Optional[Live] = None
        self.width = max((len(p.name) for p in pairs), default=0)
        self.target_width = max((len(p.target) for p in pairs), default=0)

    def __enter__(self) -> "Progress":
        if self.live_mode:
            self.live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(*exc)

    def set(self, pair: Pair, state: str, note: str = "", seconds: Optional[float] = None) -> None:
        self.states[pair] = (state, note, time.perf_counter(), seconds)
        if self.live is not None:
            self.live.update(self._table())
        elif state != "waiting":
            timing = f" {seconds:.2f}s" if seconds is not None else ""
            self.emit(f"{pair.name:<{self.width}}  {pair.target:<{self.target_width}}  {state}{timing}{f'  {note}' if note else ''}")
            sys.stdout.flush()

    def tick(self) -> None:
        """Refresh the running pairs' elapsed seconds."""
        if self.live is not None:
            self.live.update(self._table())

    def _table(self) -> Table:
        table = Table(box=None, show_header=False, pad_edge=False)
        for column in ("model", "target", "state", "seconds", "note"):
            table.add_column(column, overflow="fold")
        now = time.perf_counter()
        for pair in self.pairs:
            state, note, since, seconds = self.states[pair]
            shown = seconds if seconds is not None else (now - since if state == "running" else None)
            table.add_row(pair.name, pair.target, f"[{STYLES.get(state, '')}]{state}[/]", "" if shown is None else f"{shown:.1f}s", Text(note))
        return table
