"""XNNPACK's passes: a program check whose every input is as it was when a check of the same graph passed is not
run again, since the check is a function of those inputs and changes nothing.

Why it is exact, and figures: docs/speedups.md#checkskip.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from . import graphpicture, passrun
from .patching import Counters, Patch
from .sourcepin import source_digest

# sha256 over the sources of _audited_sources() (executorch 1.5.1, torch 2.13.0).
_AUDITED_DIGEST = "3ca83f118eb24d2d4ab1f766a3b6c1eb098d6c7bb50a8ee116ec2f6c3c7c2454"
_originals: dict[str, Any] = {}
_tls = threading.local()
_MISSING = object()
_SCALARS = (str, int, float, bool, type(None))

_counts = Counters("checked", "skipped")
_count = _counts.count


def stats() -> dict[str, int]:
    """Since :func:`reset_stats`: ``checked`` (stock checks run inside XNNPACK's pass manager), ``skipped`` (a
    check of a program pictured as one that passed)."""
    return _counts.snapshot()


def reset_stats() -> None:
    _counts.reset()


def _audited_sources() -> list[Any]:
    """The check, what it runs, and the pass manager that calls it before and after every pass. The edge dtype check
    it also runs is ``dtypecheck``'s to pin (that speed-up may have replaced it, with a function of the same inputs)."""
    import torch.fx
    from executorch.exir import pass_manager
    from executorch.exir.verification import verifier as exir_verifier
    from torch._export import verifier
    from torch.export.exported_program import ExportedProgram

    return [
        pass_manager.ExportedProgramPassManager.__call__,
        pass_manager.ExportedProgramPassManager.check,
        ExportedProgram.validate,
        ExportedProgram._validate,
        verifier.Verifier.check,
        verifier.Verifier._check_graph_module,
        verifier.getattr_recursive,
        verifier._check_val,
        verifier._verify_exported_program_module_call_graph,
        verifier._verify_exported_program_signature,
        exir_verifier.EXIRATenDialectVerifier,
        exir_verifier.EXIREdgeDialectVerifier,
        exir_verifier._check_tensors_are_contiguous,
        torch.fx.Graph.lint,
    ]


def sources_digest() -> str | None:
    """Digest of the audited sources as installed."""
    return source_digest(*_audited_sources())


def _scalar_or_id(value: Any, keep: list) -> Any:
    if isinstance(value, _SCALARS):
        return value
    keep.append(value)
    return id(value)


def _spec_row(spec: Any, keep: list) -> tuple | None:
    """An input or output spec by value: its kind, target and persistence, and its argument's type and fields
    (scalars by value, anything else by identity). A signature made again from the same graph has the same rows.
    None for a spec or argument that is not a plain object."""
    arg = spec.arg
    fields = getattr(arg, "__dict__", None)
    if fields is None or not hasattr(spec, "__dict__"):
        return None
    return (type(spec), spec.kind, spec.target, getattr(spec, "persistent", None), type(arg),
            *(_scalar_or_id(v, keep) for v in fields.values()))


# The verifier classes whose reads are audited: torch's own, and those ExecuTorch's pinned factories make.
_FACTORIES = ("EXIRATenDialectVerifier.<locals>.", "EXIREdgeDialectVerifier.<locals>.")


def _audited_verifier(cls: Any) -> bool:
    """Whether ``cls`` checks with torch's audited ``check`` and reads no more than the audited sources read."""
    from torch._export.verifier import Verifier

    if not isinstance(cls, type) or cls.check is not Verifier.check:
        return False
    if cls._check_graph_module is not Verifier._check_graph_module:
        return False
    return cls.__module__ == Verifier.__module__ or cls.__qualname__.startswith(_FACTORIES)


