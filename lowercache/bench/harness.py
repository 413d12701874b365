"""The benchmark: stock ExecuTorch lowering versus lowercache, side by side.

Why it is built the way it is (see ``shared/notes/benchmark.md``):

- Machines are noisy, so absolute seconds mean little; ratios measured side
  by side do.  Every repetition therefore runs the stock flow and then
  lowercache, alternating, in the same process, and the report gives medians
  and the ratio of the medians.
- Both sides are timed over the *whole* flow (export, quantize, lower,
  to_executorch): for lowercache that is the whole :func:`lowercache.lower`
  call, hashing and store access included.
- Speed without identity is worthless: every lowercache ``.pte`` is compared
  byte for byte with the stock ``.pte`` of the same repetition.
- Scenarios that start from a filled cache copy a seed cache directory before
  every repetition, so every repetition sees the same starting state.

Run ``python -m lowercache.bench.harness --quick --out benchmarks/results/quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


from .. import __version__
from ..lowering import flow, partitionorder
from . import process, stockref
from ..api import lower
from ..config import Settings
from .models import MODELS, SMALL, scenario_calibration
from ..cache.steps import Session, listed, outcome_counts
from ..targets import resolve
from ..cache.toolchain import version

SCENARIOS: tuple[str, ...] = (
    "cold", "warm", "edit-structure", "edit-weights", "target-switch", "calibration", "process",
)
"""Every scenario, in the order the benchmark runs and reports them.

``process`` times whole commands in new processes (``process.py``): its
phases are the first four scenarios and ``undo`` (the last edit undone),
chosen with ``--process-phases``.
"""

TARGETS: tuple[str, ...] = ("tosa-int", "tosa-fp", "ethos-u55-128", "ethos-u85-256")
"""The targets the full benchmark covers."""

QUICK: dict[str, Any] = {
    "models": list(SMALL),
    "targets": ["tosa-fp", "ethos-u55-128"],
    "scenarios": ["cold", "warm", "edit-structure"],
    "repeat": 1,
}
"""The ``--quick`` preset: small models, one float and one quantized target, minutes in all."""

STAGES: tuple[str, ...] = ("export", "hash", "backend", "quantize", "to_edge", "to_executorch", "other")
"""Stage names as :class:`lowercache.lowering.flow.Stages` records them, in flow order.

``other`` is the whole-flow time no stage accounts for (for lowercache
mostly opening the store and reading or writing entries), so the stages
add up to the measured total.
"""

OUTCOMES: tuple[str, ...] = ("hit", "miss", "skip", "bypass")
PASS_OUTCOMES: tuple[str, ...] = ("skip", "noop", "ran")  # passes are observed, not cached (passes.py)

STEP_KINDS: tuple[str, ...] = ("flow", "quantize", "reexport", "partition", "tosa", "pass", "vela", "xnnpack")
"""Step kinds in report order, outermost first; kinds not listed follow alphabetically."""

NODES_NOTE = (
    "nodes re-traced vs copied counts, within lowercache's run, the op dispatches of ExportPass retraces "
    "that went through FakeTensor vs those whose value was reused from the unchanged input node (retrace.py); "
    "in brackets, the nodes built by fast copy instead of being interpreted (fastcopy.py)"
)

RSS_NOTE = (
    "Peak RSS is ru_maxrss of the benchmark process, read after each case: it never decreases, "
    "so it is the peak so far (both flows and every earlier case included), not the case's own peak."
)

SWITCH_FROM = "ethos-u85-256"
SWITCH_TO = "ethos-u55-128"


@dataclass(frozen=True)
class Scenario:
    """How one scenario fills the cache before measuring, and what it measures.

    ``seed_*`` describe the lowering that fills the cache (None: the cache
    starts empty); ``edit`` and ``custom_calibration`` describe the measured
    lowering, which is also what the stock side lowers.
    """

    name: str
    edit: str | None = None
    custom_calibration: bool = False
    seeded: bool = True
    seed_target: str | None = None  # None: the measured target


def scenario(name: str) -> Scenario:
    """The definition of the scenario called ``name``."""
    table = {
        "cold": Scenario("cold", seeded=False),
        "warm": Scenario("warm"),
        "edit-structure": Scenario("edit-structure", edit="structure"),
        "edit-weights": Scenario("edit-weights", edit="weights"),
        "target-switch": Scenario("target-switch", seed_target=SWITCH_FROM),
        "calibration": Scenario("calibration", custom_calibration=True),
        "process": Scenario("process", seeded=False),
    }
    if name not in table:
        raise ValueError(f"unknown scenario {name!r}; expected one of {', '.join(SCENARIOS)}")
    return table[name]


def skip_reason(name: str, target: str) -> str | None:
    """Why a scenario does not apply to a target, or None when it does."""
    if name == "target-switch" and target != SWITCH_TO:
        return f"only measured for {SWITCH_TO} (after {SWITCH_FROM})"
    if name == "calibration" and not resolve(target).quantized:
        return "float target: no calibration"
    return None


def _settings(cache_dir: Path) -> Settings:
    """Settings naming only the benchmark's own cache, so no environment variable or config file can disable it."""
    return Settings(cache_dir=cache_dir)


