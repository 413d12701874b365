"""Declared pass-through conditions for passes whose ``call_operator`` has no ``target_ops`` guard.

fastcopy trusts a pass with a node when the pass provably hands that node's
op (or one fixed replacement op) and arguments to the base ``call_operator``. Most Arm passes say so with a
``target_ops`` guard that fastcopy reads from the syntax tree. ExecuTorch's
own ``to_edge`` / ``to_executorch`` passes, and a few Arm passes, have no such guard; for the ones
that cost the most this registry states the condition, read from their
``call_operator``, as a function of the pass instance and the node. Where the
condition calls the pass's own helpers, it calls them with the arguments the
interpreter would pass (the node's arguments mapped through the retrace's
environment), so it is the same computation.

Each entry is pinned to a digest of the ``call_operator`` source it was read
from: if the installed ExecuTorch differs, the entry does not apply and the
pass is interpreted the stock way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .sourcepin import source_digest

Gate = Callable[[Any, Any, Any, dict], Any]
"""``gate(pass, node, op, env)``: the op this override hands to the next
``call_operator`` with the node's arguments unchanged (``op`` itself for a
pass-through, another op for a plain substitution), or None when it may do
anything else. ``op`` is what reached the override; ``env`` maps the old
graph's nodes to the retrace's ProxyValues."""


def _normalize_transpose(module: Any) -> Gate:
    import torch

    return lambda p, n, op, env: None if op == torch.ops.aten.t.default else op


def _replace_broken_ops(module: Any) -> Gate:
    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        try:
            return None if op.is_view else op
        except Exception:  # stock would raise from the same expression: let it
            return None

    return gate


def _memory_format_ops(module: Any) -> Gate:
    edge_op, dim_order_ops = module.EdgeOpOverload, module.DimOrderOpsMap
    return lambda p, n, op, env: None if isinstance(op, edge_op) and op in dim_order_ops else op


def _remove_mixed_type(module: Any) -> Gate:
    import torch

    aten = torch.ops.aten
    allow = dict.fromkeys(
        (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.div.Tensor_mode, aten.minimum.default)
    )
    return lambda p, n, op, env: op if len(n.args) <= 1 or op not in allow else None


def _legalize_dim_order(module: Any) -> Gate:
    return lambda p, n, op, env: None if op in p._target_ops else op


def _op_replace(module: Any) -> Gate:
    return lambda p, n, op, env: module.aten_to_edge(op) if module.should_lower_to_edge(op) else op


def _schema_values(op: Any, n: Any) -> Any:
    """(old argument, schema argument) pairs in the order ``map_args`` visits them."""
    for i, schema in enumerate(op._schema.arguments):
        if schema.name in n.kwargs:
            yield n.kwargs[schema.name], schema
        elif not schema.kwarg_only and i < len(n.args):
            yield n.args[i], schema


def _scalar_to_tensor(module: Any) -> Gate:
    import torch

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        # try_coerce turns a Python scalar given for a Tensor argument into a tensor; old
        # node arguments that are Nodes reach it as ProxyValues, never as scalars.
        for value, schema in _schema_values(op, n):
            if isinstance(value, (float, int, bool)) and isinstance(schema.type, torch.TensorType):
                return None
        return op

    return gate


def _sym_to_tensor(module: Any) -> Gate:
    import torch

    symbolic = {torch.SymInt, torch.SymFloat, torch.SymBool}
    proxy_value = module.ProxyValue

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        # is_sym: a ProxyValue holding a symbolic scalar given for a Tensor argument.
        for value, schema in _schema_values(op, n):
            if isinstance(value, torch.fx.Node) and isinstance(schema.type, torch.TensorType):
                new = env.get(value)
                if isinstance(new, proxy_value) and not new.is_tensor() and type(new.data) in symbolic:
                    return None
        return op

    return gate


def _mapped_args(n: Any, env: dict) -> Any:
    """The positional arguments ``ExportInterpreter.call_function`` hands to ``call_operator``."""
    import torch

    return torch.fx.node.map_arg(n.args, env.__getitem__)


def _symbolic_to_tosa_shapes(module: Any) -> Gate:
    import logging

    import torch

    sym_size = torch.ops.aten.sym_size.int

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        # Its debug lines are the one other effect of the pass-through branches.
        if op == sym_size or module.logger.isEnabledFor(logging.DEBUG):
            return None
        if module.meta_has_shape_mark(n.meta):
            return op
        for arg in _mapped_args(n, env):
            if isinstance(arg, (list, tuple)) and len(arg) > 0:
                if p._has_raw_symint_arg(arg) or p._has_shape_proxy_arg(arg):
                    return None
        return op

    return gate


def _decompose_grouped_conv(module: Any) -> Gate:
    klass = module.DecomposeGroupedConvPass

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        try:
            groups, _ = klass._get_groups_and_transposed(op, _mapped_args(n, env))
        except Exception:  # stock would raise from the same call: let it
            return None
        return op if groups is None or groups == 1 else None

    return gate


def _decompose_tosa_unsupported_clamp(module: Any) -> Gate:
    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        # ``meta["val"]`` and two set lookups come before its target_ops guard.
        if "val" not in n.meta:
            return None  # stock raises KeyError there: let it
        return None if op in p.target_ops else op

    return gate


def _past_guard(reading: Callable[[Any, Any, Any, dict], bool]) -> Gate:
    """The gate of an override that begins with the ``target_ops`` guard and, for a target op, hands the node on
    where ``reading(pass, node, op, env)`` holds: what it reads is the override's own branches past the guard. A
    reading that raises refuses (stock would raise from the same expression: let it)."""

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        if op not in p.target_ops:
            return op
        try:
            return op if reading(p, n, op, env) else None
        except Exception:
            return None

    return gate


def _decompose_gelu(module: Any) -> Gate:
    # A quantized GELU is handed on (a TABLE op later); a float one is decomposed.
    return _past_guard(lambda p, n, op, env: p._is_quantized_meta(n.meta))


def _decompose_permute_for_u55(module: Any) -> Gate:
    def reading(p: Any, n: Any, op: Any, env: dict) -> bool:
        # The branches before its exact (Vela) check: not U55, or a shape under the worst-case bound.
        if not module.get_context_spec().is_U55_subset:
            return True
        args = _mapped_args(n, env)
        data = args[0].data
        rank = data.ndim
        tuple(dim % rank for dim in args[1])  # stock computes the permutation before the checks
        return not p._violates_u55_worst_case_constraint(data.shape)

    return _past_guard(reading)


def _rewrite_high_rank_singleton_permute(module: Any) -> Gate:
    def reading(p: Any, n: Any, op: Any, env: dict) -> bool:
        # Its branches up to the rank test: anything of rank 4 or less is handed on.
        args = _mapped_args(n, env)
        meta = n.meta
        if len(args) < 2 or not hasattr(args[0], "data") or "val" not in meta or not hasattr(meta["val"], "shape"):
            return True
        if p._extract_permutation(args[1]) is None:
            return True
        rank = len(list(args[0].data.shape))
        return rank <= 4 or len(list(meta["val"].shape)) != rank

    return _past_guard(reading)


def _insert_data_layout_casts(module: Any) -> Gate:
    import torch

    def reading(p: Any, n: Any, op: Any, env: dict) -> bool:
        # A dtype the TOSA profile supports is handed on; a cast is inserted otherwise.
        args = _mapped_args(n, env)
        if op in p._concat_ops:
            dtypes = [arg.data.dtype for arg in args[0]]
            sizes = [dtype.itemsize for dtype in dtypes]
            dtype = dtypes[sizes.index(max(sizes))]
        else:
            dtype = args[0].data.dtype
        spec = module.get_context_spec()
        integer = not dtype.is_floating_point and dtype != torch.bool
        if integer and not spec.support_integer():
            return False
        return not (dtype.is_floating_point and not spec.support_float())

    return _past_guard(reading)


def _insert_dynamic_padding(module: Any) -> Gate:
    tosa = module.exir_ops.backend.tosa

    def reading(p: Any, n: Any, op: Any, env: dict) -> bool:
        # Static padding is handed on; a PAD op is inserted before a dynamic one.
        index = 3 if op == tosa.MAX_POOL2D.default else 5 if op == tosa.AVG_POOL2D.default else 4
        return not p._is_dynamic_padding(_mapped_args(n, env)[index])

    return _past_guard(reading)


def _remove_noop(module: Any) -> Gate:
    import torch

    edge, tosa = module.exir_ops.edge.aten, module.exir_ops.backend.tosa
    upsample = (edge.upsample_bilinear2d.vec, edge.upsample_nearest2d.vec)

    def reading(p: Any, n: Any, op: Any, env: dict) -> bool:
        # Every branch that ends in the base call hands the node on; one that returns an input removes it.
        args = _mapped_args(n, env)
        if op in p._single_input_concat_ops:
            return not (isinstance(args[0], (list, tuple)) and len(args[0]) == 1)
        if op in upsample:
            scales = args[3] if op == edge.upsample_bilinear2d.vec else args[2]
            return not (isinstance(scales, (list, tuple)) and len(scales) == 2 and all(
                type(scale) in (int, float) and scale == 1.0 for scale in scales))
        if op == tosa.PAD.default:
            padding = p._get_static_shape(args[1])
            return not (padding is not None and len(padding) == 2 * len(args[0].data.shape) and all(
                value == 0 for value in padding))
        if op == tosa.SLICE.default:
            starts, sizes = p._get_static_shape(args[1]), p._get_static_shape(args[2])
            shape = p._get_static_shape(args[0].data.shape)
            return not (starts is not None and sizes is not None and shape is not None and (
                starts == (0,) * len(shape) and sizes == shape))
        input_dtype = args[0].data.dtype
        kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
        return input_dtype != kwargs.get("dtype", input_dtype)

    return _past_guard(reading)


# ReplaceScalarWithTensorArgPass.call_operator, which ReplaceScalarWithTensorByProfilePass
# reaches through ArmPass (its MRO: ByProfile, ArmPass, ArgPass, ExportPass): its
# pass-through is ``op not in self.scalar_to_tensor_ops``.
_SCALAR_ARG_PASS_DIGEST = "77d6ea19ff1c96177e9886627211f4ad338943356c42837306ef218f457e3076"


def _scalar_with_tensor_by_profile(module: Any) -> Gate:
    arg_pass = module.ReplaceScalarWithTensorArgPass
    if source_digest(arg_pass.__dict__["call_operator"]) != _SCALAR_ARG_PASS_DIGEST:
        return lambda p, n, op, env: None

    def gate(p: Any, n: Any, op: Any, env: dict) -> Any:
        if p.is_tfa_pass and op in module._preserve_in_tfa:
            return op  # ExportPass.call_operator, directly
        try:  # the profile check stock makes first, raising where it raises
            tosa_spec = module.get_context_spec()
            included_ops: dict = {}
            if tosa_spec.support_integer():
                included_ops |= module._int_profile_ops
            if tosa_spec.support_float():
                included_ops |= module._fp_profile_ops
        except Exception:
            return None
        if included_ops == {}:
            return None
        # Every branch that follows ends in ArmPass.call_operator (whose own special ops
        # fastcopy never copies) or ExportPass.call_operator, except the replacement of
        # an op in scalar_to_tensor_ops by ReplaceScalarWithTensorArgPass.
        return None if op in p.scalar_to_tensor_ops else op

    return gate


# (module, class) -> (sha256 of the class's call_operator source, gate factory given the module)
REGISTRY: dict[tuple[str, str], tuple[str, Callable[[Any], Gate]]] = {
    ("executorch.exir.passes.normalize_transpose_pass", "NormalizeTransposePass"): (
        "15582fd1c7803f6ac268a67f900ba446f4b71361dd14e0676a283d73fb041414",
        _normalize_transpose,
    ),
    ("executorch.exir.passes.replace_broken_ops_with_function_ops_pass", "ReplaceBrokenOpsWithFunctionalOpsPass"): (
        "003ef8cf927c5270b34d475c73b1a88e3f702dea9681d792b63336b8e318ee6b",
        _replace_broken_ops,
    ),
    ("executorch.exir.passes.memory_format_ops_pass", "MemoryFormatOpsPass"): (
        "69781c022ffac19fa8a99171e23558fd178438ae6535238834635d1ca2f1b155",
        _memory_format_ops,
    ),
    ("executorch.exir.passes.remove_mixed_type_operators", "RemoveMixedTypeOperators"): (
        "c93ec8a5e72fd3f0563f3ac036c9ecb4c78697c13a1c0f0774d7e553a30d0544",
        _remove_mixed_type,
    ),
    ("executorch.exir.passes.legalize_portable_dim_order_pass", "LegalizePortableDimOrderPass"): (
        "0111c295203206c2d37a89df5baf2767cb1bc3b1c18f85e3929aa8078f0acabc",
        _legalize_dim_order,
    ),
    ("executorch.exir.passes.replace_aten_with_edge_pass", "OpReplacePass"): (
        "e82439bc829e476cd0781ee181d83d5719a55fc2adfae27dc633ac48ea0653b1",
        _op_replace,
    ),
    ("executorch.exir.passes.scalar_to_tensor_pass", "ScalarToTensorPass"): (
        "acecfcdbda6f6dbbbbfdee3bf04fc0ea91c6fdfa7300b7cd0844777cbeeed686",
        _scalar_to_tensor,
    ),
    ("executorch.exir.passes.sym_to_tensor_pass", "SymToTensorPass"): (
        "4bfe6e5ab93ebdd2fc1a85e5a2608d90ec6bdfde968128762815a87ca38a7d34",
        _sym_to_tensor,
    ),
    ("executorch.backends.arm._passes.symbolic_to_tosa_shape_pass", "SymbolicToTosaShapesPass"): (
        "6fb542a8eb608e901c9e50cc6c094d882757ebf6f978043fd072170b01cb735e",
        _symbolic_to_tosa_shapes,
    ),
    ("executorch.backends.arm._passes.replace_scalar_with_tensor_pass", "ReplaceScalarWithTensorByProfilePass"): (
        "61f85246d0e0ac29b6de541a0c16b5e52b5d571cf9489b222c47bdf290f46adc",
        _scalar_with_tensor_by_profile,
    ),
    ("executorch.backends.arm._passes.decompose_grouped_conv_pass", "DecomposeGroupedConvPass"): (
        "0eda31ef79c8f84e07408afd05d18714b0a64b50a05bd726148db106b11c8d17",
        _decompose_grouped_conv,
    ),
    ("executorch.backends.arm._passes.decompose_tosa_unsupported_clamp_pass", "DecomposeTOSAUnsupportedClampPass"): (
        "c76294f4dec7e8953eb6638d379a49769ad3315f32fe0c8ee55156e1374feb16",
        _decompose_tosa_unsupported_clamp,
    ),
    ("executorch.backends.arm._passes.decompose_gelu_pass", "DecomposeGeluPass"): (
        "e5a1b201a9ae6e9bd2bc562145854b3a1d73a99aa7574d240cf6ca9b305a21e8",
        _decompose_gelu),
    ("executorch.backends.arm._passes.decompose_permute_for_u55_pass", "DecomposePermuteForU55Pass"): (
        "c6f338bd8c29b625d5d17c2d910e7f579257754794a7b90998b8b5427c08b144",
        _decompose_permute_for_u55),
    ("executorch.backends.arm._passes.rewrite_high_rank_singleton_permute_pass", "RewriteHighRankSingletonPermutePass"): (
        "1ecf2b2ab636f0cd53ef544090dba073f5fbf797cb126afc72bbb00c2b2f5640",
        _rewrite_high_rank_singleton_permute),
    ("executorch.backends.arm._passes.insert_data_layout_casts_pass", "InsertDataLayoutCastsPass"): (
        "99077442de988833b8c103bafb178626c162318d8e1badc89a461e1ac2acd2f7",
        _insert_data_layout_casts),
    ("executorch.backends.arm._passes.insert_dynamic_padding", "InsertDynamicPaddingPass"): (
        "5f514b8b766fac230bf12b15821342f20ae6df7805612f4101941d8f0d39efd9",
        _insert_dynamic_padding),
    ("executorch.backends.arm._passes.remove_noop_pass", "RemoveNoopPass"): (
        "c064d3232d6e3acaebe9ec6525f368dd906c9542228ac8484668d4a5bc6d3d2f",
        _remove_noop),
}

# Classes whose ``call_operator`` sits after ArmPass in a declared class's MRO
# (reached through ``ArmPass.call_operator``'s ``super()``), which that
# class's gate reads and pins too.
_COVERS: dict[tuple[str, str], frozenset[tuple[str, str]]] = {
    ("executorch.backends.arm._passes.replace_scalar_with_tensor_pass", "ReplaceScalarWithTensorByProfilePass"): frozenset(
        {("executorch.backends.transforms.replace_scalar_with_tensor", "ReplaceScalarWithTensorArgPass")}
    ),
}


def covered_by(klass: type) -> frozenset[tuple[str, str]]:
    """(module, qualname) of the later overrides ``klass``'s declared gate covers."""
    return _COVERS.get((klass.__module__, klass.__qualname__), frozenset())


