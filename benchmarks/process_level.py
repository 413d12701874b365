"""Whole commands as a shell sees them: the stock script in a new process, `lowercache lower --no-server`, and
`lowercache lower` through a warm server, for cold, warm, one block edited and weights only.

    python benchmarks/process_level.py [tiny_cnn,mobilenet_v2] [ethos-u55-128] [repeats]

Each cell is the wall time of one command (the minimum over the repeats), from fork to exit, as `time` in a
shell would report it. The model is a file whose factory builds a benchmark model (lowercache/bench/models.py);
an edit rewrites the file (``EDIT = "structure"``: the edited block's first ReLU removed; ``"weights"``: its
weights re-initialised). Every .pte is compared with the stock script's for the same model. Direct mode is off
(LOWERCACHE_DIRECT=0): this measures the server and the in-process path. The server is started once per repeat
(its start-up is reported separately) in a private socket directory and stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = 'from lowercache.bench import models\n\nEDIT = {edit!r}\n\n\ndef model():\n    return models.MODELS[{name!r}](edit=EDIT)\n'
SCENARIOS = (("cold", None), ("warm", None), ("one block edited", "structure"), ("weights only", "weights"))
MODES = ("stock script", "lowercache --no-server", "lowercache, warm server")


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr[-2000:]}")
    return seconds


def one_repeat(name: str, target: str, root: Path) -> tuple[dict[tuple[str, str], float], float, bool]:
    """Every mode through every scenario, in fresh caches; (cell -> seconds, server start seconds, all bytes equal)."""
    project = root / "project"
    project.mkdir(parents=True)
    run = Path(tempfile.mkdtemp(prefix="lcb", dir="/tmp"))
    # a copy of the sources: an edit to the checkout meanwhile would make the server stale (and replaced, mid-figure)
    shutil.copytree(HERE.parent / "lowercache", root / "src" / "lowercache", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "LOWERCACHE_DIRECT": "0", "XDG_RUNTIME_DIR": str(run), "PYTHONPATH": str(root / "src")}
    lc = [sys.executable, "-m", "lowercache.cli"]
    cells: dict[tuple[str, str], float] = {}
    equal = True
    try:
        server_start = timed([*lc, "server", "start"], {**env, "LOWERCACHE_SERVER": "1"}, project)
        for scenario, edit in SCENARIOS:
            (project / "model.py").write_text(MODEL.format(edit=edit, name=name))
            stock = root / f"stock-{scenario}.pte"
            cells[("stock script", scenario)] = timed(
                [sys.executable, str(HERE / "stock_export.py"), "model.py:model", target, str(stock)], env, project
            )
            for mode, extra, cache in (
                ("lowercache --no-server", ["--no-server"], "cache-here"),
                ("lowercache, warm server", [], "cache-served"),
            ):
                out = root / f"{cache}-{scenario}"
                cells[(mode, scenario)] = timed(
                    [*lc, "lower", "model.py:model", "-t", target, "-o", str(out), *extra],
                    {**env, "LOWERCACHE_DIR": str(root / cache), "LOWERCACHE_SERVER": "1"},
                    project,
                )
                equal &= (out / "model.pte").read_bytes() == stock.read_bytes()
    finally:
        subprocess.run([*lc, "server", "stop"], env={**env, "LOWERCACHE_SERVER": "1"}, cwd=project, capture_output=True, timeout=300)
        shutil.rmtree(run, ignore_errors=True)
    return cells, server_start, equal


def main(names: str = "tiny_cnn,mobilenet_v2", target: str = "ethos-u55-128", repeats: str = "1") -> None:
    results = {}
    for name in names.split(","):
        best: dict[tuple[str, str], float] = {}
        starts, equal = [], True
        for _ in range(int(repeats)):
            with tempfile.TemporaryDirectory(prefix="lowercache-process-") as root:
                cells, start, same = one_repeat(name, target, Path(root))
            starts.append(start)
            equal &= same
            for key, seconds in cells.items():
                best[key] = min(seconds, best.get(key, seconds))
        results[name] = {"cells": {f"{m} | {s}": v for (m, s), v in best.items()}, "server_start": min(starts), "bytes_equal_stock": equal}
        print(f"\n{name}, {target}: wall seconds per command (server start-up, once: {min(starts):.1f} s; every .pte equal to stock's: {equal})")
        print("| scenario | " + " | ".join(MODES) + " | stock / server |")
        print("|---|" + "---|" * (len(MODES) + 1))
        for scenario, _ in SCENARIOS:
            row = [best[(m, scenario)] for m in MODES]
            print(f"| {scenario} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {row[0] / row[2]:.1f}x |")
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
