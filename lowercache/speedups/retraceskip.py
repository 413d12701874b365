"""XNNPACK's passes and the Arm TOSA pipeline's: a pass whose body left the graph as the last retrace made it, and
whose retrace hooks would hand every node on as they are, returns that graph instead of retracing it again, since a
retrace of a retrace's output gives back the same graph.

Why it is exact, and figures: docs/speedups.md#retraceskip.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Iterator

from . import fastcopy, graphpicture, oppolicy, passrun, retrace
from .patching import Counters, Patch
from .sourcepin import source_digest

# sha256 over the sources of _audited_sources() (executorch 1.5.1, torch 2.13.0).
_AUDITED_DIGEST = "4046c9a45d5d7071a1285daf4cf50af446c2081c2200172dd75371bc8955bddc"
_originals: dict[str, Any] = {}
_tls = threading.local()

_counts = Counters("retraced", "skipped", "changed")
_count = _counts.count

# What a bare ExportPass retrace dispatches to: a pass that overrides one of these does its work in the retrace.
_HOOKS = ("placeholder", "output", "call_operator", "call_size_operator", "call_size_operator_all", "call_sym",
          "call_cond", "call_while", "call_map", "call_scan", "call_getitem", "call_submodule", "call_delegate",
          "on_attr", "inputs", "_fx", "ExportTracer", "ExportInterpreter")


# The hooks a retrace dispatches to on a graph of placeholders, operators (OpOverloads and edge ops with tensor or
# int-list values, no symbolic-int ops), getitems and the output: ``call_sym``, ``call_cond``, ``on_attr`` and the
# other hooks of _HOOKS are not reached there.
_OPERATOR_GRAPH_HOOKS = ("placeholder", "output", "call_operator", "call_getitem", "call_submodule", "inputs", "_fx",
                         "ExportTracer", "ExportInterpreter")


def stats() -> dict[str, int]:
    """Since :func:`reset_stats`: ``retraced`` (stock retraces by XNNPACK's passes), ``skipped`` (a graph returned
    as the last retrace left it), ``changed`` (a pass body had changed it: retraced)."""
    return _counts.snapshot()


def reset_stats() -> None:
    _counts.reset()


def _audited_sources() -> list[Any]:
    """The retrace whose idempotence the skip relies on, and the pass manager whose scope it is on in."""
    import torch.fx.proxy
    import torch.fx.traceback
    from executorch.exir.pass_base import ExportPass, _ExportPassBase

    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager, _ExportedProgramGraphPassAdapter

    return [
        passrun.original(),  # the wrapper another speed-up's scope installed is not the code pinned
        _originals.get("arm_transform", ArmPassManager._transform),  # the Arm pipeline's run, where the scope is on
        _ExportedProgramGraphPassAdapter.call,  # what the Arm pipeline does with a pass's result
        ArmPass.call_submodule,
        original_call(),
        _ExportPassBase.inputs,
        _ExportPassBase.call_submodule,
        ExportPass.call_submodule,
        ExportPass.ExportTracer.create_arg,
        _ExportPassBase.ExportTracer.create_arg,
        _ExportPassBase.placeholder,
        _ExportPassBase.output,
        _ExportPassBase.call_operator,
        _ExportPassBase.call_getitem,
        retrace.original("_fx", _ExportPassBase._fx),  # the retrace speed-up may have replaced it
        _ExportPassBase.ExportTracer.set_metadata,
        _ExportPassBase.ExportInterpreter.placeholder,
        _ExportPassBase.ExportInterpreter.get_attr,
        _ExportPassBase.ExportInterpreter.call_function,
        ExportPass.ExportInterpreter.call_function,
        torch.fx.proxy.TracerBase.create_node,  # the metadata a retrace copies, and in what key order
        torch.fx.traceback.set_current_meta,
    ]


def original_call() -> Any:
    """Stock's ``_ExportPassBase.call``, for a pin of its source whether or not the skip is installed."""
    from executorch.exir.pass_base import _ExportPassBase

    return _originals.get("call", _ExportPassBase.call)


def sources_digest() -> str | None:
    """Digest of the audited sources as installed."""
    return source_digest(*_audited_sources())


def _snapshot(graph_module: Any) -> tuple:
    """What a retrace of ``graph_module`` reads (``graphpicture.snapshot``). A retrace copies each node's metadata
    shallowly, so what is changed inside a held object is the same with the retrace or without; and it recomputes
    values from the objects held there, which passes replace rather than change (as ``retrace`` and ``dtypecheck``
    rely on too)."""
    return graphpicture.snapshot(graph_module)


def _bare(pass_: Any) -> bool:
    """Whether ``pass_``'s retrace is ExportPass's own (no hook it dispatches to is overridden). A hook a release's
    ExportPass lacks (ExecuTorch 1.4 has no ``call_size_operator``) counts as overridden if a pass defines it."""
    from executorch.exir.pass_base import ExportPass

    kind = type(pass_)
    return all(getattr(kind, name, None) is getattr(ExportPass, name, None) for name in _HOOKS) and not any(
        name in vars(pass_) for name in _HOOKS)


