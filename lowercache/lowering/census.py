"""The pass census: which Arm passes act within a region, by evidence.

Replaying a region's pipeline output across runs is exact only if every pass
that runs on it acts within the region, or reads across its boundary only
facts that can be checked. The census finds out, pass by pass, on a real
model: it runs the TOSA backend pipeline on the partition's edge program one
pass at a time, as stock does, and before each pass cuts the graph into
regions (``regions.py``) and runs a fresh instance of the same pass on each
region extracted as a standalone program. It then compares each region's
nodes in the whole graph's result with the standalone result:

- ``local``: same nodes, arguments, metadata, constants and names;
- ``local given facts``: the same but for names, which are read across the
  boundary: ``name counter`` (the retrace numbers nodes over the whole graph;
  ``offset``: a per-stem counter at the region's start decides them,
  ``renumbered``: they interleave with other regions') or ``constant names``
  (a constant shared with another region, e.g. one of a set of equal constants);
- ``global``: the nodes differ (a layout chosen across the boundary, nodes
  moved between regions, a constant folded from another region's), or the
  pass cannot run on the region alone.

A pass that changed nothing on the whole graph nor on any region was not
exercised by the model and is counted apart: the census has no evidence
about it. The per-pass split is checked against the stock pipeline run in
one go on a copy (``faithful``). The result is JSON, a cached step (kind
``census``) keyed by the model, target, depth and toolchain identity.
"""

from __future__ import annotations

import collections
import copy
import json
import time
from typing import Any, Sequence

import torch

from . import quantize, regions
from ..cache.steps import Session
from ..cache.store import Entry
from .targets import Target

CENSUS_VERSION = "census:v1"
LOCAL, GIVEN_FACTS, GLOBAL, UNEXERCISED = "local", "local given facts", "global", "not exercised"
CLASSES = (LOCAL, GIVEN_FACTS, GLOBAL, UNEXERCISED)

# Ops that only move data between layouts: a difference made of these is a layout choice.
_LAYOUT_OPS = ("permute", "transpose", "view", "squeeze", "reshape")


class _Captured(Exception):
    """Stops the lowering once the partition's edge program is in hand."""

    def __init__(self, program: Any, compile_spec: Any):
        super().__init__("captured")
        self.program = program
        self.compile_spec = compile_spec


def pipeline_input(program: torch.export.ExportedProgram, target: Target, example_inputs: Sequence[Any], calibration: Sequence[Any]) -> tuple[Any, Any]:
    """The first partition's edge program as ``TOSABackend._preprocess`` receives it, and its compile spec.

    The stock flow up to the backend (quantized targets: stock quantization),
    stopped at the preprocess call; nothing after it runs.
    """
    import executorch.backends.arm.tosa.backend as backend
    from executorch.exir import to_edge_transform_and_lower

    spec = target.compile_spec()
    if target.quantized:
        program = quantize.run_stock(program, target, spec, example_inputs, calibration)
    partitioner = target.partitioner(spec)

    def capture(edge_program: Any, compile_spec: Any) -> Any:
        raise _Captured(edge_program, compile_spec)

    original = backend.TOSABackend._preprocess
    backend.TOSABackend._preprocess = staticmethod(capture)
    try:
        to_edge_transform_and_lower(program, partitioner=[partitioner])
    except _Captured as captured:
        return captured.program, captured.compile_spec
    finally:
        backend.TOSABackend._preprocess = staticmethod(original)
    raise ValueError("the model has no partition for this target")


def _pipeline(compile_spec: Any, program: Any) -> list[Any]:
    """The TOSA pipeline's pass instances for ``program``, built as stock builds them, not run."""
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    manager = ArmPassManager(compile_spec)
    manager._transform = lambda exported_program, graph_module: graph_module
    manager._tosa_pipeline(program, program.graph_module)
    return list(manager.passes)


def _run_pass(graph_pass: Any, program: Any) -> tuple[Any, bool]:
    """One pass on ``program`` as the Arm pass manager runs it (adapter, pass manager, checks)."""
    from executorch.backends.arm._passes.arm_pass_manager import _ExportedProgramGraphPassAdapter
    from executorch.exir.pass_manager import ExportedProgramPassManager

    result = ExportedProgramPassManager([_ExportedProgramGraphPassAdapter(graph_pass)])(program)
    return result.exported_program, bool(result.modified)


def _applicable(graph_pass: Any, program: Any) -> bool:
    check = getattr(graph_pass, "should_run_pass", None)
    return True if check is None else bool(check(program.graph_module))


def _op_names(form: regions.RegionForm) -> list[str]:
    return [f[1].removeprefix("schema:").split("(")[0] for f in form.nodes if f[0] != "constants"]


