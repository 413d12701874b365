"""Stock's .pte in discovery order: the reference when stock's own run used another order.

Stock ExecuTorch lowers multi-partition Arm models in an order set by the
string-hash seed (``partitionorder.py``); lowercache always uses discovery
order. When the benchmark's in-process stock run happened to use another
order, its bytes are a valid stock output but not the one lowercache aims
at, so the comparison is made against pure stock run in a fresh process
whose ``PYTHONHASHSEED`` makes the tag set iterate in discovery order (the
child checks the order it actually used).

Child entry: ``python -m lowercache.bench.stockref MODEL TARGET OUT [--edit E] [--custom-calibration]``,
MODEL a benchmark model name or a ``file.py:factory`` spec (no edit then).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from ..lowering import partitionorder

_SET_ORDER = "import sys; s = set(sys.argv[1:]); print(list(s) == sys.argv[1:])"


def seeds_for(tags: Sequence[str], limit: int = 400) -> list[int]:
    """Hash seeds under which a set of ``tags`` (in discovery order) iterates in that order."""
    found = []
    for seed in range(limit):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        out = subprocess.run([sys.executable, "-c", _SET_ORDER, *tags], env=env, capture_output=True, text=True)
        if out.stdout.strip() == "True":
            found.append(seed)
            if len(found) == 3:
                break
    return found


def reference(model: str, target: str, edit: str | None, custom_calibration: bool, tags: Sequence[str]) -> bytes | None:
    """Pure stock .pte lowered in discovery order in a child process; None when no seed gave that order."""
    tags = list(partitionorder.discovery_order(dict.fromkeys(tags)))
    for seed in seeds_for(tags):
        with tempfile.TemporaryDirectory(prefix="lowercache-stockref-") as tmp:
            out = Path(tmp) / "model.pte"
            cmd = [sys.executable, "-m", "lowercache.bench.stockref", model, target, str(out)]
            cmd += (["--edit", edit] if edit else []) + (["--custom-calibration"] if custom_calibration else [])
            env = {**os.environ, "PYTHONHASHSEED": str(seed)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"stock reference child failed: {done.stderr.strip().splitlines()[-1:]}")
            orders = json.loads(done.stdout.strip().splitlines()[-1])
            if all(partitionorder.is_discovery_order(order) for order in orders):
                return out.read_bytes()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from ..lowering import flow
    from .models import MODELS, scenario_calibration
    from ..targets import resolve

    parser = argparse.ArgumentParser(prog="python -m lowercache.bench.stockref")
    parser.add_argument("model")
    parser.add_argument("target")
    parser.add_argument("out", type=Path)
    parser.add_argument("--edit")
    parser.add_argument("--custom-calibration", action="store_true")
    args = parser.parse_args(argv)
    if args.model in MODELS:
        module, example = MODELS[args.model](edit=args.edit)
    else:
        from ..lowering.loading import load_model

        loaded = load_model(args.model)
        module, example = loaded.module, loaded.example_inputs
    calibration = scenario_calibration(example, args.custom_calibration) or [tuple(example)]
    orders: list[list[str]] = []
    with contextlib.redirect_stdout(io.StringIO()):
        program = flow.export(module, example)
        pte = flow.run_stock(program, resolve(args.target), tuple(example), calibration, partition_orders=orders)
    args.out.write_bytes(bytes(pte))
    print(json.dumps(orders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
