"""The pass census: which Arm passes act within a region, by evidence.

Replaying a region's pipeline output across runs is exact only if every pass
that runs on it acts within the region, or reads across its boundary only
facts that can be checked. The census finds out, pass by pass, on a real
model: it runs the TOSA backend pipeline on the partition's edge program one
pass at a time, as stock does, and before each pass cuts the graph into
regions (``lowercache/lowering/replay/regions.py``) and runs the same pass (a fresh instance from a
pipeline built for the region) on each region extracted as a standalone
program. It then compares each region's nodes in the whole graph's result
with the standalone result (operators, arguments, metadata, constants'
bytes, boundary tensors, and apart from these, names):

- ``local``: all the same, names too;
- ``local given facts``: the same once facts from across the boundary are
  known: ``name counter`` (a retrace numbers nodes over the whole graph;
  ``offset``: a per-stem counter at the region's start decides the names,
  ``renumbered``: they interleave with other regions'), ``constant names``
  (a constant shared with another region, e.g. one of a set of equal ones),
  the facts the pass gave the tensors the region reads (its producer
  changed them; only if the producer is not global itself), or that the
  pass retraced the region because it changed the graph elsewhere (a pass
  that rewrites some node retraces every node, refreshing stale metadata;
  alone, a region with nothing to rewrite is left as it is). The last two
  are shown by a second standalone run that is given them;
- ``global``: the nodes differ even so (a layout chosen across the
  boundary, nodes moved or shared between regions), or the pass cannot run
  on the region alone.

A pass that changed nothing on the whole graph nor on any region was not
exercised by the model and is counted apart: the census has no evidence
about it. The pass-by-pass run is checked against the stock pipeline run in
one go on a copy (``faithful``). The result is JSON, a cached step (kind
``census``) keyed by the model, target, depth and toolchain identity.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import logging
import time
from typing import Any, Iterator, Sequence

import torch

from lowercache.cache.steps import Session
from lowercache.cache.store import Entry
from lowercache.lowering import quantize
from lowercache.lowering.replay import regions
from lowercache.targets import Target

CENSUS_VERSION = "census:v1"
LOCAL, GIVEN_FACTS, GLOBAL, UNEXERCISED = "local", "local given facts", "global", "not exercised"
INPUT_FACTS = "input facts set by the producing region"
RAN_ON_GRAPH = "retraced because it changed the graph elsewhere"
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


def pipeline_passes(compile_spec: Any, program: Any) -> list[Any]:
    """The TOSA pipeline's pass instances for ``program``, built as stock builds them, not run."""
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    manager = ArmPassManager(compile_spec)
    manager._transform = lambda exported_program, graph_module: graph_module
    manager._tosa_pipeline(program, program.graph_module)
    return list(manager.passes)


def run_pass(graph_pass: Any, program: Any) -> tuple[Any, bool]:
    """One pass on ``program`` as the Arm pass manager runs each of its passes (adapter, then recompile)."""
    from executorch.backends.arm._passes.arm_pass_manager import _ExportedProgramGraphPassAdapter

    result = _ExportedProgramGraphPassAdapter(graph_pass)(program)
    if result.modified:
        result.exported_program.graph_module.recompile()
    return result.exported_program, bool(result.modified)


def _applicable(graph_pass: Any, program: Any) -> bool:
    check = getattr(graph_pass, "should_run_pass", None)
    return True if check is None else bool(check(program.graph_module))


def _short(op: str) -> str:
    return op.removeprefix("schema:").split("(")[0]


def _op_names(form: regions.RegionForm) -> list[str]:
    return [_short(f[1]) for f in form.nodes if f[0] != "constants"]


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
    for i, (fw, fa) in enumerate(zip(whole.nodes, alone.nodes)):
        if fw != fa and fw[0] != "constants":
            what = "arguments" if fw[:4] != fa[:4] else "metadata " + ", ".join(k for k in fw[4] if fw[4].get(k) != fa[4].get(k))
            return f"{what} of node {i} ({_short(fw[1])}) differ"
    if whole.boundary != alone.boundary:
        return _boundary_difference(whole.boundary, alone.boundary)
    return "constants read differ"