def _difference(whole: regions.RegionForm, alone: regions.RegionForm) -> str:
    """What differs between a region's nodes in the whole graph and alone, in a few words."""
    w, a = _op_names(whole), _op_names(alone)
    counts = collections.Counter(w)
    counts.subtract(collections.Counter(a))
    extra = sorted(f"{op} {n:+d}" for op, n in counts.items() if n)
    if extra:
        moved = [op for op in extra if any(k in op for k in _LAYOUT_OPS)]
        kind = "layout across the boundary" if moved and len(moved) == len(extra) else "nodes differ"
        return f"{kind}: whole minus alone: {', '.join(extra)[:200]}"
    if whole.constants != alone.constants:
        return "constant values differ"
    if whole.boundary != alone.boundary:
        return _boundary_difference(whole.boundary, alone.boundary)
    for i, (fw, fa) in enumerate(zip(whole.nodes, alone.nodes)):
        if fw != fa:
            what = "arguments" if fw[:4] != fa[:4] else "metadata"
            return f"{what} of node {i} ({fw[1]}) differ"
    return "nodes differ"


def _boundary_difference(whole: dict[str, list[Any]], alone: dict[str, list[Any]]) -> str:
    """Which boundary tensor differs, and in what (tensor meta, dim order, qparams, ...)."""
    for side in ("in", "out"):
        w, a = whole[side], alone[side]
        if len(w) != len(a):
            return f"boundary {side}puts differ: {len(w)} in the whole graph, {len(a)} alone"
        for i, (fw, fa) in enumerate(zip(w, a)):
            if fw != fa:
                facts_w = fw[1] if side == "out" else fw
                facts_a = fa[1] if side == "out" else fa
                keys = ["tensor" if j == 0 else str(x[0]) for j, (x, y) in enumerate(zip(facts_w, facts_a)) if x != y]
                if len(facts_w) != len(facts_a):
                    keys.append("which facts")
                return f"boundary {side}put {i} differs in {', '.join(keys) or 'position'}"
    return "boundary tensors differ"


def compare(whole: Any, whole_members: dict[Any, str], region: str, alone: Any) -> dict[str, Any]:
    """The verdict for one region: its nodes in the whole result against the standalone result."""
    mine = [n for n in whole.graph_module.graph.nodes if whole_members.get(n) == region]
    theirs = [n for n in alone.graph_module.graph.nodes if regions.is_region_node(n)]
    fw, fa = regions.region_form(whole, mine), regions.region_form(alone, theirs)
    facts = []
    if fw.nodes != fa.nodes or fw.constants != fa.constants or fw.boundary["out"] != fa.boundary["out"]:
        return {"class": GLOBAL, "facts": [_difference(fw, fa)]}
    if fw.boundary["in"] != fa.boundary["in"]:
        # Its own nodes are the same; what it reads changed because the pass changed the producer.
        changed = [i for i, (w, a) in enumerate(zip(fw.boundary["in"], fa.boundary["in"])) if w != a]
        if len(fw.boundary["in"]) != len(fa.boundary["in"]):
            return {"class": GLOBAL, "facts": [_difference(fw, fa)]}
        by_name = {n.name: n for n in whole.graph_module.graph.nodes}
        producers = sorted({whole_members.get(by_name[fw.inputs[i]], "(input)") for i in changed})
        facts.append("input facts set by the producing region")
        verdict = {"producers": producers, "why": _difference(fw, fa)}
    else:
        verdict = {}
    if fw.names != fa.names:
        facts.append(f"name counter ({regions.name_relation(fw.names, fa.names)})")
    if fw.constant_names != fa.constant_names:
        shared = _shared_constants(whole, whole_members, region, fw.constant_names)
        facts.append("constant names (equal-constant set)" if shared else "constant names")
    return {"class": GIVEN_FACTS if facts else LOCAL, "facts": facts, **verdict}


def _shared_constants(program: Any, members: dict[Any, str], region: str, names: list[str]) -> bool:
    """Whether a constant this region reads is read by another region too."""
    by_name = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    return any(members.get(u, region) != region for name in names for u in by_name[name].users)


def _check_producers(verdicts: dict[str, dict[str, Any]]) -> None:
    """A region whose inputs changed is local given facts only if each producer acted locally itself.

    Repeated until nothing changes: a producer found global makes its consumers global.
    """
    changed = True
    while changed:
        changed = False
        for verdict in verdicts.values():
            producers = verdict.get("producers", [])
            if verdict["class"] != GLOBAL and any(verdicts.get(p, {}).get("class") == GLOBAL for p in producers):
                verdict["class"] = GLOBAL
                verdict["facts"] = [f"reads an input a global producer changed ({verdict['why']})"]
                changed = True


def _worst(verdicts: list[dict[str, Any]]) -> str:
    classes = {v["class"] for v in verdicts}
    return GLOBAL if GLOBAL in classes else GIVEN_FACTS if GIVEN_FACTS in classes else LOCAL


