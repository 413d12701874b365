"""Per-node cost of one pass retrace: stock vs lowercache's in-flow speed-ups, same process.

    OMP_NUM_THREADS=1 python benchmarks/retrace_cost.py [--model deit_tiny] [--repeat 15]

Most of a float lowering's TOSA step is ExportPass retraces of nodes a pass
leaves alone, so the cost of one such node is the figure per-node work moves.
Whole-flow timings vary by a second or more on a shared machine; this one
varies far less. It builds the model's edge program (seeded weights), then
retraces it again and again with an Arm pass that touches no op (the
``ArmPass`` base), alternating a stock retrace with one under ``arm.hooks()``
(every speed-up the flow turns on). It prints the median and best
microseconds per graph node for both, their ratio, and checks that both
retraces give the same nodes (op, name, target, arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

import torch


def _edge_graph(model: str) -> torch.fx.GraphModule:
    from executorch.exir import EdgeCompileConfig, to_edge

    from lowercache.bench.models import MODELS

    module, example_inputs = MODELS[model]()
    with contextlib.redirect_stdout(io.StringIO()):
        program = to_edge(torch.export.export(module, tuple(example_inputs)), compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return program.exported_program().graph_module


def _nodes(gm: torch.fx.GraphModule) -> list[tuple[str, str, str, str]]:
    return [(n.op, n.name, str(n.target), str(n.args)) for n in gm.graph.nodes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_tiny")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()

    from executorch.backends.arm._passes.arm_pass import ArmPass

    from lowercache.lowering import arm

    class LeavesAll(ArmPass):
        _passes_required_after: set = set()

    stock_gm = fast_gm = _edge_graph(args.model)
    nodes = len(stock_gm.graph.nodes)
    seconds: dict[str, list[float]] = {"stock": [], "lowercache": []}
    for i in range(args.repeat + 2):  # the first two retraces of each warm up (records, provenance)
        start = time.perf_counter()
        stock_gm = LeavesAll()(stock_gm).graph_module
        stock = time.perf_counter() - start
        with arm.hooks():
            start = time.perf_counter()
            fast_gm = LeavesAll()(fast_gm).graph_module
            fast = time.perf_counter() - start
        if i >= 2:
            seconds["stock"].append(stock)
            seconds["lowercache"].append(fast)
    if _nodes(stock_gm) != _nodes(fast_gm):
        raise SystemExit("the two retraces gave different graphs")
    per_node = {k: (statistics.median(v) / nodes * 1e6, min(v) / nodes * 1e6) for k, v in seconds.items()}
    print(f"{args.model}: {nodes} nodes, {args.repeat} retraces each")
    for key, (median, best) in per_node.items():
        print(f"  {key:10s} median {median:6.1f} us/node   best {best:6.1f} us/node")
    print(f"  ratio (stock / lowercache, medians): {per_node['stock'][0] / per_node['lowercache'][0]:.2f}x")


if __name__ == "__main__":
    main()
