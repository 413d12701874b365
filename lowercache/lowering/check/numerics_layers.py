"""Per layer (``lower --check=layers``): where the error enters, named by the user's module path.

The reference model's intermediate tensors are raw INT8 without their
quantization parameters, and a partition's TOSA has no module names. So the
comparison is made one level up, where both are known exactly: the quantized
program (the q/dq graph the Arm quantizer makes, the program the partitioner
lowers) run in torch, against the float program, at each module's boundary.
Both come from one export, so their nodes carry the same ``nn_module_stack``:
a module's boundary is the last operator inside it, and in the quantized
program the quantize/dequantize pair right after it when its output is
re-quantized there (the value the next operator receives); a module whose
output a batch norm reads has no row, as the quantizer folds the norm into
it. This measures the
quantized model's semantics at that boundary (weights and activations
rounded to their INT8 grids, arithmetic in float), not the TOSA integer
arithmetic and not the NPU: the whole program's outputs are the place for
those (``numerics.py``).

One cached step, ``layers``: keyed by the flow step's key (the float
program, target and toolchain, so the quantized program too), the inputs'
digest and the code of this module and of ``numerics.py`` (its figures).
Nothing here changes a lowered byte.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from ...cache.store import Entry
from .numerics import Unstored, figures, inputs_key
from .numerics_report import layers_parts, layers_section

_QUANTIZE = ("quantize_per_tensor", "quantize_per_channel")
_DEQUANTIZE = ("dequantize_per_tensor", "dequantize_per_channel")


def _op_name(node: Any) -> str:
    """``quantize_per_tensor`` for ``quantized_decomposed.quantize_per_tensor.default``; "" for anything else."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.split(".")[0]


def _requantized(node: Any) -> Any:
    """The dequantize of a quantize/dequantize pair that reads ``node``: what the next operator receives; else ``node``."""
    for user in node.users:
        if _op_name(user) in _QUANTIZE:
            for dq in user.users:
                if _op_name(dq) in _DEQUANTIZE:
                    return dq
    return node


def boundaries(graph: Any, requantized: bool) -> dict[str, Any]:
    """Each module path's boundary node: the last operator (in graph order) inside it, with ``requantized`` the
    dequantize after it when its output is re-quantized there. The root module (path "") is not a layer, nor a module
    whose output a batch norm reads (see ``_folded``)."""
    last: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op != "call_function" or _op_name(node) in _QUANTIZE + _DEQUANTIZE:
            continue
        for value in (node.meta.get("nn_module_stack") or {}).values():
            path = value[0] if isinstance(value, (tuple, list)) and value else None
            if isinstance(path, str) and path:
                last[path] = node
    return {path: _requantized(node) if requantized else node for path, node in last.items() if not _folded(node)}


def _folded(node: Any) -> bool:
    """A value a batch norm reads: the quantizer folds the norm into the operator before it (a convolution), so the
    quantized program has no such value to compare (the norm's output, at the enclosing module, it has)."""
    return any("batch_norm" in _op_name(user) for user in node.users)


def activations(program: Any, samples: Sequence[Sequence[Any]], requantized: bool) -> tuple[dict[str, list[Any]], list[str]]:
    """Each module boundary's tensor on every sample, and the paths in the order their boundaries run."""
    import torch
    from torch.fx import Interpreter

    module = program.module()
    found = boundaries(module.graph, requantized)
    order = {node: i for i, node in enumerate(module.graph.nodes)}
    paths = sorted(found, key=lambda p: (order[found[p]], -p.count("."), p))  # at one node, the inner module first
    wanted: dict[Any, list[str]] = {}
    for path, node in found.items():
        wanted.setdefault(node, []).append(path)
    values: dict[str, list[Any]] = {path: [] for path in paths}

    class Capture(Interpreter):
        def run_node(self, n: Any) -> Any:
            result = super().run_node(n)
            if n in wanted and isinstance(result, torch.Tensor) and result.is_floating_point():
                for path in wanted[n]:
                    values[path].append(result.detach().clone())
            return result

    with torch.no_grad():
        for sample in samples:
            Capture(module).run(*sample)
    return values, [p for p in paths if len(values[p]) == len(samples)]


def compute(float_program: Any, quantized_program: Any, samples: Sequence[Sequence[Any]]) -> Entry:
    """The step's entry: per module boundary both programs have, the quantized model's error against the float one."""
    reference, paths = activations(float_program, samples, requantized=False)
    quantized, found = activations(quantized_program, samples, requantized=True)
    rows = []
    for path in [p for p in found if p in set(paths)]:
        ref, got = reference[path], quantized[path]
        if any(r.shape != g.shape for r, g in zip(ref, got)):
            continue
        f = figures(ref, got)
        rows.append({"module": path, **{k: f[k] for k in ("snr_db", "max_abs", "mean_abs", "cosine", "shape")}})
    return Entry(meta={"samples": len(samples), "modules": rows})


def check(session: Any, flow_key: str | None, samples: Sequence[Sequence[Any]], float_program: Any,
          quantized_program: Callable[[], Any | None]) -> dict[str, Any]:
    """Run (or serve) the ``layers`` step; returns the numerics section's ``layers`` part.

    ``quantized_program()`` gives the quantized program (None: the target is
    not quantized); it is only called on a miss. ``flow_key`` None: the flow
    ran uncached, so this runs uncached too.
    """
    inputs = inputs_key(samples)
    parts = layers_parts(flow_key, inputs) if flow_key is not None and inputs is not None else None

    def run() -> Entry:
        try:
            program = quantized_program()
            if program is None:
                return Entry(meta={"samples": len(samples), "modules": [], "error": "the target is not quantized: no per-layer error to find"})
            return compute(float_program, program, samples)
        except Exception as e:  # never fails the lowering; said, not stored, so the next run tries again
            raise Unstored(Entry(meta={"samples": len(samples), "modules": [], "error": f"not compared: {type(e).__name__}: {e}"[:300]})) from None

    started = time.perf_counter()
    try:
        entry = session.run("layers", "numerics", parts, run)
    except Unstored as e:
        entry = e.entry
        session.note("layers", "numerics", "bypass", time.perf_counter() - started)
    return layers_section(entry.meta, parts)
