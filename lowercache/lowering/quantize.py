"""The quantization stage as a cached step.

The stage (``prepare_pt2e`` -> calibrate -> ``convert_pt2e`` -> re-export)
is a pure function of the float program, the calibration data, the
quantizer config and the compile spec, so it is a step of its own, kind
``quantize``. Inside it, observer qparams are steps too (``qparams.py``), so
a miss re-computes only observers whose statistics changed, and the
re-export is a step (``reexport.py``) that a weights edit serves from a
template.

Its output is stored without pickle (``programstore.py``).

One side effect of the stock stage is reproduced on a hit (the family's
``spec_after_quantize``): the Arm quantizer materializes the compile spec's default pass-pipeline config,
which the partitioner later serializes into the .pte. The entry records the
compile spec's digest after the stage; a hit applies the same
materialization and checks the digest, and recomputes on any difference.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Sequence

import torch

from .stored.programstore import FORMAT, FormatError, decode, encode_or_note
from ..speedups.gcfreeze import frozen_heap
from ..cache.steps import Session
from ..cache.store import Entry

log = logging.getLogger("lowercache")

# The stage's version is the version of the form it stores its output in.
QUANTIZE_VERSION = FORMAT

# Flow key parts that the quantization stage does not depend on.
_NOT_QUANTIZE_PARTS = ("flow", "target")


def quantize_parts(flow_parts: dict[str, str] | None) -> dict[str, str] | None:
    """Key parts of the stage: the flow's parts it depends on, and its own version."""
    if flow_parts is None:
        return None
    parts = {k: v for k, v in flow_parts.items() if k not in _NOT_QUANTIZE_PARTS}
    parts["stage"] = QUANTIZE_VERSION
    return parts


def convert(
    program: torch.export.ExportedProgram, target: Any, spec: Any, calibration: Sequence[tuple[Any, ...]]
) -> torch.fx.GraphModule:
    """The stock stage up to its re-export: prepare, calibrate, convert."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    prepared = prepare_pt2e(program.module(check_guards=False), target.quantizer(spec))
    for sample in calibration:
        prepared(*sample)
    return convert_pt2e(prepared)


def run_stock(
    program: torch.export.ExportedProgram,
    target: Any,
    spec: Any,
    example_inputs: tuple[Any, ...],
    calibration: Sequence[tuple[Any, ...]],
) -> torch.export.ExportedProgram:
    """The stock stage: prepare, calibrate, convert, re-export."""
    return torch.export.export(convert(program, target, spec, calibration), tuple(example_inputs))


@frozen_heap()  # why: gcfreeze.py; a no-op inside the flow's own freeze
def quantize(
    program: torch.export.ExportedProgram,
    target: Any,
    spec: Any,
    example_inputs: tuple[Any, ...],
    calibration: Sequence[tuple[Any, ...]],
    parts: dict[str, str] | None,
    session: Session,
) -> tuple[torch.export.ExportedProgram, Any]:
    """The stage through the ``quantize`` step: the quantized program, and the
    compile spec as the stock stage leaves it (for the partitioner)."""
    from . import reexport

    backend = importlib.import_module(target.family.hooks)  # the family's backend module (flow.backend)
    backend.import_quantizer()  # what the stock stage imports; a hit must too

    computed: list[torch.export.ExportedProgram] = []
    storing = parts is not None and session.store is not None

    def compute() -> Entry:
        converted = convert(program, target, spec, calibration)
        spec_digest = backend.compile_spec_digest(spec) if storing else ""
        result, stored = reexport.export(converted, example_inputs, spec_digest, session, storing)
        computed.append(result)
        return stored

    entry = session.run("quantize", target.name, parts, compute)
    if computed:
        return computed[0], spec
    try:
        backend.spec_after_quantize(spec)
        if entry.meta.get("compile_spec_after") != backend.compile_spec_digest(spec):
            raise FormatError("the compile spec would differ from the stock stage's")
        return decode(entry), spec
    except Exception as err:  # a stored program that does not rebuild is a miss, never a crash
        stored = entry.meta.get("stored", True)
        if stored:
            log.warning("cached quantized program unusable (%s); recomputing", err)
        fresh = target.compile_spec()
        result = run_stock(program, target, fresh, example_inputs, calibration)
        if stored and storing:
            session.replace("quantize", parts, encode_or_note(result, backend.compile_spec_digest(fresh), storing))
        return result, fresh