def _with_other(stages: dict[str, float], total: float) -> dict[str, float]:
    """The stage times plus ``other``: the part of ``total`` outside every stage."""
    return {**stages, "other": max(total - sum(stages.values()), 0.0)}


def _stock(
    model: str, edit: str | None, target: str, custom_calibration: bool
) -> tuple[float, dict[str, float], bytes, list[list[str]]]:
    """One timed stock lowering: seconds, per-stage seconds, .pte bytes, partition orders.

    The model is built before the clock starts.  Vela's summary goes to a
    buffer so the console stays readable.
    """
    module, example = MODELS[model](edit=edit)
    calibration = scenario_calibration(example, custom_calibration) or [tuple(example)]
    resolved = resolve(target)
    stages = flow.Stages(Session(None))
    orders: list[list[str]] = []
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        program = stages.run("export", lambda: flow.export(module, example))
        pte = flow.run_stock(program, resolved, tuple(example), calibration, stages, partition_orders=orders)
    seconds = time.perf_counter() - start
    return seconds, _with_other(stages.seconds, seconds), bytes(pte), orders


def _reference(
    model: str, edit: str | None, target: str, custom_calibration: bool, stock_pte: bytes, orders: list[list[str]]
) -> tuple[bytes | None, str]:
    """The stock bytes lowercache must equal, and where they came from.

    Stock lowers multi-partition models in an order set by the hash seed
    (``partitionorder.py``); when this process's order was not discovery
    order, the reference is stock lowered in discovery order in a child.
    """
    if all(partitionorder.is_discovery_order(order) for order in orders):
        return stock_pte, "same process"
    tags = [tag for order in orders for tag in order]
    expected = stockref.reference(model, target, edit, custom_calibration, tags)
    return expected, "child process (discovery order)" if expected is not None else "none (no seed gave discovery order)"


def _lowercache(
    model: str, edit: str | None, target: str, custom_calibration: bool, cache_dir: Path
) -> tuple[float, dict[str, float], bytes, list[dict[str, Any]], dict[str, int]]:
    """One timed :func:`lowercache.lower` call: seconds, stages, .pte bytes, step records, node counts.

    stdout is silenced as for the stock side: on a hit lowercache replays
    Vela's summary, which would otherwise flood the console.
    """
    module, example = MODELS[model](edit=edit)
    calibration = scenario_calibration(example, custom_calibration)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        artifacts = lower(module, example, target=target, calibration=calibration, name=model, settings=_settings(cache_dir))
    seconds = time.perf_counter() - start
    records = [{k: r[k] for k in ("kind", "name", "outcome", "seconds", "saved")} for r in artifacts.records]
    return seconds, _with_other(artifacts.stages, seconds), artifacts.pte, records, artifacts.nodes


