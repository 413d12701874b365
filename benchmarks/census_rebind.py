"""The census of rebind's exactness: many weights-only edits lowered with ``rebind`` on, each .pte compared with stock's.

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 19 python benchmarks/census_rebind.py --work DIR            # run (resumes)
    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 19 python benchmarks/census_rebind.py --work DIR --max-minutes 60
    PYTHONPATH=. python benchmarks/census_rebind.py --work DIR --report                                 # counts only

``rebind`` stays opt-in until this says it is exact (issue 54): at least 200
weights edits (retrained checkpoints, one block's weights, fine-tuned heads;
``lowercache/bench/weights.py``) across the benchmark's models and three
targets, every .pte equal to the one stock ExecuTorch makes.

The plan is every (model, target, kind, seed) of ``--models``, ``--targets``,
``--kinds`` and ``--seeds``, taken round-robin over models and targets so a
partial run covers all of them. For each model and target, the base model is
lowered once into a cache of its own under ``--work`` (recording the
templates); each edit is then lowered into that cache with
``LOWERCACHE_SPEEDUPS=all,rebind``, and stock's .pte is made in the same
process with none of lowercache's patches on. One JSON line per edit goes to
``DIR/results.jsonl``: whether the ``edge`` step served it, whether the
bytes are equal, and the seconds of each. A run skips the edits already
there, so it can stop at any time (``--max-minutes``, Ctrl-C) and go on
later. A model whose stock lowering puts several partitions in another
order than discovery order (``lowering/partitionorder.py``) is reported
``order``, not compared.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
from typing import Any, Iterator

DEFAULT_MODELS = "tiny_cnn,residual_cnn,transformer_block,convnext,mobilenet_v2,resnet"
DEFAULT_TARGETS = "tosa-int,ethos-u55-128,ethos-u85-256"
# Seeds per model: the small models are cheap, the large ones are not. 6 x 9 x 3 + 3 x 9 x 3 = 243 edits.
DEFAULT_SEEDS = {"tiny_cnn": 6, "residual_cnn": 6, "transformer_block": 6}
LARGE_SEEDS = 3


def plan(models: list[str], targets: list[str], kinds: list[str], seeds: dict[str, int]) -> list[tuple[str, str, str, int]]:
    """Every edit, round-robin: seed by seed, kind by kind, over all models and targets."""
    most = max(seeds.get(m, LARGE_SEEDS) for m in models)
    out = []
    for seed in range(1, most + 1):
        for kind in kinds:
            for model in models:
                if seed <= seeds.get(model, LARGE_SEEDS):
                    out.extend((model, target, kind, seed) for target in targets)
    return out


def _done(path: str) -> set[tuple[str, str, str, int]]:
    found = set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                    found.add((r["model"], r["target"], r["kind"], r["seed"]))
                except (ValueError, KeyError):
                    continue  # a line cut short by a stopped run
    return found


@contextlib.contextmanager
def _speedups(text: str) -> Iterator[None]:
    before = os.environ.get("LOWERCACHE_SPEEDUPS")
    os.environ["LOWERCACHE_SPEEDUPS"] = text
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOWERCACHE_SPEEDUPS")
        else:
            os.environ["LOWERCACHE_SPEEDUPS"] = before


def stock(module: Any, example: Any, target: str) -> bytes | None:
    """Stock's .pte, in this process, no lowercache patch on; None if its partitions went in another order."""
    from lowercache.lowering import flow, partitionorder
    from lowercache.targets import resolve

    orders: list[list[str]] = []
    pte = flow.run_stock(flow.export(module, example), resolve(target), tuple(example), [tuple(example)], partition_orders=orders)
    return bytes(pte) if all(partitionorder.is_discovery_order(o) for o in orders) else None


def one(work: str, model: str, target: str, kind: str, seed: int) -> dict[str, Any]:
    from lowercache import api
    from lowercache.bench import weights

    cache = os.path.join(work, "caches", f"{model}-{target}")
    with _speedups("all,rebind"):
        if not os.path.isdir(cache):
            base, example = weights.MODELS[model]()
            api.lower(base, example, target=target, cache_dir=cache)
        edited, example = weights.edited(model, kind, seed)
        start = time.perf_counter()
        artifacts = api.lower(edited, example, target=target, cache_dir=cache)
        seconds = time.perf_counter() - start
    edge = [r for r in artifacts.records if r["kind"] == "edge"]
    start = time.perf_counter()
    reference = stock(edited, example, target)
    stock_seconds = time.perf_counter() - start
    return {
        "model": model, "target": target, "kind": kind, "seed": seed,
        "edge": edge[-1]["outcome"] if edge else "none", "note": edge[-1]["note"] if edge else "",
        "equal": None if reference is None else artifacts.pte == reference,
        "order": reference is None, "seconds": round(seconds, 2), "stock_seconds": round(stock_seconds, 2),
    }


def report(path: str) -> str:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    by = collections.defaultdict(collections.Counter)
    for r in rows:
        key = (r["model"], r["target"])
        by[key]["edits"] += 1
        by[key]["served"] += r["edge"] == "hit"
        by[key]["equal"] += r["equal"] is True
        by[key]["different"] += r["equal"] is False
        by[key]["order"] += bool(r["order"])
    lines = ["| model | target | edits | served by the edge template | .pte equal to stock | different | not compared (order) |",
             "|---|---|---|---|---|---|---|"]
    total: collections.Counter = collections.Counter()
    for (model, target), c in sorted(by.items()):
        total.update(c)
        lines.append(f"| {model} | {target} | {c['edits']} | {c['served']} | {c['equal']} | {c['different']} | {c['order']} |")
    lines.append(f"| **all** | | {total['edits']} | {total['served']} | {total['equal']} | {total['different']} | {total['order']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="directory for the caches and results.jsonl (resumed)")
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--targets", default=DEFAULT_TARGETS)
    parser.add_argument("--kinds", default="retrained,block,head")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per model (default: 6 small, 3 large)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop starting new edits after this long")
    parser.add_argument("--report", action="store_true", help="print the counts of what is in results.jsonl, run nothing")
    args = parser.parse_args(argv)
    results = os.path.join(args.work, "results.jsonl")
    if args.report:
        print(report(results))
        return 0
    os.makedirs(args.work, exist_ok=True)
    models = args.models.split(",")
    seeds = {m: args.seeds for m in models} if args.seeds else DEFAULT_SEEDS
    todo = [e for e in plan(models, args.targets.split(","), args.kinds.split(","), seeds) if e not in _done(results)]
    started = time.monotonic()
    for edit in todo:
        if args.max_minutes is not None and time.monotonic() - started > 60 * args.max_minutes:
            break
        with contextlib.redirect_stdout(sys.stderr):  # Vela prints its summary
            row = one(args.work, *edit)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