def _verifier_picture(cls: Any, keep: list) -> tuple | None:
    """A verifier class and what its ``__init__`` closes over (ExecuTorch's edge verifier reads its compile config
    and op lists there): the config's settings and the lists' items. None for a verifier not audited."""
    if not _audited_verifier(cls):
        return None
    keep.append(cls)
    cells = []
    for cell in getattr(getattr(cls, "__init__", None), "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, (list, tuple)):
            cells.append(tuple(_scalar_or_id(v, keep) for v in value))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            cells.append((_scalar_or_id(value, keep), *((k, _scalar_or_id(v, keep)) for k, v in vars(value).items())))
        else:
            cells.append(_scalar_or_id(value, keep))
    return (id(cls), tuple(cells))


def _picture(exported_program: Any) -> tuple | None:
    """Everything the check reads, by identity (values for scalars): each graph module's picture
    (``graphpicture``), the object each ``get_attr`` names, the signature's specs, the state dict's and the
    constants' entries, the module call graph's names and the verifiers; None for a program with a submodule that
    is not a graph module (a lowered module's insides are not pictured), a spec that is not a plain object, or a
    verifier or ``validate`` whose reads are not the audited ones."""
    import torch
    from torch.export.exported_program import ExportedProgram

    if type(exported_program).validate is not ExportedProgram.validate:
        return None  # a program that validates its own way
    gm = exported_program.graph_module
    modules = list(gm.modules())
    if not all(isinstance(m, torch.fx.GraphModule) for m in modules):
        return None
    keep: list = []
    parts = []
    for module in modules:
        picture = graphpicture.snapshot(module)
        keep.append(picture[-1])
        attrs, lists = [], []
        for node in module.graph.nodes:
            if node.op == "get_attr":
                attrs.append(_scalar_or_id(_attribute(module, node.target), keep))
            value = node.meta.get("val")
            if type(value) is list:  # the one held value the check looks into that can change in place
                lists.append((node.name, tuple(_scalar_or_id(v, keep) for v in value)))
        parts.append((picture[:-1], id(module.graph.owning_module), tuple(attrs), tuple(lists)))
    signature = exported_program.graph_signature
    specs = [_spec_row(spec, keep) for spec in signature.input_specs]
    specs.append(len(specs))  # where the outputs begin
    specs += [_spec_row(spec, keep) for spec in signature.output_specs]
    if None in specs:
        return None
    tables = tuple(tuple((k, id(v), type(v)) for k, v in table.items())
                   for table in (exported_program.state_dict, exported_program.constants))
    keep += [*exported_program.state_dict.values(), *exported_program.constants.values()]
    calls = tuple((entry.fqn, None if entry.signature is None else tuple(
        tuple(getattr(arg, "name", None) for arg in args) for args in (entry.signature.inputs, entry.signature.outputs)))
        for entry in exported_program.module_call_graph)
    verifiers = tuple(_verifier_picture(v, keep) for v in exported_program.verifiers)
    if None in verifiers:
        return None
    return (tuple(parts), tuple(specs), tables, calls, verifiers, keep)


def _attribute(module: Any, target: Any) -> Any:
    """What the verifier's ``getattr_recursive`` finds at a ``get_attr`` target, or a marker where it finds none."""
    from torch._export.verifier import getattr_recursive

    if not isinstance(target, str):
        return _MISSING
    try:
        return getattr_recursive(module, target)
    except RuntimeError:  # a missing atom
        return _MISSING


def _check(self: Any, exported_program: Any) -> None:
    original = _originals["check"]
    passed = getattr(_tls, "passed", None)
    if passed is None:
        return original(self, exported_program)  # not inside XNNPACK's pass manager
    gm = exported_program.graph_module
    now, last = _picture(exported_program), passed.get(gm)
    if now is not None and last is not None and graphpicture.same(last, now):
        gm.recompile()  # the one thing the check does besides raising
        _count("skipped")
        return None
    _count("checked")
    original(self, exported_program)
    if now is not None:  # what was checked: the check changes nothing the picture holds
        passed[gm] = now
    return None


@contextlib.contextmanager
def _run(manager: Any) -> Iterator[None]:
    """The pass manager's run: the programs that passed a check are remembered during it, and forgotten after."""
    outer = getattr(_tls, "passed", None)
    _tls.passed = {}
    try:
        yield
    finally:
        _tls.passed = outer


def _apply() -> None:
    if sources_digest() != _AUDITED_DIGEST:
        return
    from executorch.exir.pass_manager import ExportedProgramPassManager

    _originals["check"] = ExportedProgramPassManager.check
    ExportedProgramPassManager.check = _check
    passrun.add("checkskip", _run)


def _undo() -> None:
    if "check" not in _originals:
        return
    from executorch.exir.pass_manager import ExportedProgramPassManager

    passrun.remove("checkskip")
    ExportedProgramPassManager.check = _originals.pop("check")


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active
