"""The build report: ``build-report.json`` and ``build-report.md`` in the output root, and what changed since a previous one.

Per (model, target): outcome, seconds, the ``.pte``'s size and digest (from
the pair's ``manifest.json``) and, for Ethos-U, Vela's estimate read back
from the files the lowering wrote (:mod:`lowercache.estimates`). The JSON
is the input of ``--compare``: read as JSON, never executed.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from .. import estimates
from ..lowering.check import numerics_report
from ..errors import LowercacheError
from ..output import counted

REPORT_VERSION = 1
JSON_NAME = "build-report.json"
MD_NAME = "build-report.md"
# Estimate fields compared between builds besides cycles (which are said as slower or faster): (key, label, unit)
_COMPARED = (
    ("sram_kib", "SRAM", " KiB"),
    ("flash_kib", "flash", " KiB"),
    ("cpu_operators", "CPU-fallback operators", ""),
)
OUTCOMES = ("hit", "miss", "failed", "skipped")


def estimate(out_dir: Path, target: str) -> Optional[dict[str, Any]]:
    """Vela's totals for an Ethos-U lowering in ``out_dir``; None for TOSA targets (no Vela)."""
    found = estimates.read(out_dir, target, per_layer=False)
    if found is None:
        return None
    flash = found.memory("on_chip_flash_memory_used") + found.memory("off_chip_flash_memory_used")
    return {
        "cycles": found.cycles,
        "inference_us": round(found.seconds * 1e6, 3),
        "sram_kib": found.memory("sram_memory_used"),
        "dram_kib": found.memory("dram_memory_used"),
        "flash_kib": round(flash, 3),
        "vela_cpu_operators": found.vela_cpu_operators,
        "outside_delegate": found.outside,
        "cpu_operators": found.vela_cpu_operators + len(found.outside),
    }


def entry(name: str, target: str, out: str, outcome: str, how: str, seconds: float, error: Optional[str], root: Path) -> dict[str, Any]:
    """One pair's row: what happened, and what its output directory holds when it succeeded."""
    row: dict[str, Any] = {"model": name, "target": target, "out": out, "outcome": outcome, "how": how, "seconds": round(seconds, 3)}
    if error:
        row["error"] = error
    if outcome in ("hit", "miss"):
        out_dir = root / out
        try:
            manifest = json.loads((out_dir / "manifest.json").read_text())
            files = manifest.get("files", {})
            row["pte"] = files.get("model.pte")
            row["bytes"] = sum(int(f.get("size", 0)) for f in files.values())
            checked = numerics_report.summary(manifest.get("numerics"))
            if checked is not None:
                row["numerics"] = checked
        except (OSError, ValueError, AttributeError):
            row["pte"] = None
        row["estimate"] = estimate(out_dir, target)
    return row


def write(out_root: Path, rows: list[dict[str, Any]], meta: dict[str, Any], changes: Optional[list[str]]) -> tuple[Path, Path]:
    """Write both files into ``out_root``, each replaced whole."""
    out_root.mkdir(parents=True, exist_ok=True)
    report = {"version": REPORT_VERSION, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta, "pairs": rows}
    if changes is not None:
        report["changes"] = changes
    paths = out_root / JSON_NAME, out_root / MD_NAME
    for path, text in zip(paths, (json.dumps(report, indent=2, sort_keys=True) + "\n", markdown(report))):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


