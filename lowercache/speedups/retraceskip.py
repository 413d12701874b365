"""XNNPACK's passes: a pass whose body left the graph as the last retrace made it returns that graph instead of
retracing it again, since a retrace of a retrace's output gives back the same graph.

Why it is exact, and figures: docs/speedups.md#retraceskip.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

from . import graphpicture, passrun, retrace
from .patching import Counters, Patch
from .sourcepin import source_digest

# sha256 over the sources of _audited_sources() (executorch 1.5.1, torch 2.13.0).
_AUDITED_DIGEST = "c32d5a47a2952a36c1e72aac461c8a1d387ab147ed7c8e3b6bd3271191e48e59"
_originals: dict[str, Any] = {}
_tls = threading.local()

_counts = Counters("retraced", "skipped", "changed")
_count = _counts.count

# What a bare ExportPass retrace dispatches to: a pass that overrides one of these does its work in the retrace.
_HOOKS = ("placeholder", "output", "call_operator", "call_size_operator", "call_size_operator_all", "call_sym",
          "call_cond", "call_while", "call_map", "call_scan", "call_getitem", "call_submodule", "call_delegate",
          "on_attr", "inputs", "_fx", "ExportTracer", "ExportInterpreter")


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

    return [
        passrun.original(),  # the wrapper another speed-up's scope installed is not the code pinned
        _ExportPassBase.call,
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
    """Whether ``pass_``'s retrace is ExportPass's own (no hook it dispatches to is overridden)."""
    from executorch.exir.pass_base import ExportPass

    kind = type(pass_)
    return all(getattr(kind, name) is getattr(ExportPass, name) for name in _HOOKS) and not any(
        name in vars(pass_) for name in _HOOKS)


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
    if recorded is not None and _bare(self):
        if graphpicture.same(recorded, _snapshot(graph_module)):
            _count("skipped")
            return _skipped(self, graph_module)
        _count("changed")
    result = original(self, graph_module)
    _count("retraced")
    outputs[result.graph_module] = _snapshot(result.graph_module)
    return result


@contextlib.contextmanager
def _run(manager: Any) -> Iterator[None]:
    """The pass manager's run: its passes' retrace outputs are remembered during it, and forgotten after (the
    passes' own helpers, such as the patterns some export and lower to edge, retrace as stock does)."""
    outer = getattr(_tls, "outputs", None), getattr(_tls, "passes", None)
    _tls.outputs, _tls.passes = weakref.WeakKeyDictionary(), frozenset(manager.passes)
    try:
        yield
    finally:
        _tls.outputs, _tls.passes = outer


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    from executorch.exir.pass_base import _ExportPassBase

    _originals["call"] = _ExportPassBase.call
    _ExportPassBase.call = _call
    passrun.add("retraceskip", _run)


def _undo() -> None:
    if "call" not in _originals:
        return
    from executorch.exir.pass_base import _ExportPassBase

    passrun.remove("retraceskip")
    _ExportPassBase.call = _originals.pop("call")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
