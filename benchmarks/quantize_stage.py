"""The quantization stage alone, stock vs lowercache, in one process (issue #5's figures).

    OMP_NUM_THREADS=1 python benchmarks/quantize_stage.py [--models mobilenet_v2,deit_tiny] [--target ethos-u55-128] [--scenarios cold,warm,weights]

For each model: the stage (prepare_pt2e, calibrate, convert_pt2e, re-export)
from the same exported program, stock (no lowercache code) and through
lowercache's ``quantize`` step, alternating, for three scenarios:

- cold: an empty cache (only observer work repeated within the stage is saved);
- warm: the same inputs again (the stage's own step hits; in a full
  ``lowercache lower`` the whole-flow step hits first and the stage does not
  run at all);
- weights: one block's weights re-initialised, the cache warmed with the base model.

Every lowercache result is checked against the stock one, once per
scenario: with ``--check pte`` both quantized programs are lowered and the
.pte bytes compared (minutes for DeiT); by default (``--check parts``) their
content digests (``hashing.program_parts``, what the flow step is keyed on)
are compared, so equal digests mean the rest of the flow is given equal input.
A program served from the cache (a ``quantize`` hit, or a ``reexport``
hit, whose filled template is rebuilt the same way) is compared with
stock's passed through the same stored form (tests/flow/test_quantize.py shows the stored form lowers to
stock's bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lowercache.lowering import arm, flow, quantize
from lowercache.cache.hashing import program_parts
from lowercache.bench.models import MODELS, calibration_samples
from lowercache.cache.steps import Session, activate
from lowercache.cache.store import Store
from lowercache.targets import resolve


def _pte(program: torch.export.ExportedProgram, target, spec) -> bytes:
    from executorch.exir import to_edge_transform_and_lower

    with contextlib.redirect_stdout(io.StringIO()):
        edge = to_edge_transform_and_lower(program, partitioner=[target.partitioner(spec)])
        return bytes(edge.to_executorch().buffer)


def _inputs(model: str, edit: str | None):
    module, example = MODELS[model](edit=edit)
    return flow.export(module, example), tuple(example), calibration_samples(example)


def stock(model: str, edit: str | None, target) -> tuple[float, torch.export.ExportedProgram, object]:
    program, example, calibration = _inputs(model, edit)
    spec = target.compile_spec()
    start = time.perf_counter()
    result = quantize.run_stock(program, target, spec, example, calibration)
    return time.perf_counter() - start, result, spec


def cached(model: str, edit: str | None, target, cache_dir: Path):
    program, example, calibration = _inputs(model, edit)
    store = Store(cache_dir)
    session = Session(store)
    spec = target.compile_spec()
    start = time.perf_counter()
    with arm.hooks(), activate(session):
        parts = quantize.quantize_parts(flow.flow_parts(program, target, example, calibration, store))
        result, spec = quantize.quantize(program, target, spec, example, calibration, parts, session)
    seconds = time.perf_counter() - start
    session.flush_counts()
    store.close()
    return seconds, result, spec, session.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v2,deit_tiny")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side and scenario (medians reported)")
    parser.add_argument("--scenarios", default="cold,warm,weights", help="comma-separated subset of cold,warm,weights")
    parser.add_argument("--check", choices=("parts", "pte"), default="parts", help="how results are compared with stock's")
    args = parser.parse_args()
    target = resolve(args.target)
    print(f"| model | scenario | stock s | lowercache s | ratio | steps (lowercache) | same as stock ({args.check}) |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        stock(model, None, target)  # warm-up: imports, first export
        for scenario in args.scenarios.split(","):
            times_stock, times_cached, checked = [], [], None
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory() as tmp:
                    cache_dir = Path(tmp)
                    edit = "weights" if scenario == "weights" else None
                    if scenario != "cold":
                        cached(model, None, target, cache_dir)  # fill the cache from the base model
                    s_seconds, s_program, s_spec = stock(model, edit, target)
                    c_seconds, c_program, c_spec, summary = cached(model, edit, target, cache_dir)
                    times_stock.append(s_seconds)
                    times_cached.append(c_seconds)
                    if checked is None and args.check == "pte":
                        checked = _pte(s_program, target, s_spec) == _pte(c_program, target, c_spec)
                    elif checked is None:
                        if summary.get("quantize", {}).get("hit") or summary.get("reexport", {}).get("hit"):
                            s_program = quantize.decode(quantize.encode(s_program, ""))  # stock's, in stored form
                        checked = program_parts(s_program) == program_parts(c_program)
            s, c = statistics.median(times_stock), statistics.median(times_cached)
            steps = {k: v for k, v in summary.items() if k in ("quantize", "reexport", "qparams")}
            print(f"| {model} | {scenario} | {s:.2f} | {c:.2f} | {s / c:.1f}x | {steps} | {checked} |", flush=True)


if __name__ == "__main__":
    main()
