"""The numerics check's key, its stored figures and how they are said: torch-free, so a direct-mode hit can look a
check up and print it (``numerics.py`` runs the check)."""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

from ...cache.digests import digest
from ...cache.store import Entry
from ...cache.toolchain import version

# Part of the check's key; v1: outputs against the eager float model.
NUMERICS_VERSION = "numerics:v1"
LAYERS_VERSION = "layers:v1"
# ``outputs``: the program's outputs on the TOSA reference model; ``layers``: that, and per module the quantized model
# against the float one (``numerics_layers.py``).
MODES = ("outputs", "layers")
# The figures each output gets, in the order tables print them.
FIGURES = ("max_abs", "mean_abs", "snr_db", "cosine", "top1")


def reference_model_version() -> str:
    """The installed reference model's version: it ships in tosa-tools."""
    return version("tosa-tools")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The check's source (``numerics.py``), so an edit there misses instead of serving old figures (its bytes: a
    direct-mode hit reads this without importing it)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "numerics.py"), "rb") as f:
        return f"{NUMERICS_VERSION}:{digest(f.read())}"


def check_parts(flow_key: str, inputs: str, mode: str = "outputs") -> dict[str, str]:
    """The check step's named key parts; torch-free, so direct mode can look a check up."""
    return {"flow": flow_key, "inputs": inputs, "mode": mode, "reference_model": reference_model_version(), "numerics": code_version()}


@functools.lru_cache(maxsize=1)
def layers_code_version() -> str:
    """The per-layer check's source (``numerics_layers.py``, and ``numerics.py`` whose figures it uses), read as bytes."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for name in ("numerics_layers.py", "numerics.py"):
        with open(os.path.join(here, name), "rb") as f:
            found.append(digest(f.read()))
    return f"{LAYERS_VERSION}:{digest(':'.join(found).encode())}"


def layers_parts(flow_key: str, inputs: str) -> dict[str, str]:
    """The ``layers`` step's named key parts: the lowering (its flow key covers the quantized program), the inputs, the code."""
    return {"flow": flow_key, "inputs": inputs, "layers": layers_code_version()}


def layers_section(meta: dict[str, Any], parts: dict[str, str] | None) -> dict[str, Any]:
    """The numerics section's ``layers`` part from a ``layers`` entry's metadata (a direct-mode hit builds it too).

    The entry holds each module's figures; depths and drops are derived here, so this module's code is not part of
    the entry's key."""
    found = {k: meta[k] for k in ("samples", "error") if k in meta}
    found["modules"] = layer_rows(meta.get("modules") or [])
    found["semantics"] = "the quantized program (q/dq graph, run in torch) against the float program at each module's output"
    if parts is not None:
        found["key_parts"] = parts
    return found


