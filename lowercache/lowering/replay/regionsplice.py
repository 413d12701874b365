"""Region replay for Ethos-U targets (issue 42): the TOSA pipeline's prefix served region by region, spliced.

The pipeline's input is cut into regions; the entries before
``FuseViewCopyTransformPass`` (the prefix, which the pass census finds local
up to names and the facts a region reads from its producers) are where a
region's state can be stored and served (``regioncache.py``). When nothing
is served, the whole pipeline runs as stock runs it, and a tracker follows
each region through the prefix so its state can be cut out at the split and
stored. After an edit, the leading regions with an unchanged chain are
served; the rest run the prefix as one program, pass by pass, each tensor
they read from a served region taking that region's stored metadata after
the same pass. Served states and that program are spliced in graph order,
and the rest of the pipeline (the layout passes, constant shapes, duplicate
users: the global entries) runs on the result as stock runs it.

The result differs from stock's in names and in the order of constants,
which an Ethos-U ``.pte`` does not hold (``tests/flow/test_vela_names.py``); a
TOSA target's ``.pte`` is the flatbuffer itself, so this is never used for
one. Anything the splice cannot order falls back to the stock pipeline,
with the reason (``Fallback``): regions that interleave in graph order, a
program that mutates buffers, a pass that fails on a region alone, a
pipeline that differs between a region and the whole graph.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import torch

from . import regioncache, regions, regionstore
from ..stored.programstore import FormatError
from ..specdigest import compile_spec_digest, pass_insertions_digest
from ...cache.toolchain import toolchain_parts
from ...speedups.patching import Patch

SPLIT_PASS = "FuseViewCopyTransformPass"  # the first layout pass: entries before it run per region
TAIL = "(dirty tail)"  # the regions after the served ones, extracted as one
log = logging.getLogger("lowercache")


class Fallback(Exception):
    """The splice cannot be used for this program; the stock pipeline runs. ``str()`` is the reason."""


@dataclasses.dataclass
class RegionState:
    """One region as the prefix leaves it: its program, and where each of its outputs came from."""

    name: str
    program: Any
    outputs: list[str]  # the whole graph's name of the node each output position carries
    inputs: dict[str, str]  # placeholder name in the region's program -> the whole graph's node it stands for
    served: regioncache.ServedTrail | None = None  # served from the cache: its outputs' metadata pass by pass


@dataclasses.dataclass
class Outcome:
    """What the region-by-region run did: the regions and each one's verdict, or why it fell back."""

    regions: list[str] = dataclasses.field(default_factory=list)
    fallback: str | None = None
    split: int = 0
    verdicts: dict[str, str] = dataclasses.field(default_factory=dict)  # region -> served, or re-ran and why
    spliced: bool = False  # False: nothing was served, the whole pipeline ran as stock runs it


@dataclasses.dataclass
class Plan:
    """A program cut into regions that the splice can order, with the whole pipeline and its split."""

    program: Any
    members: dict[torch.fx.Node, str]
    states: list[RegionState]
    whole: list[Any]
    split: int
    wiring: dict[str, Any] = dataclasses.field(default_factory=dict)  # region -> where its inputs come from, its outputs go


def pipeline(compile_spec: Any, program: Any) -> list[Any]:
    """The TOSA pipeline's pass instances for ``program``, built as stock builds them, not run."""
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    manager = ArmPassManager(compile_spec)
    manager._transform = lambda exported_program, graph_module: graph_module
    manager._tosa_pipeline(program, program.graph_module)
    return list(manager.passes)


def run_pass(graph_pass: Any, program: Any) -> Any:
    """One pass on ``program`` as the Arm pass manager runs each of its passes (adapter, then recompile)."""
    return run_pass_noting(graph_pass, program)[0]


def run_pass_noting(graph_pass: Any, program: Any) -> tuple[Any, bool]:
    """``run_pass``, and whether the pass says it changed the graph."""
    from executorch.backends.arm._passes.arm_pass_manager import _ExportedProgramGraphPassAdapter

    result = _ExportedProgramGraphPassAdapter(graph_pass)(program)
    if result.modified:
        result.exported_program.graph_module.recompile()
    return result.exported_program, bool(result.modified)