def load(path: Path) -> dict[str, Any]:
    """A previous report, for ``--compare``; a one-line error when it is not one."""
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise LowercacheError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise LowercacheError(f"{path}: not a build report (not JSON: {e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("pairs"), list) or not all(isinstance(r, dict) for r in report["pairs"]):
        raise LowercacheError(f"{path}: not a build report (no list of pairs)")
    return report


def _num(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def compare(before: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """What changed per pair since ``before``: estimates (``KWS: 8.0% slower on ethos-u55-128``), the .pte, outcomes, pairs added or gone."""
    old = {(r.get("model"), r.get("target")): r for r in before.get("pairs", [])}
    lines = []
    for row in rows:
        key = (row["model"], row["target"])
        label = f"{row['model']} on {row['target']}"
        prev = old.pop(key, None)
        if prev is None:
            lines.append(f"{label}: new")
            continue
        if row["outcome"] == "failed" and prev.get("outcome") != "failed":
            lines.append(f"{label}: now fails ({row.get('error', '')})")
            continue
        new_est, old_est = row.get("estimate") or {}, prev.get("estimate") or {}
        cycles_before, cycles_after = old_est.get("cycles"), new_est.get("cycles")
        if isinstance(cycles_before, (int, float)) and isinstance(cycles_after, (int, float)) and cycles_before and cycles_after != cycles_before:
            change = (cycles_after - cycles_before) / cycles_before
            lines.append(f"{row['model']}: {abs(change):.1%} {'slower' if change > 0 else 'faster'} on {row['target']} "
                         f"(cycles/inference {_num(cycles_before)} -> {_num(cycles_after)})")
        for key_name, what, unit in _COMPARED:
            a, b = old_est.get(key_name), new_est.get(key_name)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != b:
                lines.append(f"{label}: {what} {_num(a)} -> {_num(b)}{unit}")
        old_pte, new_pte = prev.get("pte") or {}, row.get("pte") or {}
        if old_pte.get("size") and new_pte.get("size") and old_pte.get("size") != new_pte.get("size"):
            lines.append(f"{label}: model.pte {old_pte['size']:,} -> {new_pte['size']:,} bytes")
        elif old_pte.get("xxh3_128") and new_pte.get("xxh3_128") and old_pte["xxh3_128"] != new_pte["xxh3_128"]:
            lines.append(f"{label}: model.pte changed (same size)")
        lines.extend(f"{label}: {line}" for line in _numerics_change(prev.get("numerics"), row.get("numerics")))
    lines.extend(f"{model} on {target}: gone" for model, target in old)
    return lines


def _snr(row: dict[str, Any]) -> str:
    return "not compared" if "error" in row or "snr_db" not in row else numerics_report.snr_text(row["snr_db"])


def _numerics_change(before: Any, after: Any) -> list[str]:
    drop = numerics_report.snr_drop(before, after)
    if drop is None or drop == 0:
        return []
    return [f"SNR {_snr(before)} -> {_snr(after)}" + (f" ({-drop:+.1f} dB)" if math.isfinite(drop) else "")]


def regressions(before: dict[str, Any], rows: list[dict[str, Any]], max_drop: float) -> list[str]:
    """Pairs whose worst SNR fell more than ``max_drop`` dB since ``before`` (the build file's ``max-snr-drop``)."""
    old = {(r.get("model"), r.get("target")): r for r in before.get("pairs", [])}
    found = []
    for row in rows:
        prev = old.get((row["model"], row["target"]))
        drop = numerics_report.snr_drop((prev or {}).get("numerics"), row.get("numerics"))
        if drop is not None and drop > max_drop:
            fell = f"{drop:.1f} dB" if math.isfinite(drop) else "from a measure to none"
            found.append(f"{row['model']} on {row['target']}: SNR fell {fell} ({_snr(prev['numerics'])} -> {_snr(row['numerics'])}), "
                         f"more than max-snr-drop {max_drop:g} dB")
    return found


def tally(rows: list[dict[str, Any]], took: str = "") -> str:
    """How the pairs came out, in words: ``9 pairs{took}: 6 from the cache, 3 lowered, 0 failed, 0 not run``."""
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    return (f"{counted(len(rows), 'pair')}{took}: {counts['hit']} from the cache, {counts['miss']} lowered, {counts['failed']} failed, "
            f"{counts['skipped']} not run")


def _checked(row: Any) -> str:
    """The SNR, cosine and top-1 cells of a pair with a numerics check (empty cells without one)."""
    if not row:
        return " |  | "
    if "error" in row or "snr_db" not in row:
        return "not compared |  | "
    top1 = f"{row['top1'] * 100:.1f}%" if row.get("top1") is not None else ""
    return f"{numerics_report.snr_text(row.get('snr_db'))} | {row.get('cosine', 0):.6f} | {top1}"


def markdown(report: dict[str, Any]) -> str:
    """The report for people (and ``$GITHUB_STEP_SUMMARY``): a table of pairs, failures, changes."""
    rows = report["pairs"]
    lines = [
        "## lowercache build",
        "",
        f"{tally(rows)}; {report.get('seconds', 0):.1f} s with {report.get('executor')} -j {report.get('jobs')}",
        "",
        "| model | target | outcome | seconds | model.pte bytes | cycles/inference | SRAM KiB | flash KiB | CPU-fallback ops | SNR | cosine | top-1 |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        est = r.get("estimate") or {}
        cpu = "" if not est else f"{est['vela_cpu_operators']} (Vela); outside delegate: {', '.join(est['outside_delegate']) or 'none'}"
        pte = (r.get("pte") or {}).get("size")
        lines.append(
            f"| {r['model']} | {r['target']} | {r['outcome']} | {r['seconds']:.2f} | {'' if pte is None else f'{pte:,}'} | "
            f"{_num(est['cycles']) if est else ''} | {_num(est['sram_kib']) if est else ''} | {_num(est['flash_kib']) if est else ''} | {cpu} | "
            f"{_checked(r.get('numerics'))} |"
        )
    failed = [r for r in rows if r["outcome"] == "failed"]
    if report.get("regressions"):
        lines += ["", "### Numerics regressions", ""] + [f"- {line}" for line in report["regressions"]]
    if failed:
        lines += ["", "### Failed", ""] + [f"- {r['model']} on {r['target']}: {r.get('error', '')}" for r in failed]
    if "changes" in report:
        lines += ["", f"### Changes since {report.get('compared_with', 'the previous build')}", ""]
        lines += [f"- {c}" for c in report["changes"]] or ["- none"]
    return "\n".join(lines) + "\n"