def layer_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-module rows in the order their boundaries run, each with its depth and ``drop_db``: how many dB lower its
    SNR is than the row before it at the same depth (None for the first, or where either is exact)."""
    before: dict[int, Any] = {}
    found = []
    for row in rows:
        depth = str(row["module"]).count(".") + 1
        prev, now = before.get(depth, "none"), row.get("snr_db")
        drop = round(prev - now, 4) if isinstance(prev, (int, float)) and isinstance(now, (int, float)) else None
        found.append({**row, "depth": depth, **({"from_snr_db": prev} if prev != "none" else {}), "drop_db": drop})
        before[depth] = now
    return found


def largest_drop(layers: dict[str, Any] | None) -> dict[str, Any] | None:
    """The module whose SNR falls most against the one before it (the first with a finite SNR after an exact one
    when none falls): where the error enters."""
    rows = (layers or {}).get("modules") or []
    dropping = [r for r in rows if isinstance(r.get("drop_db"), (int, float)) and r["drop_db"] > 0]
    if dropping:
        return max(dropping, key=lambda r: r["drop_db"])
    return next((r for r in rows if r.get("snr_db") is not None), None)



def section(meta: dict[str, Any], parts: dict[str, str] | None) -> dict[str, Any]:
    """The manifest's ``numerics`` section from a check entry's metadata (a direct-mode hit builds it too)."""
    found = {k: meta[k] for k in ("samples", "reference_model", "partitions", "outputs", "error") if k in meta}
    found["semantics"] = "TOSA reference model (not Vela's command stream or the NPU) against the eager float model"
    if parts is not None:
        found["key_parts"] = parts
    return found


def stored(store: Any, recorded: Any, flow_key: str, mode: str = "outputs") -> tuple[dict[str, Any], Entry] | None:
    """The check a direct-mode record names, read without torch: its section and entry, or None (not stored, or the
    reference model or this module changed since, or the record is malformed). ``mode`` "layers": the per-layer
    entry it names too."""
    from ...cache.steps import step_key

    parts = recorded.get("key_parts") if isinstance(recorded, dict) else None
    if not isinstance(parts, dict) or parts.get("flow") != flow_key or not isinstance(parts.get("inputs"), str):
        return None
    now = check_parts(flow_key, parts["inputs"], str(parts.get("mode", "outputs")))
    if now != parts:
        return None
    entry = store.get("check", step_key("check", now))
    if entry is None or not isinstance(entry.meta.get("outputs"), list):
        return None
    found = section(entry.meta, now)
    if mode == "layers":
        layers = _stored_layers(store, recorded.get("layers"), flow_key, parts["inputs"])
        if layers is None:
            return None
        found["layers"] = layers
    return found, entry


def _stored_layers(store: Any, recorded: Any, flow_key: str, inputs: str) -> dict[str, Any] | None:
    from ...cache.steps import step_key

    now = layers_parts(flow_key, inputs)
    if not isinstance(recorded, dict) or recorded.get("key_parts") != now:
        return None
    entry = store.get("layers", step_key("layers", now))
    if entry is None or not isinstance(entry.meta.get("modules"), list):
        return None
    return layers_section(entry.meta, now)


# -- saying it -------------------------------------------------------------------------------------


def _number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def snr_text(value: Any) -> str:
    """An SNR as a person reads it: ``inf`` for an exact match."""
    return "inf" if value is None else f"{value:.1f} dB"


def lines(numerics: dict[str, Any] | None) -> list[str]:
    """What ``lower`` prints after its table: one line per output, then each rejected partition and any error, then
    (``--check=layers``) the per-layer table."""
    if not numerics:
        return []
    n = numerics.get("samples", 0)
    said = [f"numerics (TOSA reference model vs float, {n} input{'s' if n != 1 else ''}): {line}" for line in describe(numerics)]
    return said + layer_lines(numerics)


# The per-layer table on a terminal: modules this deep or shallower (every module is in manifest.json and --json).
SHOWN_DEPTH = 2


def layer_lines(numerics: dict[str, Any] | None) -> list[str]:
    """What ``lower --check=layers`` prints: a table of the shallow modules' SNR, drop and max abs error, then where
    the error enters."""
    layers = (numerics or {}).get("layers")
    if not layers:
        return []
    n = layers.get("samples", 0)
    head = f"numerics per layer (quantized model vs float at each module's output, {n} input{'s' if n != 1 else ''}):"
    if layers.get("error"):
        return [f"{head} {layers['error']}"]
    rows = layers.get("modules") or []
    shown = [r for r in rows if r.get("depth", 1) <= SHOWN_DEPTH]
    width = max([len("module"), *(len(str(r["module"])) for r in shown)])
    said = [head, f"  {'module':<{width}}  {'SNR':>9}  {'drop':>8}  {'max abs':>9}"]
    for r in shown:
        drop = f"{r['drop_db']:.1f} dB" if isinstance(r.get("drop_db"), (int, float)) else "-"
        said.append(f"  {str(r['module']):<{width}}  {snr_text(r.get('snr_db')):>9}  {drop:>8}  {_number(r.get('max_abs')):>9}")
    if len(shown) < len(rows):
        said.append(f"  ({len(rows) - len(shown)} deeper modules in manifest.json)")
    worst = largest_drop(layers)
    if worst is not None:
        if "from_snr_db" in worst:
            said.append(f"error enters at {worst['module']}: SNR drops from {snr_text(worst['from_snr_db'])} to {snr_text(worst.get('snr_db'))}")
        else:
            said.append(f"error enters at {worst['module']}: SNR {snr_text(worst.get('snr_db'))}")
    return said


def read(out_dir: Any) -> dict[str, Any] | None:
    """The ``numerics`` section of the manifest a lowering wrote into ``out_dir`` (None: none, or unreadable)."""
    try:
        with open(os.path.join(out_dir, "manifest.json"), encoding="utf-8") as f:
            found = json.load(f).get("numerics")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def _change(now: Any, before: Any, digits: int, unit: str = "") -> str:
    if not isinstance(now, (int, float)) or not isinstance(before, (int, float)):
        return "" if now == before else " (was " + ("inf" if before is None else f"{before:.{digits}f}{unit}") + ")"
    step = now - before
    return " (=)" if round(step, digits) == 0 else f" ({step:+.{digits}f}{unit})"


def describe(now: dict[str, Any] | None, before: dict[str, Any] | None = None) -> list[str]:
    """One line per output, each figure with its change against ``before`` (an earlier lowering's section), as
    ``watch`` and the build report say them; then rejected partitions and any error."""
    if not now:
        return []
    earlier = {o.get("output"): o for o in (before or {}).get("outputs", [])} if before else {}
    said = []
    for o in now.get("outputs", []):
        b = earlier.get(o.get("output"))
        text = f"output {o['output']} {tuple(o.get('shape', ()))}: SNR {snr_text(o.get('snr_db'))}"
        if b is not None:
            text += _change(o.get("snr_db"), b.get("snr_db"), 1, " dB")
            text += f", cosine {_number(o.get('cosine'), 6)}{_change(o.get('cosine'), b.get('cosine'), 6)}"
            text += f", max abs {_number(o.get('max_abs'))}{_change(o.get('max_abs'), b.get('max_abs'), 4)}"
        else:
            text += f", cosine {_number(o.get('cosine'), 6)}, max abs {_number(o.get('max_abs'))}"
        text += f", mean abs {_number(o.get('mean_abs'))}"
        if o.get("top1") is not None:
            text += f", top-1 {o['top1'] * 100:.1f}% of {o.get('top1_rows')}"
            if b is not None and b.get("top1") is not None:
                text += _change(o["top1"] * 100, b["top1"] * 100, 1, " pts")
        said.append(text)
    for p in now.get("partitions", []):
        if p.get("status") == "rejected":
            said.append(f"partition {p['partition']} rejected by the reference model: {p.get('reason')}")
    if now.get("error"):
        said.append(str(now["error"]))
    return said


def summary(numerics: dict[str, Any] | None) -> dict[str, Any] | None:
    """A lowering's check in one row (the build report): the worst of each figure over its outputs, and any failure."""
    if not numerics:
        return None
    outputs = numerics.get("outputs") or []
    row: dict[str, Any] = {"samples": numerics.get("samples")}
    snrs = [o.get("snr_db") for o in outputs]
    if outputs:
        row["snr_db"] = min((v for v in snrs if v is not None), default=None)  # None: every output exact
        row["cosine"] = min(o.get("cosine", 0.0) for o in outputs)
        row["max_abs"] = max(o.get("max_abs", 0.0) for o in outputs)
        top1 = [o["top1"] for o in outputs if o.get("top1") is not None]
        if top1:
            row["top1"] = min(top1)
    rejected = [p["partition"] for p in numerics.get("partitions", []) if p.get("status") == "rejected"]
    if rejected:
        row["rejected_partitions"] = rejected
    if numerics.get("error"):
        row["error"] = numerics["error"]
    return row


def snr_drop(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """How many dB the worst SNR fell between two :func:`summary` rows (negative: it rose); inf when the check no longer
    compares; None when either has no check."""
    if not before or not after or "snr_db" not in before and "error" not in before:
        return None
    if "error" in after or "snr_db" not in after:
        return math.inf if "error" not in before else None
    old, new = before.get("snr_db"), after.get("snr_db")
    if old is None and new is None:
        return 0.0
    if old is None:  # was exact
        return math.inf
    if new is None:
        return -math.inf
    return old - new


def worst_snr(numerics: dict[str, Any] | None) -> float | None:
    """The lowest SNR of any output (None: no check, or every output exact); -inf when the check could not compare."""
    if not numerics:
        return None
    if numerics.get("error") or not numerics.get("outputs"):
        return -math.inf
    values = [o["snr_db"] for o in numerics["outputs"] if o.get("snr_db") is not None]
    return min(values) if values else None


def below(numerics: dict[str, Any] | None, min_snr: float | None) -> str | None:
    """Why the check falls short of ``min_snr`` dB (a rejected partition or an output under it), or None."""
    if min_snr is None or numerics is None:
        return None
    worst = worst_snr(numerics)
    if worst is None or worst >= min_snr:
        return None
    if worst == -math.inf:
        return f"the numerics check could not compare outputs ({numerics.get('error', 'no outputs')}), and --min-snr is {min_snr:g} dB"
    return f"an output's SNR is {worst:.1f} dB, below --min-snr {min_snr:g} dB"


def json_part(numerics: dict[str, Any] | None, short: str | None = None) -> dict[str, Any]:
    """The ``numerics`` key of ``--json``: the figures without the key parts, and ``below``'s verdict when there is one."""
    if numerics is None:
        return {}
    found = {k: v for k, v in numerics.items() if k != "key_parts"}
    if isinstance(found.get("layers"), dict):
        found["layers"] = {k: v for k, v in found["layers"].items() if k != "key_parts"}
    return {"numerics": {**found, **({"below_threshold": short} if short else {})}}