def _counts(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Outcome counts by step kind, outermost kind first (records list the flow step last: it ends last)."""
    out = {kind: {**dict.fromkeys(OUTCOMES, 0), **c} for kind, c in outcome_counts(records).items()}
    rank = {kind: i for i, kind in enumerate(STEP_KINDS)}
    return dict(sorted(out.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def _median_stages(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median of each stage over the repetitions (a stage missing from a run counts as 0 s)."""
    names = [s for s in STAGES if any(s in r for r in runs)] + sorted({s for r in runs for s in r} - set(STAGES))
    return {s: statistics.median(r.get(s, 0.0) for r in runs) for s in names}


def _peak_rss_mib() -> float:
    """The process's peak resident set so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


class _Seeds:
    """Caches filled with the base model (default calibration), by (model, target); made once, copied per repetition.

    A cold repetition leaves exactly the cache the other scenarios start
    from, so :meth:`adopt` keeps it rather than lowering the model again.
    """

    def __init__(self, root: Path):
        self.root = root
        self.dirs: dict[tuple[str, str], Path] = {}

    def adopt(self, model: str, target: str, cache_dir: Path) -> bool:
        """Keep ``cache_dir`` as the seed for (model, target) unless one exists; True when kept."""
        if (model, target) in self.dirs:
            return False
        self.dirs[(model, target)] = cache_dir
        return True

    def get(self, model: str, target: str) -> Path:
        """The seed cache for (model, target), lowering the base model into it the first time."""
        if (model, target) not in self.dirs:
            path = self.root / f"seed-{model}-{target}"
            shutil.rmtree(path, ignore_errors=True)
            _lowercache(model, None, target, False, path)
            self.dirs[(model, target)] = path
        return self.dirs[(model, target)]


def _warm_up(targets: Sequence[str], root: Path, log: Callable[[str], None]) -> None:
    """Lower the tiny CNN once per target, stock and lowercache, untimed.

    The first lowering in a process pays for importing executorch, torchao,
    the Arm backend and Vela, and for torch.export's first trace; whichever
    side ran first would carry that cost.
    """
    for target in targets:
        log(f"warm-up: tiny_cnn {target}")
        _stock("tiny_cnn", None, target, False)
        _lowercache("tiny_cnn", None, target, False, root / f"warmup-{target}")


def _run_case(
    spec: Scenario, model: str, target: str, repeat: int, cache_root: Path, seeds: _Seeds, log: Callable[[str], None]
) -> dict[str, Any]:
    """Measure one (scenario, model, target): ``repeat`` alternating stock/lowercache pairs."""
    stock_s: list[float] = []
    lc_s: list[float] = []
    stock_stages: list[dict[str, float]] = []
    lc_stages: list[dict[str, float]] = []
    records: list[list[dict[str, Any]]] = []
    equal: list[bool] = []
    references: list[str] = []
    nodes: list[dict[str, int]] = []
    pte_size = 0
    for rep in range(repeat):
        work = cache_root / f"{spec.name}-{model}-{target}-{rep}"
        shutil.rmtree(work, ignore_errors=True)
        if spec.seeded:
            seed = seeds.get(model, spec.seed_target or target)
            shutil.copytree(seed, work)
        seconds, stages, stock_pte, orders = _stock(model, spec.edit, target, spec.custom_calibration)
        stock_s.append(seconds)
        stock_stages.append(stages)
        seconds, stages, pte, recs, node_counts = _lowercache(model, spec.edit, target, spec.custom_calibration, work)
        nodes.append(node_counts)
        lc_s.append(seconds)
        lc_stages.append(stages)
        records.append(recs)
        expected, source = _reference(model, spec.edit, target, spec.custom_calibration, stock_pte, orders)
        references.append(source)
        equal.append(pte == expected)
        pte_size = len(stock_pte)
        log(
            f"  rep {rep + 1}/{repeat}: stock {stock_s[-1]:.2f} s, lowercache {lc_s[-1]:.2f} s, "
            f"bytes {'equal' if equal[-1] else 'DIFFER'} (stock reference: {source})"
        )
        kept = spec.name == "cold" and seeds.adopt(model, target, work)
        if not kept:
            shutil.rmtree(work, ignore_errors=True)
    stock_median = statistics.median(stock_s)
    lc_median = statistics.median(lc_s)
    return {
        "scenario": spec.name,
        "model": model,
        "target": target,
        "status": "ok",
        "stock_seconds": stock_s,
        "lowercache_seconds": lc_s,
        "stock_median": stock_median,
        "lowercache_median": lc_median,
        "ratio": stock_median / lc_median if lc_median > 0 else None,
        "stock_stages": _median_stages(stock_stages),
        "lowercache_stages": _median_stages(lc_stages),
        "counts": _counts(records[0]),
        "lowercache_records": [listed(rep) for rep in records],  # per-pass and per-observer steps only counted
        "bytes_equal": equal,
        "stock_reference": references,
        "equal": all(equal),
        "pte_size": pte_size,
        "peak_rss_mib": _peak_rss_mib(),
        "nodes_retraced_vs_copied": nodes[0],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def environment() -> dict[str, Any]:
    """Date, machine and toolchain versions: what a reader needs to compare two reports."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": _memory_gib(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": version("torch"),
            "executorch": version("executorch"),
            "tosa-tools": version("tosa-tools"),
            "vela": version("ethos-u-vela"),
            "lowercache": __version__,
        },
    }


