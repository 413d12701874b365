"""Vela's estimates of one Ethos-U lowering, read back from its output directory, and how they changed.

What an Ethos-U engineer checks after an edit (``lowercache watch``): cycles
per inference, the memory each area uses, the operators left to the CPU,
and which layers got slower. The totals come from the files the lowering
wrote (Vela's summary CSV and text, the ``.pte``), so nothing is
recomputed for them. Vela's per-layer estimates are not among those files
(stock ExecuTorch does not ask for them, and asking would change the
lowering's Vela flags), so they come from running Vela once more, with
``--verbose-performance``, on the partition's TOSA file as written; that
run is used only when its summary CSV equals the lowering's, byte for byte
(the same Vela flags, hence the same estimates). Each layer is labelled by
the user's module path, from the manifest's map of TOSA tensor names
(:mod:`lowercache.delegation`). Imports no torch.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import delegation
from .cache.digests import digest
from .delegation import pte_operators

_SUMMARY_CSV = re.compile(r"^partition_(\d+)\.vela_out_summary_(.+)\.csv$")
_OPERATORS = re.compile(r"^(CPU|NPU) operators = (\d+)", re.MULTILINE)
# Vela's summary CSV columns for the memory each area uses (KiB), and how they are shown.
MEMORY_AREAS = (
    ("sram_memory_used", "SRAM"),
    ("dram_memory_used", "DRAM"),
    ("on_chip_flash_memory_used", "on-chip flash"),
    ("off_chip_flash_memory_used", "off-chip flash"),
)
MAX_LAYER_LINES = 8


@dataclass
class Layer:
    """One row of Vela's per-layer estimate."""

    name: str  # Vela's: the TOSA output tensor's name, or ``#N`` for an operator Vela inserted
    operator: str
    cycles: float
    placement: str = "NPU"
    module: str = ""  # the user's module path (``features.3.conv``), from the lowering's manifest

    @property
    def label(self) -> str:
        """``features.3.conv Conv2D``; Vela's own name when the module is unknown."""
        if not self.module:
            return f"{self.name} {self.operator}"
        return f"{self.module} {self.operator}{' (inserted by Vela)' if self.name.startswith('#') else ''}"


@dataclass
class Partition:
    """One delegated partition: Vela's summary and, when available, its per-layer estimate."""

    index: int
    summary: dict[str, str]
    cpu_operators: int
    npu_operators: int
    layers: Optional[list[Layer]] = None
    layers_note: str = ""

    def number(self, column: str) -> float:
        try:
            return float(self.summary.get(column, 0) or 0)
        except ValueError:
            return 0.0


@dataclass
class Estimate:
    """Vela's estimate of a whole lowering (every partition) and the operators the ``.pte`` runs outside the delegate."""

    target: str
    partitions: list[Partition] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)

    @property
    def cycles(self) -> float:
        return sum(p.number("cycles_total") for p in self.partitions)

    @property
    def seconds(self) -> float:
        return sum(p.number("inference_time") for p in self.partitions)

    def memory(self, column: str) -> float:
        """KiB: SRAM is the peak of any partition (each runs on its own), the other areas add up."""
        values = [p.number(column) for p in self.partitions]
        if not values:
            return 0.0
        return max(values) if column == "sram_memory_used" else sum(values)

    @property
    def vela_cpu_operators(self) -> int:
        return sum(p.cpu_operators for p in self.partitions)


# -- reading an output directory ---------------------------------------------------------------------