# Functions a gate's reading also depends on, pinned with every entry: the
# argument walk of ``map_args`` and the edge-op mapping of OpReplacePass.
_SHARED_SOURCES = (
    ("executorch.exir.pass_base", "map_args"),
    ("executorch.exir.passes.replace_aten_with_edge_pass", "aten_to_edge"),
    ("executorch.exir.passes.replace_aten_with_edge_pass", "should_lower_to_edge"),
)
SHARED_DIGEST = "cdcd9edb02137707cada1cc83c87ddcc2ecf67adf82d38bbe4d8fdba35f90c97"


@functools.lru_cache(maxsize=None)
def shared_digest() -> str | None:
    """Digest of ``_SHARED_SOURCES`` as installed."""
    import importlib

    return source_digest(*(getattr(importlib.import_module(m), name) for m, name in _SHARED_SOURCES))


def gate_for(klass: type) -> Gate | None:
    """The declared gate of ``klass.call_operator``, if its source (and the shared ones) are the ones read."""
    entry = REGISTRY.get((klass.__module__, klass.__qualname__))
    fn = klass.__dict__.get("call_operator")
    if entry is None or fn is None:
        return None
    pinned, factory = entry
    if source_digest(fn) != pinned or shared_digest() != SHARED_DIGEST:
        return None
    import sys

    return factory(sys.modules[klass.__module__])
