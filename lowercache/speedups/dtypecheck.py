"""ExecuTorch's edge-dialect dtype check, skipped on a graph of the very objects that passed it, since the check reads only those objects and changes nothing.

Why it is exact, and figures: docs/speedups.md#dtypecheck.
"""

from __future__ import annotations

from typing import Any, Callable

from . import retrace
from .patching import AttributePatch, Patch

_MISSING = object()
_REMEMBERED = 8  # passed graphs kept (a lowering has a few distinct ones at a time)
_passed: list[list[tuple]] = []
_stats = {"checked": 0, "skipped": 0}


def _fingerprint(gm: Any) -> list[tuple] | None:
    """What the check reads of ``gm``, as objects compared by identity; None if not plain."""
    mode = _verifier_module()[0]._detect_fake_mode_from_gm(gm)
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is not None and shape_env.var_to_range:  # any symbol, backed or not
        return None  # symbolic shapes: running the graph could add guards, so it always runs
    rows = []
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            return None
        attr = _MISSING
        if node.op == "get_attr":
            attr = getattr(gm, str(node.target), _MISSING)
        rows.append((node, node.op, node.target, node.args, node.kwargs, node.meta.get("val", _MISSING), attr))
    return rows


def _same(a: list[tuple], b: list[tuple]) -> bool:
    # Compared element by element by identity: no __eq__ of tensors or nodes runs.
    return len(a) == len(b) and all(len(x) == len(y) and all(p is q for p, q in zip(x, y)) for x, y in zip(a, b))


def _check(gm: Any) -> None:
    original: Callable[[Any], None] = _attribute.originals[_verifier_module()[0]]
    rows = _fingerprint(gm)
    if rows is not None and any(_same(rows, seen) for seen in _passed):
        _stats["skipped"] += 1
        return
    original(gm)  # raises on a violation: nothing is remembered then
    _stats["checked"] += 1
    if rows is not None:
        _passed.append(rows)
        del _passed[:-_REMEMBERED]


def _verifier_module() -> list[Any]:
    import executorch.exir.verification.verifier as verifier

    return [verifier]


def stats() -> dict[str, int]:
    """Checks run and skipped since the process started."""
    return dict(_stats)


def _reusing_validator() -> type:
    """ExecuTorch's ``EdgeOpArgValidator`` with its op calls (its ``super().call_function``) reusing values."""
    import torch
    from executorch.exir.verification.arg_validator import EdgeOpArgValidator

    class _Reusing(torch.fx.Interpreter):
        @property
        def fake_tensor_mode(self) -> Any:
            """The mode the check runs under (the only one on the dispatch stack)."""
            if torch._C._len_torch_dispatch_stack() != 1:
                return None
            return torch._C._get_dispatch_stack_at(0)

        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            return retrace.reuse_or_dispatch(self, self.node, target, args, kwargs, super().call_function)

    class Validator(EdgeOpArgValidator, _Reusing):  # MRO: EdgeOpArgValidator's super() is _Reusing
        pass

    return Validator


_validators: dict[str, type] = {}


def _enable() -> None:
    verifier = _verifier_module()[0]
    if "reusing" not in _validators:
        _validators["reusing"] = _reusing_validator()
    _validators["stock"] = verifier.EdgeOpArgValidator
    verifier.EdgeOpArgValidator = _validators["reusing"]
    _attribute.enable()


def _disable() -> None:
    _attribute.disable()
    _verifier_module()[0].EdgeOpArgValidator = _validators.pop("stock")
    _passed.clear()  # nothing kept alive after


_attribute = AttributePatch(_verifier_module, "_check_tensor_args_matching_op_allowed_dtype", _check)
_patch = Patch(_enable, _disable)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
