"""Run history per (model, target), and ``explain``: which key part changed.

Each run stores its steps' named key parts. ``explain`` takes the latest run
that missed and compares its parts with the run before it, step by step, the
way ccache's debug mode or Bazel's ``--explain`` say why an action reran.
"""

from __future__ import annotations

import time
from typing import Any

from .steps import listed
from .store import Store
from .toolchain import changed_files

KEEP_RUNS = 10


def _record_name(model: str, target: str) -> str:
    return f"history/{target}/{model}"


def record_run(store: Store, model: str, target: str, steps: list[dict[str, Any]]) -> None:
    """Append this run to the (model, target) history, keeping the last :data:`KEEP_RUNS`.

    One read-modify-write in a store transaction: runs of one model that
    finish at the same time in several processes are all kept.
    """
    run = {
        "time": time.time(),
        "steps": [{**{k: s[k] for k in ("kind", "name", "outcome", "key", "parts")}, **({"note": s["note"]} if s.get("note") else {})}
                  for s in listed(steps)],
        "passes": [
            [s["name"], s["outcome"], round(s["seconds"], 4), s.get("nodes", {})] for s in steps if s["kind"] == "pass"
        ],
    }

    def append(runs: Any) -> list[dict[str, Any]]:
        return (_well_formed(runs) + [run])[-KEEP_RUNS:]

    store.update_record(_record_name(model, target), append)


def _well_formed(runs: Any) -> list[dict[str, Any]]:
    """The runs of a stored history that have the shape ``explain`` reads; others are left out.

    A history is checked like any entry before use: one written by another
    release, or altered, must not make ``explain`` fail.
    """
    if not isinstance(runs, list):
        return []
    return [run for run in runs if _run_ok(run)]


def _run_ok(run: Any) -> bool:
    if not isinstance(run, dict) or not isinstance(run.get("steps"), list) or not isinstance(run.get("passes", []), list):
        return False
    steps_ok = all(
        isinstance(s, dict)
        and all(isinstance(s.get(k), str) for k in ("kind", "name", "outcome", "key"))
        and isinstance(s.get("parts"), dict)
        for s in run["steps"]
    )
    passes_ok = all(
        isinstance(p, list)
        and len(p) == 4
        and isinstance(p[0], str)
        and isinstance(p[1], str)
        and isinstance(p[2], (int, float))
        and isinstance(p[3], dict)
        for p in run.get("passes", [])
    )
    return steps_ok and passes_ok


def _runs(store: Store, model: str, target: str) -> list[dict[str, Any]]:
    return _well_formed(store.get_record(_record_name(model, target)))


def explain(store: Store, model: str, target: str) -> list[str]:
    """Lines saying, for the last miss, which parts changed since the run before it."""
    runs = _runs(store, model, target)
    if not runs:
        return [f"no recorded runs of {model} for {target}"]
    lines = []
    latest = runs[-1]
    # Region replay's verdicts (lowering/replay/regionsplice.py): spliced, or the full pipeline and why.
    for s in latest["steps"]:
        if s["kind"] == "regions":
            lines.append(f"TOSA pipeline by region: {s['outcome']}: {s['name']}")
            note = s.get("note")
            lines += [f"  region {verdict}" for verdict in note.split(" | ") if verdict] if isinstance(note, str) else []
    # Weights-only changes (lowering/rebind.py): what was re-bound, or why the structure's steps ran stock.
    lines += [f"rebind: {s['name']}: {s['note']}" for s in latest["steps"] if s["kind"] == "edge" and s.get("note")]
    flow = _step(latest, "flow")
    if flow is not None and flow["outcome"] == "hit":
        lines.append("the latest run was a hit: nothing changed")
    last_miss = next(
        (i for i in range(len(runs) - 1, -1, -1) if any(s["outcome"] == "miss" for s in runs[i]["steps"])),
        None,
    )
    if last_miss is None:
        return lines + ["no recorded run missed"]
    if last_miss == 0:
        return lines + ["the last miss was the first recorded run: the cache had nothing for it"]
    current = runs[last_miss]
    lines.append(f"last miss: run {last_miss + 1} of {len(runs)}, compared with the latest earlier run of each step")
    for step in current["steps"]:
        if step["outcome"] != "miss":
            continue
        # A hit of the whole flow does not run its inner steps: look further back.
        before = next(
            (found for run in reversed(runs[:last_miss]) if (found := _step(run, step["kind"], step["name"])) is not None),
            None,
        )
        label = f"{step['kind']} {step['name']}"
        if before is None:
            lines.append(f"{label}: missed; no earlier run reached this step")
            continue
        changed = sorted(k for k in set(step["parts"]) | set(before["parts"]) if step["parts"].get(k) != before["parts"].get(k))
        if not changed:
            lines.append(f"{label}: missed with the same key parts (entry evicted, corrupt or never stored)")
        else:
            named = [_with_files(k, before["parts"].get(k), step["parts"].get(k)) for k in changed]
            lines.append(f"{label}: missed; changed: {', '.join(named)}")
    return lines


def _with_files(part: str, before: Any, after: Any) -> str:
    """A toolchain source part with the files whose change took it from ``before`` to ``after`` (``executorch_src
    (exir/passes/x.py)``), when this machine saw that change."""
    files = changed_files(before, after) if part.endswith("_src") and isinstance(before, str) and isinstance(after, str) else []
    return f"{part} ({', '.join(files)})" if files else part


def _step(run: dict[str, Any], kind: str, name: str | None = None) -> dict[str, Any] | None:
    for step in run["steps"]:
        if step["kind"] == kind and (name is None or step["name"] == name):
            return step
    return None


def explain_passes(store: Store, model: str, target: str) -> list[str]:
    """Per pass of the latest run that ran passes: outcome, seconds, nodes re-traced / copied."""
    runs = _runs(store, model, target)
    index = next((i for i in range(len(runs) - 1, -1, -1) if runs[i].get("passes")), None)
    if index is None:
        return [f"no recorded run of {model} for {target} ran a pass (a flow hit runs none)"]
    passes = runs[index]["passes"]
    lines = [f"passes of run {index + 1} of {len(runs)}, in pipeline order", f"{'pass':<44} {'outcome':<7} {'seconds':>8} {'retraced':>9} {'copied':>7} {'fast':>6}"]
    for name, outcome, seconds, nodes in passes:
        counts = [nodes.get(k, 0) for k in ("retraced", "copied", "copied_fast")]
        lines.append(f"{name:<44} {outcome:<7} {seconds:>8.3f} {counts[0]:>9} {counts[1]:>7} {counts[2]:>6}")
    outcomes: dict[str, int] = {}
    for _, outcome, _, _ in passes:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    total = sum(p[2] for p in passes)
    lines.append(f"{len(passes)} passes: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) + f"; {total:.2f} s")
    return lines
