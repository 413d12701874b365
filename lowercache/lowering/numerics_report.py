"""The numerics check's key, its stored figures and how they are said: torch-free, so a direct-mode hit can look a
check up and print it (``numerics.py`` runs the check)."""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

from ..cache.digests import digest
from ..cache.store import Entry
from ..cache.toolchain import version

# Part of the check's key; v1: outputs against the eager float model.
NUMERICS_VERSION = "numerics:v1"
MODES = ("outputs",)
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



def section(meta: dict[str, Any], parts: dict[str, str] | None) -> dict[str, Any]:
    """The manifest's ``numerics`` section from a check entry's metadata (a direct-mode hit builds it too)."""
    found = {k: meta[k] for k in ("samples", "reference_model", "partitions", "outputs", "error") if k in meta}
    found["semantics"] = "TOSA reference model (not Vela's command stream or the NPU) against the eager float model"
    if parts is not None:
        found["key_parts"] = parts
    return found


def stored(store: Any, recorded: Any, flow_key: str) -> tuple[dict[str, Any], Entry] | None:
    """The check a direct-mode record names, read without torch: its section and entry, or None (not stored, or the
    reference model or this module changed since, or the record is malformed)."""
    from ..cache.steps import step_key

    parts = recorded.get("key_parts") if isinstance(recorded, dict) else None
    if not isinstance(parts, dict) or parts.get("flow") != flow_key or not isinstance(parts.get("inputs"), str):
        return None
    now = check_parts(flow_key, parts["inputs"], str(parts.get("mode", "outputs")))
    if now != parts:
        return None
    entry = store.get("check", step_key("check", now))
    if entry is None or not isinstance(entry.meta.get("outputs"), list):
        return None
    return section(entry.meta, now), entry


# -- saying it -------------------------------------------------------------------------------------


def _number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def snr_text(value: Any) -> str:
    """An SNR as a person reads it: ``inf`` for an exact match."""
    return "inf" if value is None else f"{value:.1f} dB"


def lines(numerics: dict[str, Any] | None) -> list[str]:
    """What ``lower`` prints after its table: one line per output, then each rejected partition and any error."""
    if not numerics:
        return []
    n = numerics.get("samples", 0)
    return [f"numerics (TOSA reference model vs float, {n} input{'s' if n != 1 else ''}): {line}" for line in describe(numerics)]


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
    return {"numerics": {**{k: v for k, v in numerics.items() if k != "key_parts"}, **({"below_threshold": short} if short else {})}}