def _arm_bare(pass_: Any, graph_module: Any) -> bool:
    """Whether ``pass_``'s retrace of ``graph_module`` is ExportPass's own for every node: no hook overridden but
    ``call_operator`` and ``ArmPass.call_submodule`` (which counts its depth, and at the top calls ExportPass's),
    ``call_operator`` handing each operator node on as it is (``fastcopy.hands_every_node_on``), every operator one
    whose fake kernel gives the same value's metadata for the same inputs' (``oppolicy``; ``tosa.CONST_SHAPE``, a
    list of ints from a list of ints, too), on static shapes, and no submodule graph (control flow)."""
    from executorch.backends.arm._passes.arm_pass import ArmPass
    from executorch.exir.pass_base import ExportPass
    from torch.fx import GraphModule

    kind = type(pass_)
    for name in _OPERATOR_GRAPH_HOOKS:
        if name in vars(pass_):
            return False
        if name == "call_operator":
            continue
        mine, stock = getattr(kind, name), getattr(ExportPass, name)
        if mine is stock:
            continue
        if name != "call_submodule" or mine is not ArmPass.call_submodule or getattr(pass_, "submodule_depth", None) != 0:
            return False
    if any(isinstance(child, GraphModule) for child in graph_module.children()):
        return False
    for n in graph_module.graph.nodes:
        if n.op == "call_function":
            if n.target is not operator.getitem and oppolicy.policy(n.target) is None and not _shape_list(n):
                return False
            if "from_node" not in n.meta or not _static(n.meta.get("val")):
                return False
        elif n.op not in ("placeholder", "output"):
            return False
    return fastcopy.hands_every_node_on(pass_, graph_module)


def _static(value: Any) -> bool:
    """A FakeTensor (or a list or tuple of them, or of ints) with no symbolic size, stride or offset."""
    import torch

    if isinstance(value, torch.Tensor):
        return all(type(s) is int for s in value.shape) and all(type(s) is int for s in value.stride()) and type(
            value.storage_offset()) is int
    if isinstance(value, (list, tuple)):
        return all(type(v) is int or _static(v) for v in value)
    return type(value) is int


def _shape_list(n: Any) -> bool:
    """``tosa.CONST_SHAPE``: its kernel returns its one argument, a list of ints, as it is."""
    from executorch.exir.dialects._ops import ops as exir_ops

    return n.target is exir_ops.backend.tosa.CONST_SHAPE.default and all(type(v) is int for v in n.args[0])


def _skipped(pass_: Any, graph_module: Any) -> Any:
    """What a skipped retrace returns: the graph as it is (a test audits this against the real retrace)."""
    from torch.fx.passes.infra.pass_base import PassResult

    return PassResult(graph_module, True)


def _call(self: Any, graph_module: Any) -> Any:
    original = _originals["call"]
    outputs = getattr(_tls, "outputs", None)
    if outputs is None or type(self) not in _tls.passes:
        return original(self, graph_module)  # not one of the passes XNNPACK's pass manager runs
    recorded = outputs.get(graph_module)
    if recorded is not None and (_bare(self) or (_tls.arm and _arm_bare(self, graph_module))):
        if graphpicture.same(recorded, _snapshot(graph_module)):
            _count("skipped")
            return _skipped(self, graph_module)
        _count("changed")
    result = original(self, graph_module)
    _count("retraced")
    # Only the last retrace's output: a pipeline hands each pass the graph the last one left, and a picture holds
    # its graph alive (and through it the module), so older ones would keep every graph of the run.
    outputs.clear()
    outputs[result.graph_module] = _snapshot(result.graph_module)
    return result


@contextlib.contextmanager
def _run(manager: Any, arm: bool = False) -> Iterator[None]:
    """The pass manager's run: its passes' retrace outputs are remembered during it, and forgotten after (the
    passes' own helpers, such as the patterns some export and lower to edge, retrace as stock does)."""
    outer = getattr(_tls, "outputs", None), getattr(_tls, "passes", None), getattr(_tls, "arm", False)
    passes = frozenset(p if isinstance(p, type) else type(p) for p in manager.passes)
    _tls.outputs, _tls.passes, _tls.arm = {}, passes, arm
    try:
        yield
    finally:
        _tls.outputs, _tls.passes, _tls.arm = outer


def _arm_transform(self: Any, exported_program: Any, graph_module: Any) -> Any:
    """The Arm pipeline's run of its passes (``ArmPassManager._transform``) on a partition's program, inside
    ``preprocess``: in scope unless the TOSA debug dump is on (it writes each node's provenance, which a retrace
    extends)."""
    original = _originals["arm_transform"]
    if graph_module is not exported_program.graph_module or self.compile_spec.tosa_debug_mode is not None:
        return original(self, exported_program, graph_module)
    with _run(self, arm=True):
        return original(self, exported_program, graph_module)


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    from executorch.exir.pass_base import _ExportPassBase

    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    _originals["call"] = _ExportPassBase.call
    _ExportPassBase.call = _call
    _originals["arm_transform"] = ArmPassManager._transform
    ArmPassManager._transform = _arm_transform
    passrun.add("retraceskip", _run)


def _undo() -> None:
    if "call" not in _originals:
        return
    from executorch.exir.pass_base import _ExportPassBase

    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager

    passrun.remove("retraceskip")
    _ExportPassBase.call = _originals.pop("call")
    ArmPassManager._transform = _originals.pop("arm_transform")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