def _boundary_difference(whole: dict[str, list[Any]], alone: dict[str, list[Any]]) -> str:
    """Which boundary tensor differs, and in what (tensor meta, dim order, qparams, ...)."""
    for side in ("out", "in"):
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
    """The verdict for one region: its nodes in the whole result against the standalone result.

    Differences only in the tensors it reads from outside are not its own:
    the pass changed their producers (see ``_retry`` and ``_check_producers``).
    """
    mine = [n for n in whole.graph_module.graph.nodes if whole_members.get(n) == region]
    theirs = [n for n in alone.graph_module.graph.nodes if regions.is_region_node(n)]
    fw, fa = regions.region_form(whole, mine, autograd=False), regions.region_form(alone, theirs, autograd=False)
    if fw.nodes != fa.nodes or fw.constants != fa.constants or fw.boundary["out"] != fa.boundary["out"]:
        return {"class": GLOBAL, "facts": [_difference(fw, fa)]}
    facts = []
    if fw.boundary["in"] != fa.boundary["in"]:
        facts.append(INPUT_FACTS)
    if fw.names != fa.names:
        facts.append(f"name counter ({regions.name_relation(fw.names, fa.names)})")
    if fw.constant_names != fa.constant_names:
        shared = _shared_constants(whole, whole_members, region, fw.constant_names)
        facts.append("constant names (equal-constant set)" if shared else "constant names")
    return {"class": GIVEN_FACTS if facts else LOCAL, "facts": facts}


def _shared_constants(program: Any, members: dict[Any, str], region: str, names: list[str]) -> bool:
    """Whether a constant this region reads is read by another region too."""
    by_name = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    return any(members.get(u, region) != region for name in names for u in by_name[name].users)


def _check_producers(verdicts: dict[str, dict[str, Any]]) -> None:
    """A region that followed its producers is local given facts only if each producer is not global.

    Repeated until nothing changes: a producer found global makes its consumers global.
    """
    changed = True
    while changed:
        changed = False
        for verdict in verdicts.values():
            producers = verdict.get("producers", [])
            if verdict["class"] != GLOBAL and any(verdicts.get(p, {}).get("class") == GLOBAL for p in producers):
                verdict["class"] = GLOBAL
                verdict["facts"] = [f"reads an input a global producer changed ({verdict.get('why', INPUT_FACTS)})"]
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
    passes = pipeline_passes(compile_spec, edge_program)
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
    # Two copies of each region as the pass finds it: the pass may change the whole graph in place.
    alone_inputs = {r: (regions.extract(state, members, r), regions.extract(state, members, r)) for r in names} if applicable else {}
    start = time.perf_counter()
    result, modified = run_pass(graph_pass, state)
    seconds = time.perf_counter() - start
    row: dict[str, Any] = {"index": index, "pass": name, "seconds": round(seconds, 5), "result": result}
    if not applicable:
        row.update({"outcome": "skip", "class": UNEXERCISED, "facts": [], "regions": {}})
        return row
    after = regions.membership(result.graph_module, depth) if modified else members
    verdicts, touched = {}, modified
    with _quiet_fake_tensor_errors():
        for region, (program, spare) in alone_inputs.items():
            try:
                if region not in pipelines:
                    pipelines[region] = pipeline_passes(compile_spec, program)
                alone, alone_modified = run_pass(_same_pass(pipelines[region], index, graph_pass), program)
                touched = touched or alone_modified
                verdict = compare(result, after, region, alone)
            except Exception as e:  # noqa: BLE001 - a pass that cannot run on the region alone
                verdict = {"class": GLOBAL, "facts": [f"fails alone: {type(e).__name__}: {str(e).splitlines()[0][:160]}"]}
                touched, alone_modified = True, True
            if verdict["class"] == GLOBAL:
                verdict = _retry(verdict, result, after, region, spare, compile_spec, index, graph_pass, (modified, alone_modified))
            elif INPUT_FACTS in verdict["facts"]:
                verdict["producers"] = _producers(result, after, region, spare)
            verdicts[region] = verdict
    _check_producers(verdicts)
    cls = _worst(list(verdicts.values())) if touched else UNEXERCISED
    facts = sorted({f for v in verdicts.values() for f in v["facts"]})
    row.update({"outcome": "ran" if modified else "noop", "class": cls, "facts": facts, "regions": verdicts})
    return row


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    """A pass failing on a region alone makes FakeTensor log a traceback; the verdict says it in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _same_pass(pipeline: list[Any], index: int, graph_pass: Any) -> Any:
    fresh = pipeline[index]
    if type(fresh) is not type(graph_pass):
        raise RuntimeError(f"the region's pipeline differs at {index}: {type(fresh).__name__}")
    return fresh


def _whole_inputs(result: Any, after: dict[Any, str], region: str) -> list[Any]:
    """The tensors ``region`` reads from outside in the whole graph's result, in first-use order."""
    mine = [n for n in result.graph_module.graph.nodes if after.get(n) == region]
    by_name = {n.name: n for n in result.graph_module.graph.nodes}
    return [by_name[name] for name in regions.region_form(result, mine).inputs]


