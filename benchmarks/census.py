"""The pass census on the benchmark's models: which Arm passes act within a region.

    OMP_NUM_THREADS=1 python benchmarks/census.py --models tiny_cnn,residual_cnn,transformer_block \\
        --targets ethos-u55-128,tosa-fp --cache-dir /tmp/census-cache --out benchmarks/results/census

For each model and target it runs ``lowercache.lowering.census`` (a cached
step: a second run with the same cache directory is a hit) with regions cut at
the depth of the block the benchmark's edits touch, prints one markdown table
of classes and one of the global passes by time, and writes each census as
JSON under ``--out``. The method is described in ``docs/regions.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch


def _census(model: str, target_name: str, store: object) -> dict:
    from lowercache.bench.models import EDITED_BLOCKS, MODELS
    from lowercache.cache.steps import Session
    from lowercache.lowering import census
    from lowercache.lowering.targets import resolve

    module, example_inputs = MODELS[model]()
    depth = len(EDITED_BLOCKS[model].split("."))
    session = Session(store)
    result = census.census(torch.export.export(module, tuple(example_inputs)), resolve(target_name), example_inputs, None, session, depth, model)
    result["step"] = session.records[-1].outcome
    return result


def main(argv: list[str]) -> int:
    from lowercache.cache.store import Store
    from lowercache.lowering import census

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,residual_cnn,transformer_block")
    parser.add_argument("--targets", default="ethos-u55-128,tosa-fp")
    parser.add_argument("--cache-dir", default=None, help="store the censuses here (a rerun is a hit)")
    parser.add_argument("--out", default=None, help="directory for one JSON file per census")
    args = parser.parse_args(argv)
    store = Store(args.cache_dir) if args.cache_dir else None
    print("| model | target | depth | regions | local | local given facts | global | not exercised | census step | stock = per-pass split |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    global_time: dict[str, list[float]] = collections.defaultdict(list)
    facts: dict[str, set[str]] = collections.defaultdict(set)
    for model in args.models.split(","):
        for target in args.targets.split(","):
            result = _census(model, target, store)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"{model}-{target}.json"), "w") as f:
                    json.dump(result, f, indent=1, sort_keys=True)
            s = census.summary(result)
            c = s["counts"]
            print(
                f"| {model} | {target} | {result['depth']} | {len(result['regions'])} | {c[census.LOCAL]} | "
                f"{c[census.GIVEN_FACTS]} | {c[census.GLOBAL]} | {c[census.UNEXERCISED]} | {result['step']} | {result['faithful']} |"
            )
            for row in result["passes"]:
                if row["class"] == census.GLOBAL:
                    global_time[f"{row['pass']} ({target})"].append(row["seconds"])
                    facts[f"{row['pass']} ({target})"].update(f.split(":")[0] for f in row["facts"] if "name counter" not in f)
    print()
    print("| global pass (target) | occurrences | seconds on the whole graph, summed | what differed |")
    print("|---|---|---|---|")
    for name, secs in sorted(global_time.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(secs)} | {sum(secs):.3f} | {'; '.join(sorted(facts[name]))[:160]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