def run_benchmark(
    models: list[str],
    targets: list[str],
    scenarios: list[str],
    repeat: int,
    out_dir: Path,
    cache_root: Path,
    log: Callable[[str], None] | None = None,
    process_phases: list[str] | None = None,
) -> dict[str, Any]:
    """Run every scenario x model x target, write the report into ``out_dir`` and return the results.

    ``cache_root`` holds the caches (seed caches and per-repetition copies);
    the caller owns it; ``process_phases`` are the phases of the ``process``
    scenario (default: all of ``process.PHASES``).  The returned dict has ``rows`` (one per case,
    skipped cases included with their reason) and ``all_equal``: whether
    every lowercache .pte equalled its stock counterpart.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    specs = [scenario(s) for s in scenarios]
    for name in models:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    resolved_targets = [resolve(t).name for t in targets]
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        **environment(),
        "config": {
            "models": models, "targets": resolved_targets, "scenarios": scenarios, "repeat": repeat,
            **({"process_phases": process_phases or list(process.PHASES)} if "process" in scenarios else {}),
        },
        "notes": {"peak_rss": RSS_NOTE, "nodes_retraced_vs_copied": NODES_NOTE},
        "rows": [],
    }
    if any(spec.name != "process" for spec in specs):  # the process scenario's commands each start afresh
        _warm_up(resolved_targets, cache_root, log)
    seeds = _Seeds(cache_root)
    for spec in specs:
        for model in models:
            for target in resolved_targets:
                reason = skip_reason(spec.name, target)
                if reason is not None:
                    results["rows"].append(
                        {"scenario": spec.name, "model": model, "target": target, "status": "skipped", "reason": reason}
                    )
                    continue
                log(f"{spec.name}: {model} {target}")
                if spec.name == "process":
                    results["rows"].append(process.run_case(model, target, repeat, cache_root, log, process_phases))
                    continue
                results["rows"].append(_run_case(spec, model, target, repeat, cache_root, seeds, log))
    measured = [r for r in results["rows"] if r["status"] == "ok"]
    results["all_equal"] = all(r["equal"] for r in measured)
    render(results, Path(out_dir))
    return results



def _fmt_s(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}x" if value < 100 else f"{value:.0f}x"


def _stages_cell(row: dict[str, Any]) -> str:
    """``stage stock/lowercache`` for every stage either side ran; – where a side did not run it."""
    stock, lc = row["stock_stages"], row["lowercache_stages"]
    names = [s for s in STAGES if s in stock or s in lc] + sorted((set(stock) | set(lc)) - set(STAGES))
    return "<br>".join(
        f"{s} {_fmt_s(stock.get(s))}/{_fmt_s(lc.get(s))}" for s in names
    )


def _nodes_cell(nodes: dict[str, int]) -> str:
    if not isinstance(nodes, dict) or not nodes:
        return "-"
    fast = f" ({nodes['copied_fast']} fast)" if "copied_fast" in nodes else ""
    return f"{nodes.get('retraced', 0)}/{nodes.get('copied', 0)}{fast}"


def _counts_cell(counts: dict[str, dict[str, int]], sep: str = "<br>") -> str:
    """``kind hit/miss/skip/bypass`` per step kind; passes as ``pass skip/noop/ran``."""
    return sep.join(
        f"{kind} {'/'.join(str(c.get(o, 0)) for o in (PASS_OUTCOMES if kind == 'pass' else OUTCOMES))}"
        for kind, c in counts.items()
    )


REFERENCE_NOTE = (
    "Stock reference: the same repetition's stock .pte, except where stock lowered several partitions in an order "
    "other than discovery order (stock follows the string-hash seed there, executorch#19045; lowercache always uses "
    "discovery order): then stock lowered in discovery order in a child process (`stock_reference` per row)"
)


def _markdown(results: dict[str, Any], plot_note: str) -> str:
    machine, versions = results["machine"], results["versions"]
    memory = f"{machine['memory_gib']:.1f} GiB" if machine.get("memory_gib") else "unknown"
    lines = [
        "# lowercache benchmark",
        "",
        f"- Date: {results['date']}",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {memory} memory ({machine['platform']})",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- Repetitions: {results['config']['repeat']} (stock and lowercache alternate within each repetition, same process)",
        f"- All lowercache outputs byte-identical to stock: **{'yes' if results['all_equal'] else 'NO'}**",
        f"- {REFERENCE_NOTE}",
        "",
        "Times are medians over the repetitions of the whole flow (export, quantize, lower, to_executorch); "
        "for lowercache the whole `lowercache.lower` call. Ratio = stock median / lowercache median. "
        "Stages are median seconds, stock/lowercache. Steps are counts per step kind as "
        "hit/miss/skip/bypass (passes: skip/noop/ran), from the first repetition (every repetition starts from the same cache state).",
        "",
        f"{RSS_NOTE}",
        "",
        f"Nodes re-traced vs copied: {NODES_NOTE}.",
        "",
    ]
    lines += [plot_note or "![per-stage times, stock vs lowercache](stages.png)", ""]
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        by_scenario.setdefault(row["scenario"], []).append(row)
    for name, rows in by_scenario.items():
        lines += [f"## {name}", ""]
        if name == "process":
            lines += process.markdown([r for r in rows if r["status"] == "ok"])
            continue
        measured = [r for r in rows if r["status"] == "ok"]
        if measured:
            lines += [
                "| model | target | stock median s | lowercache median s | ratio | stages stock/lowercache (s) "
                "| steps hit/miss/skip/bypass | nodes re-traced/copied | peak RSS so far (MiB) | bytes equal |",
                "|---|---|---:|---:|---:|---|---|---|---:|---|",
            ]
            for r in measured:
                lines.append(
                    f"| {r['model']} | {r['target']} | {_fmt_s(r['stock_median'])} | {_fmt_s(r['lowercache_median'])} "
                    f"| {_fmt_ratio(r['ratio'])} | {_stages_cell(r)} | {_counts_cell(r['counts'])} "
                    f"| {_nodes_cell(r['nodes_retraced_vs_copied'])} | {r['peak_rss_mib']:.0f} | {'yes' if r['equal'] else '**no**'} |"
                )
            lines.append("")
        for r in rows:
            if r["status"] == "skipped":
                lines.append(f"- skipped {r['model']} {r['target']}: {r['reason']}")
        if len(measured) < len(rows):
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _plot(results: dict[str, Any], path: Path) -> str:
    """Draw ``stages.png``; return a note for the report ('' when drawn).

    One panel per scenario; in it, a pair of horizontal bars per case (stock
    above lowercache), each stacked by stage.  matplotlib is optional (the
    ``bench`` extra), so it is imported here and its absence only costs the
    picture.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "stages.png not drawn: matplotlib is not installed (`pip install -e .[bench]`)."
    rows = [r for r in results["rows"] if r["status"] == "ok" and r["scenario"] != "process"]
    if not rows:
        return "stages.png not drawn: no in-process case was measured."
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    stage_names = [s for s in STAGES if any(s in r["stock_stages"] or s in r["lowercache_stages"] for r in rows)]
    colors = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(stage_names)}
    heights = [2 * sum(r["scenario"] == s for r in rows) for s in scenarios]
    fig, axes = plt.subplots(
        len(scenarios), 1, figsize=(10, 1.2 + 0.35 * sum(heights) + 0.6 * len(scenarios)),
        gridspec_kw={"height_ratios": heights}, squeeze=False,
    )
    for ax, name in zip(axes[:, 0], scenarios):
        labels: list[str] = []
        bars: list[dict[str, float]] = []
        for r in (r for r in rows if r["scenario"] == name):
            labels += [f"{r['model']} {r['target']} stock", f"{r['model']} {r['target']} lowercache"]
            bars += [r["stock_stages"], r["lowercache_stages"]]
        ys = list(range(len(bars)))[::-1]
        left = [0.0] * len(bars)
        for stage in stage_names:
            widths = [b.get(stage, 0.0) for b in bars]
            ax.barh(ys, widths, left=left, color=colors[stage], label=stage, height=0.7)
            left = [a + w for a, w in zip(left, widths)]
        ax.set_yticks(ys, labels, fontsize=8)
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel("seconds (median)", fontsize=8)
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", ncols=len(stage_names), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def render(results: dict[str, Any], out_dir: Path) -> None:
    """Write ``results.json``, ``report.md`` and (when matplotlib is installed) ``stages.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_note = _plot(results, out_dir / "stages.png")
    results["plot"] = plot_note or "stages.png"
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(results, plot_note))


def text_table(results: dict[str, Any]) -> str:
    """A plain-text summary for the console: one line per measured case."""
    header = ("scenario", "model", "target", "stock s", "lowercache s", "ratio", "bytes equal", "flow")
    lines = [header]
    for r in results["rows"]:
        if r["status"] != "ok" or r["scenario"] == "process":
            continue
        flow_counts = r["counts"].get("flow", {})
        lines.append((
            r["scenario"], r["model"], r["target"], _fmt_s(r["stock_median"]), _fmt_s(r["lowercache_median"]),
            _fmt_ratio(r["ratio"]), "yes" if r["equal"] else "NO",
            ",".join(o for o in OUTCOMES if flow_counts.get(o)) or "–",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out += process.text_lines([r for r in results["rows"] if r["status"] == "ok" and r["scenario"] == "process"])
    out.append(f"all byte-identical: {'yes' if results['all_equal'] else 'NO'}")
    return "\n".join(out)


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry; returns 0 when every output was byte-identical, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m lowercache.bench.harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=_list, help=f"comma list (default: all of {', '.join(MODELS)})")
    parser.add_argument("--targets", type=_list, help=f"comma list (default: {','.join(TARGETS)})")
    parser.add_argument("--scenarios", type=_list, help=f"comma list (default: {','.join(SCENARIOS)})")
    parser.add_argument("--repeat", type=int, help="repetitions per case (default 3; 1 with --quick)")
    parser.add_argument(
        "--process-phases", type=_list,
        help=f"phases of the process scenario (default: {','.join(process.PHASES)}; cold always runs first)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"), help="report directory")
    parser.add_argument(
        "--quick", action="store_true",
        help="small models, tosa-fp and ethos-u55-128, cold/warm/edit-structure, 1 repetition; other options override",
    )
    args = parser.parse_args(argv)
    defaults: dict[str, Any] = QUICK if args.quick else {
        "models": list(MODELS), "targets": list(TARGETS), "scenarios": list(SCENARIOS), "repeat": 3,
    }
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in defaults}
    if chosen["repeat"] < 1:
        parser.error("--repeat must be at least 1")
    for name in chosen["scenarios"]:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; expected one of {', '.join(SCENARIOS)}")
    for name in chosen["models"]:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    for name in args.process_phases or []:
        if name not in process.PHASES:
            parser.error(f"unknown process phase {name!r}; expected one of {', '.join(process.PHASES)}")
    with tempfile.TemporaryDirectory(prefix="lowercache-bench-") as cache_root:
        results = run_benchmark(
            chosen["models"], chosen["targets"], chosen["scenarios"], chosen["repeat"], args.out, Path(cache_root),
            process_phases=args.process_phases,
        )
    print(text_table(results))
    print(f"report: {args.out / 'report.md'}")
    return 0 if results["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
