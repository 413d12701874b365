"""Where a weights-only edit's lowering time goes, phase by phase, in one process.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/weights_edit.py --models mobilenet_v2,convnext --edits retrained,block,head
    OMP_NUM_THREADS=1 PYTHONPATH=. LOWERCACHE_SPEEDUPS=all,rebind python benchmarks/weights_edit.py ...
    ... --profile DIR    # and a cProfile file per edit, for shares under load

For each model: a warm-up lowering of ``tiny_cnn`` (as the warm server does),
the base model into an empty cache (``cold``), then each weights-only edit
(``lowercache/bench/weights.py``) into the same cache. Each lowering is split
into the stock flow's phases by timing the stock functions it calls (the
wrappers only read a clock):

- ``export``; quantization: ``fuse BN`` (``_fuse_conv_bn_`` and
  ``_fuse_linear_bn_``), ``annotation passes``, ``annotate``, ``observers``
  (``prepare``), ``calibrate``, ``convert``, ``re-export``;
- ``to_edge``: ``decompositions`` (the ``run_decompositions`` calls),
  ``edge program`` (the rest of ``_gen_edge_manager_for_partitioners``),
  ``partition``, the TOSA step (``TOSA passes`` and ``TOSA serialize``: the
  node visitors and the serializer), ``Vela``, and the rest of ``to_edge``;
- ``to_executorch``; ``rest`` (hashing, the cache, lowercache's own steps).

Every edit's ``.pte`` is compared with a stock lowering of the same model in
a child process (``bench/stockref.py``); the last column says whether they
are equal. Read the shares: the machine is shared, and seconds move.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

_timers: collections.Counter = collections.Counter()
_depth: list[str] = []


# Phases timed only inside another: torch.export calls run_decompositions too.
_INSIDE = {"decompositions": "edge program and decompositions"}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # code that checks who called it unwraps (the decompositions speed-up does)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if name in _depth or (name in _INSIDE and _INSIDE[name] not in _depth):  # re-entered, or outside its phase
            return fn(*args, **kwargs)
        _depth.append(name)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _timers[name] += time.perf_counter() - start
            _depth.pop()

    return wrapper


@contextlib.contextmanager
def _patched(owner: Any, name: str, phase: str) -> Iterator[None]:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    fn = original.__func__ if isinstance(original, staticmethod) else original
    wrapped = _timed(phase, fn)
    setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def timing() -> Iterator[None]:
    import executorch.backends.arm._passes.arm_pass_manager as apm
    import executorch.backends.arm.quantizer.arm_quantizer as quantizer_module
    import executorch.backends.arm.tosa.partitioner as partitioner_module
    import executorch.exir.program._program as program_module
    import torch
    import torchao.quantization.pt2e.quantize_pt2e as qpt2e

    from lowercache.lowering import reexport

    with contextlib.ExitStack() as stack:
        for owner, name, phase in (
            (qpt2e, "_fuse_conv_bn_", "fuse BN"),
            (qpt2e, "_fuse_linear_bn_", "fuse BN"),
            (apm.ArmPassManager, "transform_for_annotation_pipeline", "annotation passes"),
            (quantizer_module.TOSAQuantizer, "annotate", "annotate"),
            (qpt2e, "prepare", "observers"),
            (qpt2e, "convert_pt2e", "convert"),
            (reexport, "export", "re-export"),
            (torch.export.ExportedProgram, "run_decompositions", "decompositions"),
            (program_module, "_gen_edge_manager_for_partitioners", "edge program and decompositions"),
            (partitioner_module.TOSAPartitioner, "partition", "partition"),
            (apm.ArmPassManager, "transform_to_backend_pipeline", "TOSA passes"),
            (program_module, "to_edge_transform_and_lower", "to_edge"),
        ):
            stack.enter_context(_patched(owner, name, phase))
        yield


def phases(artifacts: Any, total: float) -> dict[str, float]:
    """The lowering's seconds per phase (``_timers`` since the last reset, and its step records)."""
    steps = collections.Counter()
    for record in artifacts.records:
        if record["kind"] in ("tosa", "vela"):
            steps[record["kind"]] += record["seconds"]
    stages = artifacts.stages
    out = {"export": stages.get("export", 0.0)}
    quantize = stages.get("quantize", 0.0)
    for name in ("fuse BN", "annotation passes", "annotate", "observers", "convert", "re-export"):
        out[name] = _timers[name]
    out["calibrate and the rest of quantize"] = quantize - sum(out[n] for n in ("fuse BN", "annotation passes", "annotate", "observers", "convert", "re-export"))
    out["decompositions"] = _timers["decompositions"]
    out["edge program"] = _timers["edge program and decompositions"] - _timers["decompositions"]
    out["partition"] = _timers["partition"]
    out["TOSA passes"] = _timers["TOSA passes"]
    out["TOSA serialize"] = max(steps["tosa"] - _timers["TOSA passes"], 0.0)
    out["Vela"] = steps["vela"]
    out["rest of to_edge"] = stages.get("to_edge", 0.0) - sum(out[n] for n in ("decompositions", "edge program", "partition", "TOSA passes", "TOSA serialize", "Vela"))
    out["to_executorch"] = stages.get("to_executorch", 0.0)
    out["rest"] = total - sum(out.values())
    out["total"] = total
    return out


