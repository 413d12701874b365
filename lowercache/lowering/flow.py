"""The lowering flow: stock ExecuTorch Arm lowering as one cached step.

The flow is exactly the documented stock one (README, "The flow"):
export -> [prepare_pt2e -> calibrate -> convert_pt2e -> re-export] ->
to_edge_transform_and_lower -> to_executorch. Inside it, the quantization
stage (``quantize.py``) and every partition's TOSA lowering and Vela compile
(``arm.py``) are cached steps of their own.
The whole flow is keyed by the exported program's content, the calibration
data, the quantizer config, the compile spec and the toolchain, so an
unchanged model costs an export and a hash.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .check import numerics, numerics_layers
from . import partitionorder, quantize
from .. import delegation as delegation_report
from ..speedups import fastcopy, registry, retrace, stacklines
from ..speedups.gcfreeze import frozen_heap
from ..cache.hashing import Unhashable, digest, digest_json, inputs_digest, program_parts
from ..cache.steps import Session, activate, listed, outcome_counts, step_key
from ..cache.store import Entry, Store
from ..targets import FAMILIES, Target
from ..cache.toolchain import toolchain_parts
from . import arithmetic

# The stack a lowering imports (thousands of modules), every family's: the warm server imports it once; an in-process
# ``lower`` that records (direct mode) imports it before the backstop below Python starts, which would trace each import.
STACK = ("executorch.exir", *dict.fromkeys(m for f in FAMILIES for m in f.stack), "torchao.quantization.pt2e.quantize_pt2e",
         "torch.export")
# What the export alone imports (``torch.export`` loads the rest on its first call): a run whose flow step hits needs no more.
EXPORT_STACK = ("torch.export._trace",)


def import_stack(lowering: bool = True) -> None:
    """Import :data:`STACK` now (as a lowering would later), or with ``lowering`` False only :data:`EXPORT_STACK`."""
    for name in STACK if lowering else EXPORT_STACK:
        importlib.import_module(name)


def stack_imported() -> bool:
    """Whether :data:`STACK` is imported already (the warm server and its children)."""
    return all(name in sys.modules for name in STACK)

# Names the stock flow below; part of the flow key. v2: partitions lowered in
# discovery order (partitionorder.py); v1 entries followed the hash seed.
FLOW_VERSION = "export>prepare_pt2e>calibrate>convert_pt2e>export>to_edge_transform_and_lower>to_executorch:v2"

Inputs = tuple[Any, ...]


@dataclass
class Artifacts:
    """What a lowering produces: files by name (``model.pte`` and per-partition outputs)."""

    files: dict[str, bytes]
    records: list[dict[str, Any]] = field(default_factory=list)
    parts: dict[str, str] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)  # retraced vs copied in ExportPass retraces, and fast copies
    delegation: dict[str, Any] | None = None  # what runs outside the delegate (lowercache/delegation.py)
    numerics: dict[str, Any] | None = None  # with check: the TOSA reference model against the float model (numerics.py)

    @property
    def pte(self) -> bytes:
        return self.files["model.pte"]

    @property
    def tosa(self) -> list[bytes]:
        return [v for k, v in sorted(self.files.items()) if k.endswith(".tosa")]


class Stages:
    """Times the flow's stages and tells the listener which one is running."""

    def __init__(self, session: Session):
        self.session = session
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        self.session.emit("stage", None, name)
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def backend(target: Target) -> Any:
    """The lowercache module that hooks ``target``'s backend: its family's ``hooks`` (``arm.py`` for the Arm families)."""
    return importlib.import_module(target.family.hooks)


def export(module: torch.nn.Module, example_inputs: Inputs) -> torch.export.ExportedProgram:
    with stacklines.when_on():  # why: stacklines.py
        return torch.export.export(module, tuple(example_inputs))


def target_spec_digest(target: Target, store: Store | None) -> str:
    """Digest of the target's compile spec, memoized per toolchain in the store.

    Building a compile spec imports the Arm backend (seconds); the spec is a
    pure function of the target name, Vela's options and the backend's sources, which the
    toolchain digest covers, so a warm run need not import it. A tiered store
    shares the memo through its remote, so a remote hit need not either; a
    remembered value that is not a digest is ignored.
    """
    options = digest_json([target.name, target.system_config, target.memory_mode])  # each Vela option its own spec
    name = f"memo/compile_spec/{target.name}/{options}/{digest_json(toolchain_parts())}"
    remembered = store.get_record(name) if store is not None else None
    if isinstance(remembered, str) and re.fullmatch(r"[0-9a-f]{32}", remembered):
        return remembered
    value = backend(target).compile_spec_digest(target.compile_spec())
    if store is not None:
        store.put_record(name, value)
    return value