def run_census(edge_program: Any, compile_spec: Any, depth: int = 1) -> dict[str, Any]:
    """Classify every pass of the TOSA pipeline on ``edge_program`` (which it consumes).

    Each region gets its own pipeline, built once from the region as first
    extracted, as stock builds one per program: the pass manager's adapter
    points a pass at the program it runs on, so pass ``i`` of a region's
    pipeline runs on that region as cut just before pass ``i``.
    """
    from executorch.backends.arm.tosa.specification import TosaLoweringContext

    reference = copy.deepcopy(edge_program)
    passes = _pipeline(compile_spec, edge_program)
    state, rows = edge_program, []
    first_regions = [r.name for r in regions.cut(state.graph_module, depth)]
    pipelines: dict[str, list[Any]] = {}  # per region, built once as stock builds one per program
    with TosaLoweringContext(compile_spec.tosa_spec):
        for index, graph_pass in enumerate(passes):
            rows.append(_census_one(index, graph_pass, state, compile_spec, depth, pipelines))
            state = rows[-1].pop("result")
        faithful = regions.whole_form(state) == regions.whole_form(_stock_program(reference, compile_spec))
    return {"depth": depth, "regions": first_regions, "passes": rows, "faithful": faithful}


def _census_one(index: int, graph_pass: Any, state: Any, compile_spec: Any, depth: int, pipelines: dict[str, list[Any]]) -> dict[str, Any]:
    name = type(graph_pass).__name__
    members = regions.membership(state.graph_module, depth)
    names = list(dict.fromkeys(members.values()))
    applicable = _applicable(graph_pass, state)
    alone_inputs = {r: regions.extract(state, members, r) for r in names} if applicable else {}
    start = time.perf_counter()
    result, modified = _run_pass(graph_pass, state)
    seconds = time.perf_counter() - start
    row: dict[str, Any] = {"index": index, "pass": name, "seconds": round(seconds, 5), "result": result}
    if not applicable:
        row.update({"outcome": "skip", "class": UNEXERCISED, "facts": [], "regions": {}})
        return row
    after = regions.membership(result.graph_module, depth) if modified else members
    verdicts, touched = {}, modified
    for region, program in alone_inputs.items():
        try:
            if region not in pipelines:
                pipelines[region] = _pipeline(compile_spec, program)
            fresh = pipelines[region][index]
            if type(fresh) is not type(graph_pass):
                raise RuntimeError(f"pipeline for the region differs at {index}: {type(fresh).__name__}")
            alone, alone_modified = _run_pass(fresh, program)
        except Exception as e:  # a pass that cannot run on the region alone reads the whole graph
            verdicts[region] = {"class": GLOBAL, "facts": [f"fails alone: {type(e).__name__}: {str(e)[:160]}"]}
            touched = True
            continue
        touched = touched or alone_modified
        verdicts[region] = compare(result, after, region, alone)
    _check_producers(verdicts)
    cls = _worst(list(verdicts.values())) if touched else UNEXERCISED
    facts = sorted({f for v in verdicts.values() for f in v["facts"]})
    row.update({"outcome": "ran" if modified else "noop", "class": cls, "facts": facts, "regions": verdicts})
    return row


def _stock_program(program: Any, compile_spec: Any) -> Any:
    """The stock pipeline in one go on ``program``, for the faithfulness check."""
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    ArmPassManager(compile_spec).transform_to_backend_pipeline(program, program.graph_module)
    return program


def census_parts(flow_parts: dict[str, str] | None, depth: int) -> dict[str, str] | None:
    """Key parts of a census: the flow's (model, inputs, target, spec, toolchain) with the census's own."""
    if flow_parts is None:
        return None
    parts = {k: v for k, v in flow_parts.items() if k != "flow"}
    parts.update({"census": CENSUS_VERSION, "depth": str(depth)})
    return parts


def census(
    program: torch.export.ExportedProgram,
    target: Target,
    example_inputs: Sequence[Any],
    calibration: Sequence[Any] | None,
    session: Session,
    depth: int = 1,
    name: str = "model",
) -> dict[str, Any]:
    """The census of ``program`` for ``target``, served from the store when its key is unchanged."""
    from .flow import flow_parts

    calibration = list(calibration) if calibration is not None else [tuple(example_inputs)]
    parts = census_parts(flow_parts(program, target, example_inputs, calibration, session.store), depth)

    def compute() -> Entry:
        edge, spec = pipeline_input(program, target, example_inputs, calibration)
        result = {"model": name, "target": target.name, **run_census(edge, spec, depth)}
        return Entry(blobs={"census.json": json.dumps(result, sort_keys=True).encode()})

    entry = session.run("census", f"{name} {target.name}", parts, compute)
    return json.loads(entry.blobs["census.json"])


def summary(result: dict[str, Any], top: int = 5) -> dict[str, Any]:
    """Counts per class (each pipeline entry once) and the global passes that take the most time."""
    counts = {c: 0 for c in CLASSES}
    for row in result["passes"]:
        counts[row["class"]] += 1
    global_rows = sorted((r for r in result["passes"] if r["class"] == GLOBAL), key=lambda r: -r["seconds"])
    total = sum(r["seconds"] for r in result["passes"])
    return {
        "counts": counts,
        "seconds": round(total, 3),
        "global_seconds": round(sum(r["seconds"] for r in global_rows), 3),
        "top_global": [(r["pass"], r["seconds"], r["facts"][:1]) for r in global_rows[:top]],
    }