def read(out_dir: Path, target: str, per_layer: bool = True) -> Optional[Estimate]:
    """The estimate of the lowering in ``out_dir``, or None when it has no Vela output (a TOSA target, nothing written yet)."""
    try:
        names = sorted(os.listdir(out_dir))
    except OSError:
        return None
    found = sorted((int(m.group(1)), name) for name in names if (m := _SUMMARY_CSV.match(name)))
    if not found:
        return None
    estimate = Estimate(target=target)
    tensor_modules = _tensor_modules(out_dir) if per_layer else []
    for index, name in found:
        try:
            summary_bytes = (out_dir / name).read_bytes()
            rows = list(csv.reader(io.StringIO(summary_bytes.decode())))
            summary = dict(zip(rows[0], rows[1]))
        except (OSError, UnicodeDecodeError, IndexError):
            continue
        text = _read_text(out_dir / f"partition_{index}.vela_summary.txt")
        counts = {kind: int(n) for kind, n in _OPERATORS.findall(text)}
        partition = Partition(index, summary, counts.get("CPU", 0), counts.get("NPU", 0))
        if per_layer:
            tosa = out_dir / f"partition_{index}.tosa"
            partition.layers, partition.layers_note = layers(tosa, target, summary, summary_bytes)
            if partition.layers is not None and index < len(tensor_modules):
                partition.layers = named(partition.layers, tensor_modules[index])
        estimate.partitions.append(partition)
    try:
        estimate.outside = pte_operators((out_dir / "model.pte").read_bytes())
    except (OSError, ValueError, struct.error):
        estimate.outside = []
    return estimate