def flow_parts(
    program: torch.export.ExportedProgram,
    target: Target,
    example_inputs: Inputs,
    calibration: Sequence[Inputs],
    store: Store | None = None,
) -> dict[str, str] | None:
    """Named key parts of the whole flow, or None when the program cannot be keyed."""
    try:
        parts = {f"program.{k}": v for k, v in program_parts(program).items()}
        parts["example_inputs"] = inputs_digest([example_inputs])
        parts["calibration"] = inputs_digest(calibration) if target.quantized else "unused"
    except Unhashable:
        return None
    insertions = backend(target).pass_insertions_digest()
    if insertions is None:
        return None
    parts["quantizer"] = target.quantization_config
    parts["target"] = target.name
    # Vela's options: in the compile spec (so the .pte's delegate specs and Vela's flags), not in the TOSA step's
    parts["system_config"] = target.system_config or "default"
    parts["memory_mode"] = target.memory_mode or "default"
    parts["compile_spec"] = target_spec_digest(target, store)
    parts["pass_insertions"] = insertions
    parts["flow"] = FLOW_VERSION
    parts.update(arithmetic.step_parts())
    parts.update(backend(target).backend_source_parts())
    return parts


def run_stock(
    program: torch.export.ExportedProgram,
    target: Target,
    example_inputs: Inputs,
    calibration: Sequence[Inputs],
    stages: Stages | None = None,
    session: Session | None = None,
    parts: dict[str, str] | None = None,
    partition_orders: list[list[str]] | None = None,
    delegation: list[dict[str, Any]] | None = None,
    programs: list[Any] | None = None,
    quantized: list[Any] | None = None,
) -> bytes:
    """The stock ExecuTorch flow from an exported program; returns the .pte bytes.

    With a ``session``, the quantization stage runs as its cached step
    (``quantize.py``, keyed by the flow's ``parts``); without, it is the stock code.
    ``partition_orders`` collects the order the partitions were lowered in
    (see ``partitionorder.py``); ``delegation`` what the edge program runs
    outside its delegates, read before ``to_executorch`` (which it does not change);
    ``programs`` the exported program ``to_executorch`` leaves (the numerics check runs it); ``quantized`` the
    quantized program (the per-layer check runs it).
    """
    from executorch.exir import to_edge_transform_and_lower

    run = stages.run if stages is not None else (lambda _name, fn: fn())
    spec = target.compile_spec()
    if target.quantized:
        if session is None:
            program = run("quantize", lambda: quantize.run_stock(program, target, spec, example_inputs, calibration))
        else:
            step_parts = quantize.quantize_parts(parts)
            program, spec = run(
                "quantize",
                lambda: quantize.quantize(program, target, spec, example_inputs, calibration, step_parts, session),
            )
        if quantized is not None:
            quantized.append(program)
    partitioner = target.partitioner(spec)
    if partition_orders is not None:
        partitionorder.record_order(partitioner, partition_orders)
    edge = run("to_edge", lambda: to_edge_transform_and_lower(program, partitioner=[partitioner]))
    if delegation is not None:
        delegation.append(delegation_report.summarize(edge.exported_program().graph_module))
    manager = run("to_executorch", lambda: _with_buffer(edge.to_executorch()))
    if programs is not None:
        programs.append(manager.exported_program())
    return manager.buffer


def _with_buffer(manager: Any) -> Any:
    manager.buffer  # serialized inside the stage's time, as before
    return manager


