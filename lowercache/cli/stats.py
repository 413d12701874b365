"""``lowercache stats``: the cache's figures as ``ccache -s`` and ``sccache --show-stats`` give theirs.

Where the cache is, its size against its limit, when the counters were last
set to zero, what the lowerings were (served whole from the cache, by direct
mode, lowered), what could not be cached, what failed, the work saved, then
the hit rate of each kind of step in a user's words. ``-v`` adds the
internal steps (passes, observers, decompositions) and every outcome.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from ..cache.steps import BULK_KINDS
from ..output import STEP_WORDS, counted

OUTCOMES = ("hit", "remote_hit", "miss", "skip", "bypass", "noop", "ran")


def figures(store: Any, max_size: int) -> dict[str, Any]:
    """Every figure, as ``stats --json`` prints them."""
    counters = store.counters()
    kinds = sorted({k.split("/")[1] for k in counters if k.startswith("count/")} - {"failed"})
    entries = store.entry_count()
    count = lambda kind, outcome: counters.get(f"count/{kind}/{outcome}", 0)  # noqa: E731
    return {
        "cache_dir": str(store.directory),
        "steps": entries["actions"],
        "blobs": entries["blobs"],
        "bytes": store.volume(),
        "max_bytes": max_size,
        "zeroed": store.zeroed_at(),
        "saved_seconds": counters.get("saved_ms", 0) / 1000,
        "lowerings": {"served": count("flow", "hit"), "direct": count("direct", "hit"), "lowered": count("flow", "miss"),
                      "uncacheable": count("flow", "bypass")},
        "failed": {"input": count("failed", "input"), "lowering": count("failed", "lowering")},
        "outcomes": {kind: {o: count(kind, o) for o in OUTCOMES} for kind in kinds},
    }


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary(found: dict[str, Any]) -> list[str]:
    """The lines above the table, ``name  value``, each short of 80 columns but for the directory."""
    lowerings = found["lowerings"]
    done = lowerings["served"] + lowerings["lowered"] + lowerings["uncacheable"]
    failed = found["failed"]
    share = f" ({100 * found['bytes'] / found['max_bytes']:.0f}%)" if found["max_bytes"] else ""
    rows = [
        ("cache directory", found["cache_dir"]),
        ("size", f"{_size(found['bytes'])} of {_size(found['max_bytes'])}{share}; "
                 f"{counted(found['steps'], 'step')}, {counted(found['blobs'], 'blob')}"),
        ("counters zeroed", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found["zeroed"])) if found["zeroed"] else "never"),
        ("lowerings", f"{done}: {lowerings['served']} served from the cache ({lowerings['direct']} by direct mode), "
                      f"{lowerings['lowered']} lowered"),
        ("uncacheable", f"{lowerings['uncacheable']} (lowered without a key: nothing stored)"),
        ("errors", f"{failed['input'] + failed['lowering']} ({failed['input']} in the input, "
                   f"{failed['lowering']} inside torch or ExecuTorch)"),
        ("work saved", f"{found['saved_seconds']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}" for name, value in rows]


def table(found: dict[str, Any], verbose: bool) -> Table:
    """Hits, misses and hit rate by kind of step, in a user's words; ``verbose``: every kind and every outcome."""
    outcomes = found["outcomes"]
    remote = any(n["remote_hit"] for n in outcomes.values())
    shown = OUTCOMES if verbose else ("hit", *(("remote_hit",) if remote else ()), "miss")
    heads = {"hit": "hits", "remote_hit": "remote", "miss": "misses", "skip": "skip", "bypass": "bypass", "noop": "noop", "ran": "ran"}
    grid = Table(title="by kind of step")
    grid.add_column("step")
    for outcome in shown:
        grid.add_column(heads[outcome], justify="right")
    grid.add_column("hit rate", justify="right")
    kinds = [k for k in STEP_WORDS if k in outcomes] + sorted(k for k in outcomes if k not in STEP_WORDS and (verbose or k not in BULK_KINDS))
    for kind in kinds:
        if kind == "direct":
            continue  # said above: its hits are the lowerings direct mode served
        n = outcomes[kind]
        looked = n["hit"] + n["miss"]
        grid.add_row(STEP_WORDS.get(kind, kind), *(str(n[o]) for o in shown), f"{100 * n['hit'] / looked:.0f}%" if looked else "-")
    return grid
