"""Strict-export each conv-bn pattern ``XNNPACKQuantizer`` matches once per process, and hand each use a copy.

Every ``prepare_pt2e`` with ``XNNPACKQuantizer`` runs its conv-bn annotators,
which build 12 small pattern functions and ``torch.export`` each one
(``strict=True``, through dynamo): about 0.12 s each, nearly all of a small
model's quantization. The pattern depends only on what the closure holds (the
conv function, ``has_relu``, ``relu_is_inplace``), the example inputs' layouts
and the export's configuration, so the first export of each is kept and every
later call gets a deep copy of it. The warm server's warm-up lowers a tiny
model for ``xnnpack-int8``, so its children find all 12 kept.

Why it is exact, and figures: docs/speedups.md#qpatterns.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from .patching import Counters, Patch
from .sourcepin import source_digest

# sha256 over the sources of torchao's _get_aten_graph_module_for_pattern and ExecuTorch's _do_annotate_conv_bn
# (torchao 0.18.0, executorch 1.5.1).
_AUDITED_DIGEST = "9b99584aabb5458d850e8b67584d61b911d6870d9856c3c2332f51f1ac849f48"
_HOLDER = "executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils"
_FREEVARS = ("conv_fn", "has_relu", "relu_is_inplace")  # what the pattern closure holds
_originals: dict[str, Any] = {}
_kept: dict[tuple[Any, ...], Any] = {}  # key -> the first export's graph module, never handed out itself
_lock = threading.Lock()
_counts = Counters("exported", "copied")


def sources_digest() -> str | None:
    """Digest of the torchao and ExecuTorch sources whose behaviour this module relies on."""
    import importlib

    from torchao.quantization.pt2e import utils

    holder = importlib.import_module(_HOLDER)
    return source_digest(utils._get_aten_graph_module_for_pattern, holder._do_annotate_conv_bn)


def _pattern_code(annotate: Any) -> Any:
    """The code object of the ``_conv_bn`` closure ``_do_annotate_conv_bn`` builds (the same object every call)."""
    for const in annotate.__code__.co_consts:
        if getattr(const, "co_name", None) == "get_pattern":
            for inner in const.co_consts:
                if getattr(inner, "co_name", None) == "_conv_bn":
                    return inner
    return None


def _layout(value: Any) -> tuple[Any, ...] | None:
    import torch

    if type(value) is not torch.Tensor:
        return None
    return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device, value.requires_grad, value.layout)


def _key(pattern: Any, example_inputs: Any, is_cuda: bool, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What the export of ``pattern`` depends on, or None when it is not a conv-bn pattern this module knows."""
    import torch
    import torch._dynamo.config
    import torch._export.config
    import torch._functorch.config
    import torch.fx.experimental._config

    fn = getattr(pattern, "fn", None)
    code = getattr(fn, "__code__", None)
    if kwargs or code is None or code is not _originals["code"] or code.co_freevars != _FREEVARS:
        return None
    conv_fn, has_relu, relu_is_inplace = (cell.cell_contents for cell in fn.__closure__)
    if type(has_relu) is not bool or type(relu_is_inplace) is not bool:
        return None
    layouts = tuple(_layout(x) for x in example_inputs)
    if not isinstance(example_inputs, tuple) or None in layouts:
        return None
    state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
             torch.is_autocast_enabled("cpu"))
    configs = tuple(module.save_config() for module in (torch._dynamo.config, torch._functorch.config,
                                                        torch.fx.experimental._config, torch._export.config))
    return (type(pattern), conv_fn, has_relu, relu_is_inplace, layouts, bool(is_cuda), state, configs)


def _get_aten_graph_module_for_pattern(pattern: Any, example_inputs: Any, is_cuda: bool = False, **kwargs: Any) -> Any:
    original = _originals["export"]
    key = _key(pattern, example_inputs, is_cuda, kwargs)
    if key is None:
        return original(pattern, example_inputs, is_cuda, **kwargs)
    with _lock:
        kept = _kept.get(key)
    if kept is None:
        exported = original(pattern, example_inputs, is_cuda, **kwargs)
        _counts.count("exported")
        kept = _keep(exported)
        if kept is None:
            return exported
        with _lock:
            kept = _kept.setdefault(key, kept)
    _counts.count("copied")
    return _copy(kept)


def _copy(kept: Any) -> Any:
    """A deep copy of ``kept`` that shares its pytree specs: they are frozen, and deep-copying one warns (torch's
    ``LeafSpec`` deprecation) where a fresh export does not."""
    specs = (kept._in_spec, kept._out_spec)
    return copy.deepcopy(kept, {id(spec): spec for spec in specs if spec is not None})


def _keep(exported: Any) -> Any:
    """``exported``, made to share its pytree specs with its copies, or None when it is not as this module expects.

    ``Graph.__deepcopy__`` copies the code generator without the caller's memo,
    so the kept graph's own generator is given a ``__deepcopy__`` (the kept
    module is never handed out: its copies get torch's own class, with their
    own ``_PyTreeInfo`` around the same specs).
    """
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

    codegen = exported.graph._codegen
    if type(codegen) is not _PyTreeCodeGen or type(codegen.pytree_info) is not _PyTreeInfo:
        return None

    def deepcopy(memo: dict[int, Any]) -> Any:
        twin = _PyTreeCodeGen.__new__(_PyTreeCodeGen)
        twin.__dict__.update((k, v) for k, v in vars(codegen).items() if k != "__deepcopy__")
        info = codegen.pytree_info
        twin.pytree_info = _PyTreeInfo(list(info.orig_args), info.in_spec, info.out_spec)
        return twin

    codegen.__deepcopy__ = deepcopy
    return exported


def _apply() -> None:
    import importlib

    try:
        ok = sources_digest() == _AUDITED_DIGEST
    except (ImportError, AttributeError):  # a release without these functions
        ok = False
    holder = importlib.import_module(_HOLDER) if ok else None
    code = _pattern_code(holder._do_annotate_conv_bn) if holder is not None else None
    if code is None:
        return
    _originals.update(holder=holder, export=holder._get_aten_graph_module_for_pattern, code=code)
    holder._get_aten_graph_module_for_pattern = _get_aten_graph_module_for_pattern


def _undo() -> None:
    holder = _originals.pop("holder", None)
    if holder is not None:
        holder._get_aten_graph_module_for_pattern = _originals["export"]
    _originals.clear()


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
active = _patch.active


def stats() -> dict[str, int]:
    """Exports made and copies handed out since the last reset; ``kept``: patterns held now."""
    with _lock:
        kept = len(_kept)
    return {**_counts.snapshot(), "kept": kept}


def reset_stats() -> None:
    _counts.reset()


def forget() -> None:
    """Drop every kept export (a test's way to start as a new process does)."""
    with _lock:
        _kept.clear()