@frozen_heap()  # why: gcfreeze.py
def lower_program(
    program: torch.export.ExportedProgram,
    target: Target,
    example_inputs: Inputs,
    calibration: Sequence[Inputs] | None,
    session: Session,
    stages: Stages | None = None,
    check: str = "",
) -> Artifacts:
    """Lower an exported program through the cached flow step; ``check`` "outputs": then the numerics check
    (numerics.py), "layers": that and the per-layer one (numerics_layers.py)."""
    stages = stages or Stages(session)
    check_samples = [tuple(example_inputs), *(calibration or [])]
    calibration = list(calibration) if calibration is not None else [tuple(example_inputs)]
    programs: list[Any] = []
    quantized: list[Any] | None = [] if check == "layers" else None
    parts = stages.run("hash", lambda: flow_parts(program, target, example_inputs, calibration, session.store))

    def compute() -> Entry:
        # Hooks only around the computation: installing them imports the Arm
        # backend (seconds), which a hit does not need.
        # A stage of its own so that its seconds in a new process are not said to be quantize's.
        stages.run("backend", backend(target).import_backend)
        found: list[dict[str, Any]] = []
        with backend(target).hooks(), activate(session):
            before = {k: len(session.outputs.get(k, [])) for k in target.family.steps}
            pte = run_stock(program, target, example_inputs, calibration, stages, session, parts, delegation=found, programs=programs,
                            quantized=quantized)
        blobs = {"model.pte": bytes(pte)}
        made = {kind: session.outputs.get(kind, [])[before[kind] :] for kind in target.family.steps}
        for kind, entries in made.items():
            for i, entry in enumerate(entries):
                blobs.update(target.family.files(kind, i, entry.blobs))
        first = made[target.family.steps[0]] if target.family.steps else []  # a partition's tensor names come from it
        tensor_modules = [entry.meta.get("tensor_modules", {}) for entry in first]
        summary = {**found[0], "kernels": delegation_report.kernels(blobs["model.pte"]), "tensor_modules": tensor_modules}
        return Entry(meta={"delegation": summary}, blobs=blobs)

    retrace.reset_stats()
    fastcopy.reset_stats()
    entry = session.run("flow", target.name, parts, compute)
    counts = retrace.stats()
    checked = None
    if check:

        def lowered() -> tuple[Any, dict[str, bytes]]:
            if not programs:  # the flow was a hit: lower again, its inner steps served from the cache
                with backend(target).hooks(), activate(session):
                    run_stock(program, target, example_inputs, calibration, stages, session, parts, programs=programs, quantized=quantized)
            return programs[-1], dict(entry.blobs)

        def quantized_program() -> Any:
            if not target.quantized or quantized is None:
                return None
            if not quantized:  # the flow and the outputs check were hits: the quantize step, served from the cache
                with backend(target).hooks(), activate(session):
                    spec = target.compile_spec()
                    quantized.append(quantize.quantize(program, target, spec, example_inputs, calibration, quantize.quantize_parts(parts), session)[0])
            return quantized[-1]

        flow_key = step_key("flow", parts) if parts is not None else None
        checked = stages.run("check", lambda: numerics.check(session, flow_key, check_samples, program, lowered))
        if check == "layers":
            checked["layers"] = stages.run("layers", lambda: numerics_layers.check(session, flow_key, check_samples, program, quantized_program))
    return Artifacts(
        files=dict(entry.blobs),
        records=[r.to_json() for r in session.records],
        parts=parts or {},
        stages=stages.seconds,
        nodes={"retraced": counts["redispatched"], "copied": counts["reused"], "copied_fast": fastcopy.stats()["copied"]},
        delegation=entry.meta.get("delegation"),
        numerics=checked,
    )


@frozen_heap()  # why: gcfreeze.py
def lower_module(
    module: torch.nn.Module,
    example_inputs: Inputs,
    target: Target,
    calibration: Sequence[Inputs] | None,
    session: Session,
    check: str = "",
) -> Artifacts:
    """Export ``module`` and lower it through the cached flow."""
    stages = Stages(session)
    program = stages.run("export", lambda: export(module, example_inputs))
    return lower_program(program, target, example_inputs, calibration, session, stages, check)


def flow_key(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Inputs,
    target: Target,
    calibration: Sequence[Inputs] | None,
    session: Session,
) -> str | None:
    """The flow step's key without lowering: the export (of a module) and the key's hashing, as :func:`lower_module`
    and :func:`lower_program` run them. The warm server confirms a direct-mode record so (``direct.confirm``)."""
    stages = Stages(session)
    program = model if isinstance(model, torch.export.ExportedProgram) else stages.run("export", lambda: export(model, example_inputs))
    calibration = list(calibration) if calibration is not None else [tuple(example_inputs)]
    parts = stages.run("hash", lambda: flow_parts(program, target, example_inputs, calibration, session.store))
    return step_key("flow", parts) if parts is not None else None


def manifest(artifacts: Artifacts, target: Target, model: str) -> dict[str, Any]:
    """The manifest written beside the artifacts: keys, toolchain, steps, files."""
    return {
        "model": model,
        "target": target.name,
        "quantization": target.quantization_config,
        "toolchain": toolchain_parts(),
        "speedups": registry.report(check=False, family=target.family.name),
        "key_parts": artifacts.parts,
        "stages": {k: round(v, 4) for k, v in artifacts.stages.items()},
        "steps": listed(artifacts.records),
        "step_counts": outcome_counts(artifacts.records),
        "nodes": artifacts.nodes,
        "passes": [
            {"pass": r["name"], "outcome": r["outcome"], "seconds": round(r["seconds"], 4), "nodes": r.get("nodes", {})}
            for r in artifacts.records
            if r["kind"] == "pass"
        ],
        "files": {name: {"size": len(data), "xxh3_128": digest(data)} for name, data in sorted(artifacts.files.items())},
        **({"delegation": artifacts.delegation} if artifacts.delegation is not None else {}),
        **({"numerics": artifacts.numerics} if artifacts.numerics is not None else {}),
    }