def _tensor_modules(out_dir: Path) -> list[dict[str, str]]:
    """Per partition, each TOSA tensor's module path, as the lowering's ``manifest.json`` records them (none if unreadable)."""
    try:
        found = json.loads((out_dir / "manifest.json").read_text())["delegation"]["tensor_modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(found, list):
        return []
    return [m if isinstance(m, dict) else {} for m in found]


def named(layer_list: list[Layer], modules: dict[str, str]) -> list[Layer]:
    """The layers with their module paths; a layer Vela inserted takes the next named layer's (else the previous one's)."""
    paths = [modules.get(layer.name, "") if isinstance(modules.get(layer.name), str) else "" for layer in layer_list]
    for i, layer in enumerate(layer_list):
        if layer.name.startswith("#"):
            after = next((p for p in paths[i + 1 :] if p), "")
            paths[i] = after or next((p for p in reversed(paths[:i]) if p), "")
    return [dataclasses.replace(layer, module=path) for layer, path in zip(layer_list, paths)]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# -- Vela's per-layer estimate --------------------------------------------------------------------------


_per_layer_memo: dict[str, tuple[Optional[list[Layer]], str]] = {}


def layers(tosa_path: Path, target: str, summary: dict[str, str], summary_bytes: bytes) -> tuple[Optional[list[Layer]], str]:
    """Vela's per-layer estimate of one partition, and a note when there is none (remembered per TOSA file and summary)."""
    try:
        tosa = tosa_path.read_bytes()
    except OSError:
        return None, "no TOSA file"
    key = digest(tosa + b"\0" + summary_bytes + target.encode())
    if key not in _per_layer_memo:
        _per_layer_memo[key] = _run_vela(tosa, target, summary, summary_bytes)
    return _per_layer_memo[key]


def _run_vela(tosa: bytes, target: str, summary: dict[str, str], summary_bytes: bytes) -> tuple[Optional[list[Layer]], str]:
    """Vela with the flags ExecuTorch's default Ethos-U compile spec gives it, plus ``--verbose-performance``."""
    try:
        from ethosu.vela import vela
    except ImportError:
        return None, "Vela is not installed"
    with tempfile.TemporaryDirectory(prefix="lowercache-layers-") as tmp:
        tosa_path = os.path.join(tmp, "out.tosa")  # the name the lowering gave it: the summary names the network by it
        with open(tosa_path, "wb") as f:
            f.write(tosa)
        out = os.path.join(tmp, "output")
        args = [
            f"--accelerator-config={target}",
            "--config=Arm/vela.ini",
            "--output-format=raw",
            f"--system-config={summary.get('system_config', '')}",
            f"--memory-mode={summary.get('memory_mode', '')}",
            "--verbose-performance",
            f"--output-dir={out}",
            tosa_path,
        ]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                vela.main(args)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (an estimate is extra: a Vela failure costs only it)
            return None, f"Vela's per-layer run failed ({type(e).__name__})"
        try:
            names = os.listdir(out)
            again = next((n for n in names if n.startswith("out_summary_") and n.endswith(".csv")), None)
            if again is None or Path(out, again).read_bytes() != summary_bytes:
                return None, "not available: the lowering's Vela flags differ from ExecuTorch's defaults"
            table = next((n for n in names if n.endswith("_per-layer.csv")), None)
            if table is None:
                return None, "Vela wrote no per-layer estimate"
            with open(os.path.join(out, table), newline="") as f:
                return _parse_layers(list(csv.DictReader(f))), ""
        except (OSError, ValueError, KeyError) as e:
            return None, f"Vela's per-layer estimate is unreadable ({type(e).__name__})"


def _parse_layers(rows: list[dict[str, Any]]) -> list[Layer]:
    return [
        Layer(
            name=row.get("Name") or "?",
            operator=row.get("Original Operator") or row.get("NNG Operator") or "?",
            cycles=float(row.get("Op Cycles") or 0),
            placement=row.get("Target") or "NPU",
        )
        for row in rows
    ]


# -- what changed ------------------------------------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def _change(before: Optional[float], after: float, unit: str = "", percent: bool = False) -> str:
    """``after`` alone, or ``before -> after (+delta[, +p%])``, or ``after (=)``."""
    if before is None:
        return f"{_num(after)}{unit}"
    if before == after:
        return f"{_num(after)}{unit} (=)"
    delta = after - before
    text = f"{_num(before)} -> {_num(after)}{unit} ({'+' if delta > 0 else '-'}{_num(abs(delta))}"
    if percent and before:
        text += f", {delta / before:+.1%}"
    return text + ")"


def summary(estimate: Estimate) -> str:
    """Vela's estimate in one line, as ``aot_arm_compiler``'s Vela summary has it: cycles and time per inference at the
    configured clock, the memory each area uses, and the operators on the NPU and on the CPU."""
    clock = estimate.partitions[0].number("core_clock") if estimate.partitions else 0.0
    at = f" at {clock / 1e6:,.0f} MHz" if clock else ""
    memory = [f"{label}{' (peak)' if column == 'sram_memory_used' and len(estimate.partitions) > 1 else ''} "
              f"{estimate.memory(column):,.1f} KiB" for column, label in MEMORY_AREAS if estimate.memory(column)]
    npu = sum(p.npu_operators for p in estimate.partitions)
    return (f"Vela estimate: {_num(estimate.cycles)} cycles/inference, {estimate.seconds * 1e3:,.2f} ms{at}; "
            f"{', '.join(memory) or 'no memory reported'}; {npu} operators on the NPU, {estimate.vela_cpu_operators} on the CPU")


def json_summary(estimate: Estimate) -> dict[str, Any]:
    """The same figures for ``lower --json``: ``vela``."""
    return {"vela": {
        "cycles": estimate.cycles,
        "inference_seconds": estimate.seconds,
        "clock_hz": estimate.partitions[0].number("core_clock") if estimate.partitions else 0.0,
        "memory_kib": {column.removesuffix("_memory_used"): estimate.memory(column) for column, _ in MEMORY_AREAS},
        "npu_operators": sum(p.npu_operators for p in estimate.partitions),
        "cpu_operators": estimate.vela_cpu_operators,
        "partitions": len(estimate.partitions),
    }}


def outcome(section: Optional[dict[str, Any]], out_dir: Path, target: str) -> tuple[list[str], dict[str, Any]]:
    """What ``lower`` says at the end of a lowering or a hit, and puts in ``--json``: how much of the model was delegated
    (and what runs outside), and for Ethos-U Vela's estimate, read from the files just written."""
    lines = [said] if (said := delegation.line(section)) is not None else []
    found = read(out_dir, target, per_layer=False)
    if found is not None and found.partitions:
        lines.append(summary(found))
    return lines, {**delegation.json_part(section), **(json_summary(found) if found is not None and found.partitions else {})}


def describe(after: Estimate, before: Optional[Estimate]) -> list[str]:
    """The lines ``watch`` prints: totals, memory, CPU operators and per-layer changes, each against ``before`` when given."""
    lines = []
    seconds = f"{after.seconds * 1e6:,.1f} us"
    if before is not None and before.seconds != after.seconds:
        seconds = f"{before.seconds * 1e6:,.1f} -> {seconds}"
    lines.append(f"cycles/inference {_change(before.cycles if before else None, after.cycles, percent=True)}; {seconds} per inference")
    memory = []
    for column, label in MEMORY_AREAS:
        now, then = after.memory(column), (before.memory(column) if before else None)
        if now or then:
            peak = " (peak)" if column == "sram_memory_used" and len(after.partitions) > 1 else ""
            memory.append(f"{label}{peak} {_change(then, now, ' KiB')}")
    lines.append("memory: " + (", ".join(memory) or "none reported"))
    lines.append(_cpu_line(after, before))
    for partition in after.partitions:
        old = next((p for p in before.partitions if p.index == partition.index), None) if before else None
        lines.extend(_layer_lines(partition, old, len(after.partitions) > 1))
    return lines


def _cpu_line(after: Estimate, before: Optional[Estimate]) -> str:
    vela_cpu = _change(before.vela_cpu_operators if before else None, after.vela_cpu_operators)
    outside = ", ".join(after.outside) if after.outside else "none"
    line = f"CPU: Vela left {vela_cpu} operators to the CPU; the .pte runs outside the delegate: {outside}"
    if before is not None:
        added = sorted(set(after.outside) - set(before.outside))
        gone = sorted(set(before.outside) - set(after.outside))
        changes = [f"+{op}" for op in added] + [f"-{op}" for op in gone]
        if changes:
            line += f" (changed: {' '.join(changes)})"
    return line


def _keyed(layer_list: list[Layer]) -> dict[tuple[str, int], Layer]:
    """Layers by (label, occurrence): module path and operator, which an edit elsewhere leaves alone (TOSA names take
    graph-wide counters). Without a module, by name; layers Vela inserted are named by a running number (``#130``),
    which any edit shifts: those are matched by operator and occurrence instead."""
    seen: dict[str, int] = {}
    keyed = {}
    for layer in layer_list:
        name = layer.label if layer.module else f"#{layer.operator}" if layer.name.startswith("#") else layer.name
        n = seen.get(name, 0)
        seen[name] = n + 1
        keyed[(name, n)] = layer
    return keyed


def _layer_lines(partition: Partition, old: Optional[Partition], several: bool) -> list[str]:
    where = f" (partition {partition.index})" if several else ""
    if partition.layers is None:
        return [f"layers{where}: {partition.layers_note}"]
    if old is None or old.layers is None:
        slowest = sorted(partition.layers, key=lambda layer: -layer.cycles)[:3]
        top = ", ".join(f"{layer.label} {_num(layer.cycles)}" for layer in slowest)
        return [f"layers{where}: {len(partition.layers)}; most cycles: {top}"]
    now, then = _keyed(partition.layers), _keyed(old.layers)
    changed = []
    for key, layer in now.items():
        prev = then.get(key)
        if prev is None:
            changed.append((layer.cycles, f"+ {layer.label} {_num(layer.cycles)} cycles (new)"))
        elif prev.cycles != layer.cycles or prev.placement != layer.placement or prev.operator != layer.operator:
            placement = f", {prev.placement} -> {layer.placement}" if prev.placement != layer.placement else ""
            changed.append((abs(layer.cycles - prev.cycles), f"  {layer.label} cycles {_change(prev.cycles, layer.cycles)}{placement}"))
    for key, layer in then.items():
        if key not in now:
            changed.append((layer.cycles, f"- {layer.label} {_num(layer.cycles)} cycles (gone)"))
    if not changed:
        return [f"layers{where}: {len(partition.layers)}, none changed"]
    changed.sort(key=lambda c: -c[0])
    lines = [f"layers{where}: {len(changed)} changed of {len(partition.layers)} (Vela per-layer estimate, largest first):"]
    lines += [f"  {text}" for _, text in changed[:MAX_LAYER_LINES]]
    if len(changed) > MAX_LAYER_LINES:
        lines.append(f"  ... and {len(changed) - MAX_LAYER_LINES} more")
    return lines
