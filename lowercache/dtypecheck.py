"""ExecuTorch's edge-dialect dtype check, not repeated on a graph it has passed.

Every time an edge program is built or validated, ``EXIREdgeDialectVerifier``
runs ``_check_tensor_args_matching_op_allowed_dtype``: an interpreter that
executes the whole graph on fake tensors to compare each op's tensor dtypes
with its allowed ones. A lowering validates the same, unchanged graph
several times over (DeiT-tiny: 15 checks, 4 of them repeats of a 4,135-node
graph, about 0.5 s each).

The check reads the nodes in order (op, target, arguments), each node's
``val``, and the attributes ``get_attr`` nodes fetch; it passes or raises and
changes nothing. So a graph whose nodes are the very same objects, in the
same order, with the same (identical) targets, arguments, values and fetched
attributes as a graph that passed, passes again (values are FakeTensors,
whose dtype and shape are not changed in place): that call is skipped. The
memo holds the objects it compares until the lowering ends; graphs with
submodule or method calls, or symbolic shapes (whose run could add guards),
are always checked.
"""

from __future__ import annotations

from typing import Any, Callable

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


_attribute = AttributePatch(_verifier_module, "_check_tensor_args_matching_op_allowed_dtype", _check)
_patch = Patch(_attribute.enable, lambda: (_attribute.disable(), _passed.clear()))  # nothing kept alive after
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