def split_index(passes: list[Any]) -> int:
    names = [type(p).__name__ for p in passes]
    if SPLIT_PASS not in names:
        raise Fallback(f"the pipeline has no {SPLIT_PASS}")
    return names.index(SPLIT_PASS)


def region_runs(gm: torch.fx.GraphModule, members: dict[torch.fx.Node, str], constants: set[str]) -> list[str]:
    """The regions of ``gm`` as contiguous runs in graph order (a region twice: it interleaves with another).

    A node that reads constants only (a weight's dequantization, which stock
    places at the front of the graph) is left out: it is placed with the
    region that reads it, and q/dq folding removes it before the split.
    """
    runs: list[str] = []
    for node in gm.graph.nodes:
        region = members.get(node)
        if region is not None and node.all_input_nodes and all(a.name in constants for a in node.all_input_nodes):
            continue
        if region is not None and (not runs or runs[-1] != region):
            runs.append(region)
    return runs


def _extract(program: Any, members: dict[torch.fx.Node, str], name: str) -> RegionState:
    from torch.export.graph_signature import InputKind

    part = regions.extract(program, members, name)
    gm = program.graph_module
    inside = [n for n in gm.graph.nodes if members.get(n) == name]
    outputs = [n.name for n in inside if any(members.get(u) != name for u in n.users)]
    inputs = {s.arg.name: s.arg.name for s in part.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    return RegionState(name, part, outputs, inputs)


def _boundary(program: Any, members: dict[torch.fx.Node, str], name: str) -> RegionState:
    """``_extract``'s state without its program: the inputs and outputs alone, for a region that is served or runs in
    the dirty tail, whose own program is never run."""
    inputs = regions.user_input_names(program, members, name)
    inside = [n for n in program.graph_module.graph.nodes if members.get(n) == name]
    outputs = [n.name for n in inside if any(members.get(u) != name for u in n.users)]
    return RegionState(name, None, outputs, {n: n for n in inputs})


def _output_nodes(state: RegionState) -> list[torch.fx.Node]:
    out = state.program.graph_module.graph.output_node()
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def _producer_meta(producer: RegionState, index: int, after: int) -> dict[str, Any]:
    """The metadata of ``producer``'s output ``index`` after pass ``after``: as it runs now, or as it was stored."""
    if producer.served is not None:
        try:
            return producer.served.meta(index, after)
        except FormatError as err:
            raise Fallback(f"region {producer.name}'s stored state: {err}") from None
    return regions.copied_meta(_output_nodes(producer)[index].meta)


def _adopt(state: RegionState, producers: dict[str, tuple[RegionState, int]], after: int) -> None:
    """Give each tensor ``state`` reads from another region its producer's metadata after pass ``after``."""
    by_name = {n.name: n for n in state.program.graph_module.graph.nodes if n.op == "placeholder"}
    for placeholder, source in state.inputs.items():
        found = producers.get(source)
        if found is None:
            continue  # a whole-graph input: its placeholder is the region's own
        producer, index = found
        node = by_name.get(placeholder)
        if node is None:
            raise Fallback(f"region {state.name} lost its input {source}")
        node.meta = _producer_meta(producer, index, after)


def _user_inputs(program: Any) -> set[str]:
    from torch.export.graph_signature import InputKind

    return {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}


def plan(program: Any, compile_spec: Any, depth: int, extract: bool = True) -> Plan:
    """``program`` cut into regions at ``depth`` and each extracted; Fallback when the splice cannot order them.

    ``extract=False``: the states carry their inputs and outputs but no program
    (``transform`` never runs a region's own program: it serves stored ones and
    runs the dirty tail, or the whole graph).
    """
    from torch.export.graph_signature import OutputKind

    if any(spec.kind != OutputKind.USER_OUTPUT for spec in program.graph_signature.output_specs):
        raise Fallback("the program mutates buffers or returns gradients")
    whole = pipeline(compile_spec, program)
    split = split_index(whole)
    members = regions.membership(program.graph_module, depth)
    constants = {n.name for n in program.graph_module.graph.nodes if n.op == "placeholder"} - _user_inputs(program)
    runs = region_runs(program.graph_module, members, constants)
    if len(runs) != len(set(runs)):
        repeated = sorted({r for r in runs if runs.count(r) > 1})
        raise Fallback(f"regions interleave in graph order: {', '.join(repeated[:4])}")
    for node in program.graph_module.graph.nodes:
        readers = {members[u] for u in node.users if u in members}
        if node.op == "placeholder" and len(readers) > 1 and node.name not in _user_inputs(program):
            raise Fallback(f"constant {node.name} is read by {len(readers)} regions")
    states = [(_extract if extract else _boundary)(program, members, name) for name in runs]
    return Plan(program, members, states, whole, split, {st.name: _wiring(program.graph_module, members, st) for st in states})


def _wiring(gm: torch.fx.GraphModule, members: dict[torch.fx.Node, str], state: RegionState,
            outside: dict[str, str] | None = None) -> list[Any]:
    """Which region produces each of ``state``'s inputs and which regions read each of its outputs, in order;
    ``outside``: the region of each tensor ``gm`` takes as an input, by name (the dirty tail's served producers)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    outside = outside or {}
    sources = [members.get(by_name[source]) or outside.get(source, "(input)") for source in state.inputs.values()]
    sinks = [sorted({members.get(u, "(output)") for u in by_name[out].users} - {state.name}) for out in state.outputs]
    return [sources, sinks]


def lockstep(states: list[RegionState], compile_spec: Any, whole: list[Any], split: int,
             observe: Callable[[int, RegionState, bool], None] | None = None) -> None:
    """The prefix on every state that is not served, pass by pass over the states in graph order; each tensor a
    state reads from another takes its producer's metadata as that pass left it (a served producer's as stored).
    ``observe(index, state, modified)`` is told after each pass on each state."""
    running = [s for s in states if s.served is None]
    producers = {out: (s, k) for s in states for k, out in enumerate(s.outputs)}
    pipelines = {s.name: pipeline(compile_spec, s.program) for s in running}
    for s in running:
        if [type(p) for p in pipelines[s.name][:split]] != [type(p) for p in whole[:split]]:
            raise Fallback(f"region {s.name}'s pipeline differs from the whole graph's")
    for index in range(split):
        for s in running:
            _adopt(s, producers, index)
            try:
                s.program, modified = run_pass_noting(pipelines[s.name][index], s.program)
            except Exception as e:  # noqa: BLE001 - a pass that cannot run on the region alone
                raise Fallback(f"{type(whole[index]).__name__} fails on region {s.name} alone: {type(e).__name__}") from e
            if observe is not None:
                observe(index, s, modified)


def run_prefix(program: Any, compile_spec: Any, depth: int) -> tuple[list[RegionState], int, list[Any]]:
    """Every region of ``program`` through the pipeline's prefix, in lockstep; the states, the split and the whole pipeline."""
    cut = plan(program, compile_spec, depth)
    lockstep(cut.states, compile_spec, cut.whole, cut.split)
    return cut.states, cut.split, cut.whole


