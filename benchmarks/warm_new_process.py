"""Warm lowering in a new process vs a stock lowering in a new process.

    OMP_NUM_THREADS=1 python benchmarks/warm_new_process.py [examples/mobilenet_v2.py:model] [ethos-u55-128]

Runs, each in its own Python process: the stock flow (export + lowercache.lowering.flow.run_stock,
no cache), then `lowercache lower` twice into a fresh cache. Prints each flow's seconds
(from inside the process, excluding interpreter start-up) and the wall-clock seconds.
"""

import json
import subprocess
import sys
import tempfile
import time

STOCK = """
import contextlib, io, time
from lowercache.lowering import flow, loading
from lowercache.lowering.targets import resolve
m = loading.load_model({model!r})
start = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    flow.run_stock(flow.export(m.module, m.example_inputs), resolve({target!r}), m.example_inputs, [m.example_inputs])
print(time.perf_counter() - start)
"""


def main(model: str = "examples/mobilenet_v2.py:model", target: str = "ethos-u55-128") -> None:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", STOCK.format(model=model, target=target)], capture_output=True, text=True, check=True)
    stock_flow, stock_wall = float(out.stdout.split()[-1]), time.perf_counter() - start
    with tempfile.TemporaryDirectory() as root:
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "lowercache.cli", "lower", model, "-t", target, "-o", f"{root}/out", "--cache-dir", f"{root}/cache"],
                capture_output=True, check=True,
            )
            wall = time.perf_counter() - start
            stages = json.load(open(f"{root}/out/manifest.json"))["stages"]
            runs.append((sum(stages.values()), wall, stages))
    warm_flow, warm_wall, stages = runs[1]
    print(f"stock: flow {stock_flow:.2f}s, wall {stock_wall:.2f}s")
    print(f"lowercache cold: flow {runs[0][0]:.2f}s, wall {runs[0][1]:.2f}s")
    print(f"lowercache warm: flow {warm_flow:.2f}s ({stages}), wall {warm_wall:.2f}s")
    print(f"warm ratio: flow {stock_flow / warm_flow:.1f}x, wall {stock_wall / warm_wall:.1f}x")


if __name__ == "__main__":
    main(*sys.argv[1:])