def _producers(result: Any, after: dict[Any, str], region: str, spare: Any) -> list[str]:
    """The regions whose output ``region`` reads with other facts than before the pass."""
    before = regions.input_facts(spare)
    now = _whole_inputs(result, after, region)
    if len(before) != len(now):
        return sorted({after.get(n, "(input)") for n in now})
    return sorted({after.get(n, "(input)") for n, facts in zip(now, before) if regions.tensor_facts(n) != facts})


def _force_retrace(graph_pass: Any) -> None:
    """Make a pass retrace a region it leaves alone, as its run on a graph it changes does.

    A pass that rewrites some node of a graph then retraces the whole graph
    with its own ``call_operator`` (``ExportPass.call``), refreshing every
    node's metadata; on a region without anything to rewrite it does
    nothing. Forced, it runs as ever and, if that changed nothing, retraces.
    """
    from executorch.exir.pass_base import ExportPass

    original = graph_pass.call

    def call(graph_module: Any) -> Any:
        result = original(graph_module)
        if result is not None and result.modified:
            return result
        return ExportPass.call(graph_pass, graph_module if result is None else result.graph_module)

    graph_pass.should_run_pass = lambda graph_module: True
    graph_pass.call = call


def _retry(
    first: dict[str, Any],
    result: Any,
    after: dict[Any, str],
    region: str,
    spare: Any,
    compile_spec: Any,
    index: int,
    graph_pass: Any,
    modified: tuple[bool, bool],
) -> dict[str, Any]:
    """Run the region alone again, told what the whole graph's run knew across its boundary.

    Two facts are supplied: the facts the pass gave the tensors it reads
    (their producers changed), and, when the pass changed the whole graph
    but not the region alone, that it retraced (a pass that rewrites some
    node retraces every node of the graph, refreshing stale metadata, but
    leaves a region without such a node alone). ``modified`` says whether
    the pass changed the whole graph and the region alone. If it now matches, the
    region is local given those facts (its producers' own verdicts are
    checked by ``_check_producers``); if not, the first verdict stands.
    """
    whole_modified, alone_modified = modified
    supplied = []
    try:
        producers = _producers(result, after, region, spare)
        if producers:
            regions.adopt_input_facts(spare, _whole_inputs(result, after, region))
            supplied.append(INPUT_FACTS)
        fresh = _same_pass(pipeline_passes(compile_spec, spare), index, graph_pass)
        if whole_modified and not alone_modified:
            _force_retrace(fresh)
            supplied.append(RAN_ON_GRAPH)
        if not supplied:
            return first
        second = compare(result, after, region, run_pass(fresh, spare)[0])
    except Exception:  # noqa: BLE001 - the supplied facts do not explain it either
        return first
    if second["class"] == GLOBAL:
        return first
    facts = sorted((set(second["facts"]) - {INPUT_FACTS}) | set(supplied))
    return {"class": GIVEN_FACTS, "facts": facts, "producers": producers, "why": first["facts"][0]}


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
    from lowercache.lowering.flow import flow_parts

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