def stock_pte(module: Any, example: Any, target: str) -> bytes | None:
    """Stock's .pte in this process (none of lowercache's patches is on outside its lowering); None when
    stock lowered its partitions in another order than discovery order (``lowering/partitionorder.py``)."""
    from lowercache.lowering import flow, partitionorder
    from lowercache.targets import resolve

    orders: list[list[str]] = []
    pte = flow.run_stock(flow.export(module, example), resolve(target), tuple(example), [tuple(example)], partition_orders=orders)
    return bytes(pte) if all(partitionorder.is_discovery_order(o) for o in orders) else None


def lower(module: Any, example: Any, target: str, cache: str, profile: str | None = None) -> tuple[Any, dict[str, float]]:
    """One lowering and its phases; with ``profile``, its cProfile statistics written to that file."""
    import cProfile

    from lowercache import api

    _timers.clear()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    artifacts = api.lower(module, example, target=target, cache_dir=cache)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return artifacts, phases(artifacts, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v2")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--edits", default="retrained,block,head")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-stock", action="store_true", help="do not compare with stock (faster)")
    parser.add_argument("--profile", default=None, help="directory for a cProfile file per edit (MODEL-KIND.prof)")
    args = parser.parse_args(argv)
    from lowercache.bench import models, weights

    rows = []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    with timing(), contextlib.redirect_stdout(sys.stderr):
        warm, example = models.tiny_cnn()
        cache = tempfile.mkdtemp(prefix="weights-edit-")
        lower(warm, example, args.target, cache)
        for name in args.models.split(","):
            module, example = weights.MODELS[name]()
            _, cold = lower(module, example, args.target, cache)
            rows.append({"model": name, "lowering": "cold", **cold})
            for kind in args.edits.split(","):
                edited, example = weights.edited(name, kind, args.seed)
                profile = os.path.join(args.profile, f"{name}-{kind}.prof") if args.profile else None
                artifacts, edit = lower(edited, example, args.target, cache, profile)
                same = None
                if not args.no_stock:
                    reference = stock_pte(edited, example, args.target)
                    same = None if reference is None else artifacts.pte == reference
                served = [r for r in artifacts.records if r["kind"] == "edge"]
                rows.append({"model": name, "lowering": kind, **edit, "equal to stock": same,
                             "rebind": served[-1]["outcome"] if served else ""})
    columns = list(dict.fromkeys(k for row in rows for k in row if k not in ("model", "lowering")))
    print("| model | lowering | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row.get(c):.2f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        print(f"| {row['model']} | {row['lowering']} | " + " | ".join(cells) + " |")
    print(json.dumps(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
