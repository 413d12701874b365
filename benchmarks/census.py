"""The pass census on the benchmark's models: which Arm passes act within a region.

    OMP_NUM_THREADS=1 python benchmarks/census.py --models tiny_cnn,residual_cnn,transformer_block \\
        --targets ethos-u55-128,tosa-fp --cache-dir /tmp/census-cache --out benchmarks/results/census

For each model and target it runs the census of ``pass_census.py`` (a cached
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
    import pass_census as census  # beside this script
    from lowercache.targets import resolve

    module, example_inputs = MODELS[model]()
    depth = len(EDITED_BLOCKS[model].split("."))
    session = Session(store)
    result = census.census(torch.export.export(module, tuple(example_inputs)), resolve(target_name), example_inputs, None, session, depth, model)
    result["step"] = session.records[-1].outcome
    return result


# Worst first: a pipeline entry's class over several models is the worst of its classes.
_ORDER = ("global", "local given facts", "names", "local", "not exercised")


def _gist(fact: str) -> str:
    """A verdict's fact without its node positions, for the summary table."""
    return fact.split(":")[0].split(" of node")[0].split(" (")[0]


def main(argv: list[str]) -> int:
    from lowercache.cache.store import Store
    import pass_census as census  # beside this script

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,residual_cnn,transformer_block")
    parser.add_argument("--targets", default="ethos-u55-128,tosa-fp")
    parser.add_argument("--cache-dir", default=None, help="store the censuses here (a rerun is a hit)")
    parser.add_argument("--out", default=None, help="directory for one JSON file per census")
    args = parser.parse_args(argv)
    store = Store(args.cache_dir) if args.cache_dir else None
    print(
        "| model | target | depth | regions | local | local given names only | local given other facts | global "
        "| not exercised | seconds of exercised passes: all / global | census step | per-pass run = stock |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    global_time: dict[str, list[float]] = collections.defaultdict(list)
    facts: dict[str, set[str]] = collections.defaultdict(set)
    worst: dict[str, dict[tuple[int, str], str]] = collections.defaultdict(dict)  # target -> pipeline entry -> class
    for model in args.models.split(","):
        for target in args.targets.split(","):
            result = _census(model, target, store)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"{model}-{target}.json"), "w") as f:
                    json.dump(result, f, indent=1, sort_keys=True)
            rows = result["passes"]
            count = collections.Counter(r["class"] for r in rows)
            names_only = sum(1 for r in rows if r["class"] == census.GIVEN_FACTS and all("name counter" in f for f in r["facts"]))
            exercised = [r for r in rows if r["class"] != census.UNEXERCISED]
            seconds = sum(r["seconds"] for r in exercised)
            global_seconds = sum(r["seconds"] for r in exercised if r["class"] == census.GLOBAL)
            print(
                f"| {model} | {target} | {result['depth']} | {len(result['regions'])} | {count[census.LOCAL]} | {names_only} | "
                f"{count[census.GIVEN_FACTS] - names_only} | {count[census.GLOBAL]} | {count[census.UNEXERCISED]} | "
                f"{seconds:.2f} / {global_seconds:.2f} | {result['step']} | {result['faithful']} |"
            )
            for row in rows:
                entry = (row["index"], row["pass"])
                only_names = row["class"] == census.GIVEN_FACTS and all("name counter" in f for f in row["facts"])
                known = worst[target].get(entry, census.UNEXERCISED)
                worst[target][entry] = min(known, "names" if only_names else row["class"], key=_ORDER.index)
                if row["class"] == census.GLOBAL:
                    global_time[f"{row['pass']} ({target})"].append(row["seconds"])
                    facts[f"{row['pass']} ({target})"].update(_gist(f) for v in row["regions"].values() if v["class"] == census.GLOBAL for f in v["facts"])
    print()
    print("| global pass (target) | pipeline entries over the models | seconds on the whole graph, summed | what differed in its global regions |")
    print("|---|---|---|---|")
    for name, secs in sorted(global_time.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(secs)} | {sum(secs):.3f} | {'; '.join(sorted(facts[name]))[:200]} |")
    print()
    print("| target | pipeline entries | local | local given names only | local given other facts | global | not exercised by any model |")
    print("|---|---|---|---|---|---|---|")
    for target, entries in worst.items():
        count = collections.Counter(entries.values())
        print(
            f"| {target} | {len(entries)} | {count[census.LOCAL]} | {count['names']} | {count[census.GIVEN_FACTS]} | "
            f"{count[census.GLOBAL]} | {count[census.UNEXERCISED]} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
