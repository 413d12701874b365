"""The one list of exact speed-ups, their pins, and which of them are on.

Each entry names what it patches (``module:qualname``), the sha256 of those
sources as audited (``sourcepin``), why its output bytes equal stock's, and the
test that proves it. A speed-up is on when the user has not switched it off
(``LOWERCACHE_SPEEDUPS``) and the installed sources are the audited ones; on
another torch or ExecuTorch release a changed function turns its speed-up off,
and the lowering stays exact, only slower. Some modules check finer pins of
their own as well (a pass's gate, a call site).

Each entry also names the target families it was proven on (``families``,
by ``targets.FAMILIES``' names): a family's hooks turn on only those, and
a speed-up proven on one backend's graphs is off for another until its own
test compares it there with stock.

``LOWERCACHE_SPEEDUPS``: ``all`` (default), ``none``, a list of names
(``retrace,fastcopy``), or ``all`` minus some (``all,-fastcopy``). ``all``
means every speed-up but the opt-in ones (``OPT_IN``), which are on only
when named (``all,regions``, ``all,rebind``).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

from ..errors import LowercacheError
from .sourcepin import targets_digest


# Target families by name (``lowercache.targets``, which this layer does not import).
ARM = ("arm-tosa", "arm-ethosu")
EVERY = (*ARM, "xnnpack")
XNNPACK_PROOF = "tests/flow/test_xnnpack_speedups.py"  # every speed-up proven on XNNPACK, against stock


@dataclass(frozen=True)
class Speedup:
    name: str
    patches: tuple[str, ...]  # the upstream functions it replaces or reproduces, as module:qualname
    audited: str  # sha256 of their sources when the speed-up was proven exact
    why: str  # one line: why the bytes do not change (docs/speedups.md has the rest)
    proof: str  # the test that proves it against stock
    # the target families it is proven on, by name: all but the Arm backend's own (its passes, pipeline and flow);
    # on XNNPACK graphs by XNNPACK_PROOF. Why each is or is not on for a family: docs/speedups.md#families.
    families: tuple[str, ...] = EVERY


_PB = "executorch.exir.pass_base"
_TPB = "torch._export.pass_base"

SPEEDUPS: tuple[Speedup, ...] = (
    Speedup(
        "provenance",
        ("torch.fx.traceback:NodeSource.__init__",),
        "99395e7f40a4a0490145b2b1ca70c03cd5b7f2d8037480bd399a2fc195ee152f",
        "NodeSource chains are never mutated, so sharing one equals deep-copying it; provenance never reaches output bytes.",
        "tests/unit/test_provenance.py",
    ),
    Speedup(
        "paramsearch",
        ("torchao.quantization.pt2e.observer:HistogramObserver._non_linear_param_search",),
        "9306a687ba73a3044c555e58d19ad69b11ee000779a3088e55da08b954b472eb",
        "The same loop and float32 arithmetic over a Python cumulative list; monotone scans become bisections.",
        "tests/flow/test_qparams.py",
    ),
    Speedup(
        "histogram",
        ("torchao.quantization.pt2e.observer:HistogramObserver._upscale_histogram",),
        "cad59b3e62afee798a5ae4d8240d5f6f26f3bd9c1194e4afe721558298aa6db4",
        "Sorted midpoints and boundaries: one searchsorted per boundary gives the same bin counts as bucketize per midpoint.",
        "tests/unit/test_histogram.py",
    ),
    Speedup(
        "retrace",
        (f"{_PB}:_ExportPassBase._fx", f"{_PB}:_ExportPassBase.ExportInterpreter.run_node",
         f"{_TPB}:_ExportPassBaseDeprecatedDoNotUse._fx", f"{_TPB}:_ExportPassBaseDeprecatedDoNotUse.ExportInterpreter.run_node"),
        "ea6d7a375b171244755b95a016d4f30bf9d83afbf6b3acab9fa6965ac420269c",
        "A functional op on equal fake inputs gives equal fake outputs, so an unchanged node's value is reused, not re-dispatched.",
        "tests/flow/test_retrace.py",
    ),
    Speedup(
        "fastcopy",
        (f"{_PB}:_ExportPassBase.call_operator", f"{_PB}:_ExportPassBase.ExportInterpreter.call_function",
         f"{_PB}:_ExportPassBase.ExportTracer.set_metadata", "torch.fx:Graph.create_node", "torch.fx:Interpreter.run_node"),
        "58205fbe373972cbc425bc26e4d3fea7cad1c242cd7b5f26a9e537f667bc296f",
        "A node a pass hands to the base call_operator is made with the same torch calls on equal inputs, minus no-op layers.",
        "tests/flow/test_fastcopy.py",
    ),
    Speedup(
        "lazycode",
        ("torch.fx.graph_module:GraphModule.recompile", "torch.fx.graph_module:GraphModule.code",
         "torch.fx.graph_module:GraphModule.__str__", "executorch.exir.backend.backend_api:_create_partitions_in_graph_module"),
        "fb95239e10653dca641c8c29adc10ad9d878b924797ee46e9b26389dfaa09611",
        "Passes interpret graphs node by node; code is generated on first use, from the same graph, as _LazyGraphModule does.",
        "tests/unit/test_lazycode.py",
    ),
    Speedup(
        "attrnames",
        ("torchao.quantization.pt2e.utils:get_new_attr_name_with_prefix",
         "torch.ao.quantization.fx.utils:get_new_attr_name_with_prefix"),
        "35cc227444b4510353faeefeccd5959f9cf7f837079f4f3d8a3c178aa31feba4",
        "Answers 'taken' from the module's own attribute dicts only when certain, else asks hasattr: the same first free name.",
        "tests/unit/test_attrnames.py",
    ),
    Speedup(
        "decompositions",
        ("torch.export.exported_program:ExportedProgram.run_decompositions",
         "executorch.exir.program._program:_gen_edge_manager_for_partitioners"),
        "57fbabd4707bcf0bc8bda14fcb7bf80f028370a0c7628d3b213c759bb462c00f",
        "A decomposition call with nothing to decompose is skipped, one with little is traced on those nodes only (replayed from templates).",
        "tests/flow/test_decompositions.py",
    ),
    Speedup(
        "fakecache",
        ("torch.ao.quantization.fx._decomposed:quantize_per_tensor_meta",
         "torch.ao.quantization.fx._decomposed:dequantize_per_tensor_meta"),
        "c4eeb6a9cec52006a74dc6ec87a4f98b46fc9a41ade1d0fe12d1dd22815ca533",
        "The admitted quantize/dequantize Meta kernels read only their arguments, so FakeTensor's own cache may serve them.",
        "tests/flow/test_fakecache.py",
    ),
    Speedup(
        "signature",
        ("torch.export.graph_signature:ExportGraphSignature.inputs_to_buffers",
         "torch.export.graph_signature:ExportGraphSignature.inputs_to_parameters",
         "torch.export.graph_signature:ExportGraphSignature.inputs_to_lifted_tensor_constants"),
        "cf46023e787df9d4da7ab8480d35437efb68e796392abc5073a3b23918c9ea60",
        "A signature's input mappings are rebuilt only when its input specs change; every change is counted.",
        "tests/flow/test_signature.py",
    ),
    Speedup(
        "treeiter",
        ("torch.utils._pytree:tree_iter",),
        "f22b2006bf62c5699a40fd3f91ec02e61290820fc5c9f181b907a4ea88213899",
        "Plain tuples, lists, dicts and FX's immutable ones are walked directly while the registry holds torch's own flatteners.",
        "tests/unit/test_treeiter.py",
    ),
    Speedup(
        "dtypecheck",
        ("executorch.exir.verification.verifier:EdgeOpArgValidator",
         "executorch.exir.verification.verifier:_check_tensor_args_matching_op_allowed_dtype"),
        "2bed68852b7340083a22375e3a67e6cda4d5c4bf90163d0dfa4a2303994a4516",
        "The edge dtype check reads nodes, values and attributes only; a graph of the same unchanged objects has passed it already.",
        "tests/unit/test_dtypecheck.py",
    ),
    Speedup(
        "callsite",
        ("executorch.backends.arm._passes.arm_pass:ArmPass.call_operator", "traceback:format_stack"),
        "f0a433fe8a1efb766b7d34cd61dd37f0c86cb521ab14d8097c4260bf1681bdcb",
        "format_stack()[-2] from the three stamping sites formats one frame, the same text as formatting all and keeping one.",
        "tests/flow/test_callsite.py",
        ARM,
    ),
    Speedup(
        "stacklines",
        ("torch.utils._traceback:_extract_symbolized_tb", "torch.utils._traceback:CapturedTraceback.summary",
         "traceback:FrameSummary"),
        "8b24c2240cbd140d260f3d179896f0fd5a19a3bffde0d34a4839524e07dbce93",
        "A stack summary's frames look up their line when it is first read, as Python's own StackSummary.extract makes "
        "them: the same lines, and none looked up for the frames a tracer's filter drops.",
        "tests/unit/test_stacklines.py",
    ),
    Speedup(
        "deadcode",
        ("torch.fx:Graph.eliminate_dead_code", "torch.fx:Node.is_impure"),
        "77a59f571c67df23518ba2f39af5641ac2ef63b0dc803af356edf96100c338ff",
        "A node with users is kept whatever is_impure says, so the question is asked only of nodes without users.",
        "tests/unit/test_deadcode.py",
    ),
    Speedup(
        "ciaops",
        ("torch._export.utils:_collect_all_valid_cia_ops", "torch._export.utils:_materialize_cpp_cia_ops"),
        "2da289f45d3f34132011381bcfe28416edde5a2dcb42898134122ebf2c665569",
        "The first registry walk materializes every CompositeImplicitAutograd op; later walks find them all there.",
        "tests/unit/test_ciaops.py",
    ),
    Speedup(
        "exportguards",
        ("torch._dynamo.functional_export:_suggest_or_raise_constraint_violation", "torch._dynamo.guards:PyExprCSEPass",
         "torch._dynamo.guards:build_guard_function", "torch._dynamo.guards:GuardBuilder.add_python_lambda_leaf_guard_to_root",
         "torch._dynamo.guards:CheckFunctionManager.__init__"),
        "9a3dcc39ee7313e71d360a4a4d8f61240c48907dacdccb214cedcb81139b2d39",
        "The guards a strict export builds only to raise constraint violations are never called; their code skips CSE, as on dynamo's own fallback.",
        "tests/unit/test_exportguards.py",
    ),
    Speedup(
        "propagate",
        ("executorch.backends.transforms.propagate_view_copy_permute_pass:PropagateViewCopyPermutePass.call",
         "executorch.backends.transforms.propagate_view_copy_permute_pass:PropagateViewCopyPermutePass._retrace"),
        "c238d167a77041fc0a762a41ad2a19d693fe82ce0bf584a072c33947481485ca",
        "Between rounds of moves, only nodes whose operator, arguments or inputs' values changed are dispatched, as the "
        "retrace dispatches them; the pass's last retrace is stock's, which names every node from the graph alone.",
        "tests/flow/test_propagate.py",
        ARM,
    ),
    Speedup(
        "partitioner",
        ("torch.fx.passes.infra.partitioner:_DependencyViewer",
         "torch.fx.passes.infra.partitioner:CapabilityBasedPartitioner.__init__",
         "torch.fx.passes.infra.partitioner:CapabilityBasedPartitioner.propose_partitions"),
        "3a1d2e4ea87b5b595843625421b8de8431a6435976b7a402e0664e66d5cd63ab",
        "Each reachability question propose_partitions asks of its precomputed closure is answered by a search of the "
        "same edges: the same merges, so the same partitions in the same order.",
        "tests/unit/test_partitioner.py",
    ),
    Speedup(
        "groupmerge",
        ("executorch.exir.backend.canonical_partitioners.group_partitioner:GroupBasedPartitioner._can_merge_partitions",
         "executorch.exir.backend.canonical_partitioners.group_partitioner:_DependencyViewer.downstreams_of"),
        "13704723bd1901794e396b5a925e6ab5f358502865f0e9feffeeb26c5ed09e09",
        "Whether an external user's downstream set holds a node of the merged partitions is asked with isdisjoint, "
        "the same answer as stock's generator: the same merges, so the same partitions.",
        "tests/unit/test_groupmerge.py",
        ("xnnpack",),
    ),
    Speedup(
        "legalize",
        ("torch.fx.passes.tools_common:legalize_graph", "torch.fx.graph:Graph.__init__", "torch.fx.graph:Graph.node_copy",
         "torch.fx.graph:Graph.create_node", "torch.fx.node:Node.__init__", "torch.fx.graph:_Namespace.create_name",
         "executorch.exir.lowered_backend_module:create_submodule_from_nodes",
         "executorch.exir.backend.backend_api:_partition_and_lower_one_graph_module",
         "executorch.exir.backend.backend_api:_create_partitions_in_graph_module"),
        "85d5be6bad518665d95a70de38c0be80c5f7923d292416f963e613f7957ee161",
        "Splitting a partition out re-sorts the graph into a new one; its nodes are moved there in the copy's order, "
        "each with the name, arguments, users and metadata a copy would have, and nothing reads the old nodes again.",
        "tests/unit/test_legalize.py",
    ),
    Speedup(
        "jsonhints",
        ("executorch.exir._serialize._dataclass:_DataclassEncoder.default",
         "executorch.exir._serialize._dataclass:_is_strict_union",
         "executorch.exir._serialize._dataclass:_get_class_from_union",
         "executorch.exir._serialize._dataclass:_json_to_dataclass"),
        "2950a4e65a4cd5328346dc5c0d76a7eece7d3e10918cc5ec3120a91abd3a6e9c",
        "A class's type hints are read once per lowering: the same dict each field's lookup would build, read only.",
        "tests/flow/test_serialtext.py",
        ("xnnpack",),
    ),
    Speedup(
        "debugtext",
        ("executorch.backends.xnnpack._passes.convert_to_linear:ConvertToLinearPass.call",
         "executorch.backends.xnnpack._passes.convert_to_sdpa:ConvertToSDPAPass.call",
         "torch.fx.graph_module:GraphModule.print_readable"),
        "5fde8995f506bfa467f7f41ffb3071ea5a9d60b76120707fddad1d9d675502a6",
        "The readable dump two XNNPACK passes hand a logger that drops debug messages is not written; the graph is "
        "not changed by writing it.",
        "tests/flow/test_serialtext.py",
        ("xnnpack",),
    ),
    Speedup(
        "regions",
        ("executorch.backends.arm._passes.arm_pass_manager:ArmPassManager",
         "executorch.backends.arm.ethosu.backend:EthosUBackend.preprocess",
         "executorch.backends.transforms.propagate_view_copy_permute_pass:PropagateViewCopyPermutePass"),
        "4f8c9ecea3eb85df553e83b048dc880b6f5e91518c839580b765d425865a095d",
        "Ethos-U only: each region's state at the first layout pass is stored; after an edit the regions before it are "
        "served and spliced with the rest, run as one; a .pte holds Vela's stream, which ignores the names and constant "
        "order that differ. Opt-in: it saves little yet.",
        "tests/flow/test_region_splice.py",
        ("arm-ethosu",),
    ),
    Speedup(
        "rebind",
        ("executorch.exir.program._program:_gen_edge_manager_for_partitioners",
         "executorch.exir.program._program:_generate_edge_program",
         "executorch.exir.program._program:EdgeProgramManager.__init__",
         "executorch.exir.verification.verifier:EXIREdgeDialectVerifier",
         "torch.export.exported_program:ExportedProgram.__init__",
         "executorch.exir.program._program:_register_no_decomp_op"),
        "f8e1eb60b8b5bab4c7ac95ce08b17dca149a856b02f990921801018717213473",
        "A weights-only change serves the edge program from a template keyed by the structure: to_edge carries the "
        "quantized program's literals and tensors without reading them, and they are put back where they were. Opt-in: "
        "exact on 203 weights edits, it saves less of an edit than its template costs a new structure.",
        "tests/flow/test_rebind.py",
        ARM,
    ),
    Speedup(
        "qpatterns",
        ("torchao.quantization.pt2e.utils:_get_aten_graph_module_for_pattern",
         "executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils:_do_annotate_conv_bn"),
        "9b99584aabb5458d850e8b67584d61b911d6870d9856c3c2332f51f1ac849f48",
        "A conv-bn pattern's export depends only on its closure, its inputs' layouts and export's settings; each is "
        "exported once per process and every use gets a deep copy of that graph.",
        "tests/flow/test_qpatterns.py",
        ("xnnpack",),
    ),
    Speedup(
        "retraceskip",
        ("executorch.backends.xnnpack._passes:XNNPACKPassManager.transform",
         "executorch.backends.arm._passes.arm_pass_manager:ArmPassManager._transform", f"{_PB}:_ExportPassBase.call",
         f"{_PB}:_ExportPassBase.call_submodule", f"{_PB}:ExportPass.call_submodule",
         f"{_PB}:_ExportPassBase.ExportTracer.set_metadata", f"{_PB}:ExportPass.ExportInterpreter.call_function"),
        "465a97630fb1eea09225a4fb9e6005a03477f6a641b5105314e5828802644ecc",
        "A retrace of a retrace's output gives back the same graph, so a pass (XNNPACK's, the Arm TOSA pipeline's) whose "
        "body left the graph as the last retrace made it (every node, argument, metadata value and user), and whose "
        "retrace would hand every node on as it is, returns it as it is.",
        "tests/flow/test_retraceskip.py",
        ("xnnpack", *ARM),
    ),
    Speedup(
        "checkskip",
        ("executorch.backends.xnnpack._passes:XNNPACKPassManager.transform",
         "executorch.exir.pass_manager:ExportedProgramPassManager.check",
         "torch.export.exported_program:ExportedProgram._validate",
         "torch._export.verifier:Verifier._check_graph_module",
         "torch._export.verifier:_verify_exported_program_signature",
         "executorch.exir.verification.verifier:EXIREdgeDialectVerifier"),
        "3fee0934e34036990c78ea744d29b88daa52a85a096c1f0fe8a803f2f567006f",
        "A program check (lint, verifiers) reads the graph, its signature, state and verifiers and changes nothing, so "
        "within XNNPACK's pass manager a check of a program pictured as one that passed is not run again.",
        "tests/flow/test_checkskip.py",
        ("xnnpack",),
    ),
    Speedup(
        "gcfreeze",
        (),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "gc.freeze only moves the objects alive at the start out of full collections; no value changes.",
        "tests/flow/test_gcfreeze.py",
    ),
)

NAMES = tuple(s.name for s in SPEEDUPS)
_BY_NAME = {s.name: s for s in SPEEDUPS}
# On only when named: ``all`` leaves them off (``all,regions`` turns one on).
OPT_IN = frozenset({"regions", "rebind"})
DEFAULT = frozenset(NAMES) - OPT_IN

_lock = threading.Lock()
_selected: frozenset[str] = DEFAULT
_audit: dict[str, bool] = {}  # name -> installed sources are the audited ones (once per process)


def parse(text: str) -> frozenset[str]:
    """The names ``text`` (``LOWERCACHE_SPEEDUPS``'s grammar) selects; one-line error for an unknown name."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    chosen: set[str] = set()
    for item in items or ["all"]:
        name = item.lstrip("-")
        if name == "all":
            chosen |= set(DEFAULT) if not item.startswith("-") else set()
        elif name == "none":
            chosen.clear()
        elif name not in _BY_NAME:
            raise LowercacheError(f"unknown speed-up {name!r} in speedups setting; known: all, none, {', '.join(NAMES)}")
        elif item.startswith("-"):
            chosen.discard(name)
        else:
            chosen.add(name)
    return frozenset(chosen)


def select(text: str) -> None:
    """Choose the speed-ups the next lowering may turn on (a process-wide choice, as an env var is)."""
    global _selected
    chosen = parse(text)
    with _lock:
        _selected = chosen


def audited(name: str) -> bool:
    """Whether the installed sources ``name`` patches are the ones it was proven exact against."""
    with _lock:
        known = _audit.get(name)
    if known is not None:
        return known
    entry = _BY_NAME[name]
    found = targets_digest(entry.patches)
    if found == "patched":
        return True  # already replaced by lowercache itself: it was checked when that happened
    ok = found == entry.audited
    with _lock:
        _audit[name] = ok
    return ok


def applies(name: str, family: str) -> bool:
    """Whether ``name`` is proven on ``family``'s lowerings (so that family's hooks may turn it on)."""
    return family in _BY_NAME[name].families


def state(name: str, family: str | None = None) -> str:
    """``on``, ``off: disabled by setting``, ``off: installed source differs`` or, for a ``family`` it is not proven
    on, ``off: not for <family>``."""
    if family is not None and not applies(name, family):
        return f"off: not for {family}"
    if name not in _selected:
        return "off: disabled by setting"  # an opt-in one too, until named
    return "on" if audited(name) else "off: installed source differs"


def active(*families: str) -> list[str]:
    """The speed-ups to turn on now for a lowering of one of ``families`` (any family when none is named), in
    registry order."""
    return [s.name for s in SPEEDUPS if (not families or set(families) & set(s.families)) and state(s.name) == "on"]


def module(name: str) -> Any:
    """The module that implements ``name`` (its ``enable``/``disable`` switch it)."""
    return importlib.import_module(f"{__package__}.{name}")


def report(check: bool = True, family: str | None = None) -> dict[str, str]:
    """Every speed-up's state (for a lowering of ``family``, when named), for ``lowercache speedups`` and the manifest.

    ``check=False`` reads no source (a cache hit must not import the Arm
    backend to describe speed-ups it did not need): a speed-up not yet checked
    in this process is reported as ``unchecked: nothing it speeds up ran``.
    """
    if check:
        return {s.name: state(s.name, family) for s in SPEEDUPS}
    with _lock:
        known = dict(_audit)
    return {
        s.name: state(s.name, family) if s.name not in _selected or s.name in known or (family and not applies(s.name, family))
        else "unchecked: nothing it speeds up ran"
        for s in SPEEDUPS
    }


def is_on(name: str) -> bool:
    return state(name) == "on"