def _serve(state: RegionState, program: Any, extra: dict[str, Any], like: Any) -> None:
    """Make ``state`` the stored one: its program, its inputs mapped by position, its outputs' trail."""
    stored_inputs = extra.get("inputs")
    placeholders = _user_inputs(program)
    if not isinstance(stored_inputs, list) or len(stored_inputs) != len(state.inputs) or not set(stored_inputs) <= placeholders:
        raise FormatError("the stored inputs do not match the region's")
    outputs = program.graph_module.graph.output_node().args[0]
    if len(outputs if isinstance(outputs, (tuple, list)) else [outputs]) != len(state.outputs):
        raise FormatError("the stored outputs do not match the region's")
    trail = regioncache.ServedTrail(extra.get("trail"), len(state.outputs), regionstore.fake_mode(like))
    state.inputs = dict(zip(stored_inputs, state.inputs.values()))
    state.program = program
    state.served = trail


def _tail(cut: Plan, served: list[RegionState]) -> RegionState:
    """Every region after the served ones, as one extracted program."""
    names = {s.name for s in served}
    members = {n: (r if r in names else TAIL) for n, r in cut.members.items()}
    return _extract(cut.program, members, TAIL)


def splice(program: Any, states: list[RegionState]) -> Any:
    """One program from the regions' programs, in graph order, with ``program``'s inputs and outputs.

    Constants keep their names where they are unique; a name two regions
    minted alike gets the region's position as a prefix. The graph's own
    inputs keep theirs.
    """
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}  # whole graph's node name -> spliced node
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    first_seen: dict[str, torch.fx.Node] = {}
    for s in states:
        for node in s.program.graph_module.graph.nodes:
            if node.op == "placeholder" and s.inputs.get(node.name) is not None and s.inputs[node.name] not in first_seen:
                first_seen[s.inputs[node.name]] = node
    state_dict: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    constant_specs: list[InputSpec] = []
    constant_nodes: list[tuple[RegionState, torch.fx.Node, InputSpec]] = []
    taken = {s.arg.name for s in user_inputs}
    for s in states:
        specs = {spec.arg.name: spec for spec in s.program.graph_signature.input_specs}
        for node in s.program.graph_module.graph.nodes:
            if node.op == "placeholder" and specs[node.name].kind != InputKind.USER_INPUT:
                constant_nodes.append((s, node, specs[node.name]))
    local: dict[tuple[int, str], torch.fx.Node] = {}
    for s, node, spec in constant_nodes:
        name = node.name if node.name not in taken else f"r{states.index(s)}_{node.name}"
        taken.add(name)
        new = graph.placeholder(name)
        new.meta = node.meta
        target = spec.target if spec.target is not None else name
        value = s.program.state_dict.get(spec.target, s.program.constants.get(spec.target))
        key = target if target not in state_dict and target not in constants else f"r{states.index(s)}_{target}"
        if spec.target in s.program.state_dict:
            state_dict[key] = value
        else:
            constants[key] = value
        constant_specs.append(InputSpec(kind=spec.kind, arg=TensorArgument(name=new.name), target=key, persistent=spec.persistent))
        local[(id(s), node.name)] = new
    input_specs = list(constant_specs)
    for spec in user_inputs:
        new = graph.placeholder(spec.arg.name)
        source = first_seen.get(spec.arg.name)
        original = next(n for n in program.graph_module.graph.nodes if n.name == spec.arg.name)
        new.meta = (source or original).meta
        env[spec.arg.name] = new
        input_specs.append(InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(name=new.name), target=None))
    # A region's leading nodes computed from constants alone go first, region by region: a pass inserts such a
    # node right after the constant's placeholder, which in the whole graph is at its front.
    mapped: dict[int, dict[torch.fx.Node, torch.fx.Node]] = {id(s): {} for s in states}
    leading = {id(s): True for s in states}
    for front in (True, False):
        for s in states:
            mine = mapped[id(s)]
            for node in s.program.graph_module.graph.nodes:
                if node in mine or node.op == "output":
                    continue
                if node.op == "placeholder":
                    if (id(s), node.name) in local:
                        mine[node] = local[(id(s), node.name)]
                    elif not front:
                        mine[node] = env[s.inputs[node.name]]
                elif not front or (leading[id(s)] and _from_constants(node, mine)):
                    mine[node] = graph.node_copy(node, mine.__getitem__)
                else:
                    leading[id(s)] = False
            if not front:
                outputs = _output_nodes(s)
                for k, whole_name in enumerate(s.outputs):
                    env[whole_name] = mine[outputs[k]]
    whole_out = program.graph_module.graph.output_node()
    result = torch.fx.node.map_arg(whole_out.args[0], lambda a: env[a.name])
    out = graph.output(result)
    out.meta = whole_out.meta
    outputs = result if isinstance(result, (tuple, list)) else [result]
    signature = ExportGraphSignature(
        input_specs=input_specs,
        output_specs=[OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=o.name), target=None) for o in outputs],
    )
    spliced = copy.copy(program)
    spliced._graph_module = torch.fx.GraphModule(program.graph_module, graph)
    spliced._graph_signature = signature
    spliced._state_dict = state_dict
    spliced._constants = constants
    return spliced


def _from_constants(node: torch.fx.Node, placed: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    """Whether every input of ``node`` is placed already at the front: a constant, or computed from constants alone."""
    return bool(node.all_input_nodes) and all(a in placed for a in node.all_input_nodes)


def transform(program: Any, compile_spec: Any, depth: int, session: Any = None) -> tuple[Any, Outcome]:
    """The TOSA pipeline on ``program`` region by region up to the split, spliced, then whole; ``program`` is updated in place.

    With a ``session`` whose store holds them, the leading regions whose
    chain is unchanged are served from the cache, and the regions after them
    run through the prefix as one program. When none is served, the whole
    pipeline runs as stock runs it, and each region's state is cut out of the
    whole graph at the split and stored.
    Raises ``Fallback`` (before changing ``program``) when the splice cannot be used.
    """
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    manager = ArmPassManager(compile_spec)
    with manager._tosa_context(program.graph_module):
        cut = plan(program, compile_spec, depth, extract=False)
        chain = _chain(cut, compile_spec, depth)
        verdicts: dict[str, str] = {}
        served = _served(cut, chain, session, verdicts)
        if not served:
            whole = _run_whole(cut, depth, chain, session, verdicts)
            _update(program, whole)
            return program.graph_module, Outcome(regions=[s.name for s in cut.states], split=cut.split, verdicts=verdicts)
        if len(served) < len(cut.states):
            states = served + [_run_tail(cut, served, compile_spec, depth, chain, session, verdicts)]
        else:
            states = served
        spliced = splice(program, states)
        for graph_pass in cut.whole[cut.split:]:
            spliced = run_pass(graph_pass, spliced)
    _update(program, spliced)
    return program.graph_module, Outcome(regions=[s.name for s in cut.states], split=cut.split, verdicts=verdicts, spliced=True)


def _run_tail(cut: Plan, served: list[RegionState], compile_spec: Any, depth: int, chain: list[dict[str, str]] | None,
              session: Any, verdicts: dict[str, str]) -> RegionState:
    """The regions after the served ones through the prefix as one program, beside the served states; each of
    them is followed as it runs and, with a writable cache, cut out at the split and stored."""
    tail = _tail(cut, served)
    dirty = cut.states[len(served):]
    tracker = _Tracker(dirty, depth) if regioncache.writable(session) else None

    def observe(index: int, state: RegionState, modified: bool) -> None:
        if tracker is not None and state is tail:
            tracker.note(index, tail.program.graph_module, modified, type(cut.whole[index]).__name__)

    lockstep(served + [tail], compile_spec, cut.whole, cut.split, observe)
    stored: dict[str, str] = {}
    if tracker is not None:
        outside = {n.name: r for n, r in cut.members.items() if r in {s.name for s in served}}
        try:
            _store_cut(tail.program, cut, tracker, chain, session, stored, outside)
        except (FormatError, ValueError, KeyError) as err:
            log.warning("region states not stored (%s: %s)", type(err).__name__, err)
    for i, s in enumerate(dirty, start=len(served)):
        why = verdicts.get(s.name) or f"in the dirty tail after {dirty[0].name}, run as one program"
        verdicts[s.name] = f"{why}; {stored.get(s.name, 'not stored')}"
        if chain is not None:
            regioncache.note(session, s.name, "miss", chain[i], verdicts[s.name])
    return tail


def _update(program: Any, result: Any) -> None:
    """``program`` made the pipeline's result, as the Arm pass manager leaves its input."""
    program._graph_module = result.graph_module
    program._graph_signature = result.graph_signature
    program._state_dict = result.state_dict
    program._constants = result.constants


def _chain(cut: Plan, compile_spec: Any, depth: int) -> list[dict[str, str]] | None:
    """Each region's key parts for its stored state, in graph order; None when the pipeline cannot be keyed."""
    insertions = pass_insertions_digest()
    if insertions is None:
        return None
    fixed = {"compile_spec": compile_spec_digest(compile_spec), "pass_insertions": insertions,
             "pipeline": f"{VERSION}:{cut.split}"}
    return regioncache.chain_parts(cut.program, depth, [s.name for s in cut.states], fixed)


def _served(cut: Plan, chain: list[dict[str, str]] | None, session: Any, verdicts: dict[str, str]) -> list[RegionState]:
    """The leading states the cache holds, made the stored ones; the first region without one gets its reason."""
    served: list[RegionState] = []
    if chain is None:
        return served
    for s, parts in zip(cut.states, chain):
        found = regioncache.fetch(session, parts, cut.program)
        if not isinstance(found, str):
            try:
                _serve(s, *found, cut.program)
            except FormatError as err:
                log.warning("stored region state unreadable (%s); the region re-runs", err)
                found = f"stored state unreadable ({err})"
        if isinstance(found, str):
            verdicts[s.name] = f"re-ran: {found}"
            break
        verdicts[s.name] = "served"
        regioncache.note(session, s.name, "hit", parts, "served")
        served.append(s)
    return served


class _Tracker:
    """Each region's outputs followed through the whole graph's run of the prefix, and their metadata after each pass.

    A region's nodes are found by ``regions.membership`` again after every
    pass that changes the graph; its outputs are its nodes read outside it,
    in graph order. A region whose output count changes is lost (not stored).
    """

    def __init__(self, states: list[RegionState], depth: int) -> None:
        self.depth = depth
        self.expected = {s.name: len(s.outputs) for s in states}
        self.trails = {s.name: regioncache.Trail(len(s.outputs)) for s in states}
        self.lost: dict[str, str] = {}
        self.outputs: dict[str, list[torch.fx.Node]] | None = None

    def note(self, index: int, gm: torch.fx.GraphModule, modified: bool, name: str) -> None:
        if modified or self.outputs is None or any(o.graph is not gm.graph or getattr(o, "_erased", False) for outs in self.outputs.values() for o in outs):
            members = regions.membership(gm, self.depth)
            self.outputs = {}
            for node, region in members.items():
                if any(members.get(u) != region for u in node.users):
                    self.outputs.setdefault(region, []).append(node)
        for region, trail in self.trails.items():
            if region in self.lost:
                continue
            found = self.outputs.get(region, [])
            if len(found) != self.expected[region]:
                self.lost[region] = f"its outputs were not followed through {name}"
                continue
            trail.note(index, [o.meta for o in found])


def _run_whole(cut: Plan, depth: int, chain: list[dict[str, str]] | None, session: Any, verdicts: dict[str, str]) -> Any:
    """Nothing served: the pipeline on the whole program as stock runs it. With a cache, each region's state is cut
    out of the whole graph at the split and stored, with its outputs' metadata after every prefix pass."""
    recording = chain is not None and regioncache.writable(session)
    tracker = _Tracker(cut.states, depth) if recording else None
    first = verdicts.get(cut.states[0].name, "re-ran: no cache")
    stored: dict[str, str] = {}
    current = cut.program
    for index, graph_pass in enumerate(cut.whole):
        if index == cut.split and tracker is not None:
            try:
                _store_cut(current, cut, tracker, chain, session, stored)
            except (FormatError, ValueError, KeyError) as err:
                log.warning("region states not stored (%s: %s)", type(err).__name__, err)
        current, modified = run_pass_noting(graph_pass, current)
        if tracker is not None and index < cut.split:
            tracker.note(index, current.graph_module, modified, type(graph_pass).__name__)
    for i, s in enumerate(cut.states):
        why = first if i == 0 else "re-ran: nothing upstream served"
        verdicts[s.name] = f"{why}; {stored.get(s.name, 'not stored' if recording else 'not stored (no writable cache)')}"
        if chain is not None:
            regioncache.note(session, s.name, "miss", chain[i], verdicts[s.name])
    return current


def _store_cut(current: Any, cut: Plan, tracker: _Tracker, chain: list[dict[str, str]] | None, session: Any,
               verdicts: dict[str, str], outside: dict[str, str] | None = None) -> None:
    """Cut ``current`` (the whole graph, or the dirty tail) at the split into the regions ``tracker`` followed and store
    each one whose wiring is the pipeline input's; each region's verdict says whether it was stored and why not."""
    if chain is None:
        return
    names = list(tracker.trails)
    gm = current.graph_module
    members = regions.membership(gm, tracker.depth)
    constants = {n.name for n in gm.graph.nodes if n.op == "placeholder"} - _user_inputs(current)
    runs = region_runs(gm, members, constants)
    if runs != names:
        for name in names:
            verdicts[name] = "not stored (the regions at the split differ from the pipeline input's)"
        return
    index = {s.name: i for i, s in enumerate(cut.states)}
    for name in names:
        if name in tracker.lost:
            verdicts[name] = f"not stored ({tracker.lost[name]})"
            continue
        state = _extract(current, members, name)
        wiring = _wiring(gm, members, state, outside)
        sources, sinks = wiring
        if wiring != cut.wiring[name] or len(set(sources)) < len(sources) or len({tuple(x) for x in sinks}) < len(sinks):
            verdicts[name] = "not stored (its inputs and outputs at the split differ from the pipeline input's)"
            continue
        verdicts[name] = regioncache.keep(session, name, chain[index[name]], state.program, list(state.inputs), tracker.trails[name])


# --- The switch: on for Ethos-U partitions while the ``regions`` speed-up is on (``speedups/registry.py``).

MAX_REGIONS = 64  # the deepest cut with at most this many regions is used
VERSION = "regions:prefix-118:v2"  # in the TOSA step's key while engaged: its TOSA differs from stock's in names
# The Arm backend's sources (toolchain ``arm_backend_src``) the splice was tested against: every pass is in them.
AUDITED_ARM_SRC = "4e5e1b26bb9809a0e32122d3794ff932"
_state = threading.local()  # .ethosu: this thread is inside EthosUBackend.preprocess
_originals: dict[str, Any] = {}


def choose_depth(program: Any) -> int:
    """The deepest module-path depth (1 to 4) that cuts ``program`` into at most ``MAX_REGIONS`` regions that do not
    interleave in graph order; depth 1 when none does (``plan`` then says why it falls back)."""
    gm = program.graph_module
    constants = {n.name for n in gm.graph.nodes if n.op == "placeholder"} - _user_inputs(program)
    for depth in range(4, 0, -1):
        members = regions.membership(gm, depth)
        runs = region_runs(gm, members, constants)
        if len(set(runs)) <= MAX_REGIONS and len(runs) == len(set(runs)):
            return depth
    return 1


def _pipeline(self: Any, exported_program: Any, graph_module: Any) -> Any:
    original = _originals["pipeline"]
    if not getattr(_state, "ethosu", False) or graph_module is not exported_program.graph_module:
        return original(self, exported_program, graph_module)
    from ...cache.steps import StepRecord, current_session

    session = current_session()
    start = time.perf_counter()
    mark = len(session.records) if session is not None else 0
    try:
        if toolchain_parts()["arm_backend_src"] != AUDITED_ARM_SRC:
            raise Fallback("the Arm backend's sources are not the ones the splice was tested against")
        depth = choose_depth(exported_program)
        result, outcome = transform(exported_program, self.compile_spec, depth, session)
        served = sum(v == "served" for v in outcome.verdicts.values())
        if outcome.spliced:
            name = (f"{len(outcome.regions)} regions at depth {depth} spliced before pipeline entry {outcome.split}; "
                    f"{served} served from the cache, {len(outcome.regions) - served} re-ran")
        else:
            name = (f"{len(outcome.regions)} regions at depth {depth}; none served from the cache: the whole pipeline "
                    f"ran, and each region's state at entry {outcome.split} was cut out to be stored")
        verdict = "spliced" if outcome.spliced else "recorded"
        note = " | ".join(f"{r}: {v}" for r, v in outcome.verdicts.items())
    except (Fallback, FormatError) as reason:
        if session is not None:
            del session.records[mark:]  # no region verdicts for a pipeline that ran whole
        result = original(self, exported_program, graph_module)
        name, verdict, note = f"full pipeline: {reason}", "fallback", ""
    if session is not None:
        session.records.append(StepRecord(kind="regions", name=name, outcome=verdict, seconds=time.perf_counter() - start, note=note))
    return result


def engaged() -> bool:
    """Whether a pipeline run now (this thread) would be spliced: inside an Ethos-U partition, with the switch on."""
    return bool(_originals) and getattr(_state, "ethosu", False)


def _ethosu_preprocess(edge_program: Any, compile_specs: Any) -> Any:
    previous = getattr(_state, "ethosu", False)
    _state.ethosu = True
    try:
        return _originals["ethosu"](edge_program, compile_specs)
    finally:
        _state.ethosu = previous


def _apply() -> None:
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager
    from executorch.backends.arm.ethosu.backend import EthosUBackend

    _originals["pipeline"] = ArmPassManager.transform_to_backend_pipeline
    _originals["ethosu"] = EthosUBackend.preprocess
    ArmPassManager.transform_to_backend_pipeline = _pipeline
    EthosUBackend.preprocess = staticmethod(_ethosu_preprocess)


def _undo() -> None:
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager
    from executorch.backends.arm.ethosu.backend import EthosUBackend

    ArmPassManager.transform_to_backend_pipeline = _originals.pop("pipeline")
    EthosUBackend.preprocess = staticmethod(_originals.pop("ethosu"))


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
