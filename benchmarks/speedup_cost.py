"""CPU time of a whole uncached lowering with one speed-up switched off and on, alternating, in one process.

    OMP_NUM_THREADS=1 python benchmarks/speedup_cost.py --speedup retraceskip [--model deit_tiny]
        [--target ethos-u55-128] [--rounds 3]

After one warm-up pair, each round lowers the model (seeded weights, ``use_cache=False``) with
``all,-NAME`` and then with ``all``, and prints both CPU times (``time.process_time``) and whether the
two ``.pte`` are equal; the last line gives the medians and their ratio. Time it on a quiet machine:
the pair shares the process, so the ratio holds better than the seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speedup", required=True)
    parser.add_argument("--model", default="deit_tiny")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import lowercache
    from lowercache.bench import models, passgraphs
    from lowercache.speedups import registry

    if args.speedup not in registry.NAMES:
        parser.error(f"unknown speed-up {args.speedup!r}")
    module, example = models.MODELS[args.model]()
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for index in range(args.rounds + 1):
        ptes = []
        for label, speedups in (("off", f"all,-{args.speedup}"), ("on", "all")):
            start = time.process_time()
            with contextlib.redirect_stdout(io.StringIO()):  # Vela's summary
                artifacts = passgraphs.lowered_with(
                    speedups, lambda: lowercache.lower(module, example, target=args.target, use_cache=False)
                )
            cpu = time.process_time() - start
            ptes.append(artifacts.pte)
            if index:
                seconds[label].append(cpu)
            print(f"{args.model} {args.target} {'warm-up' if index == 0 else f'round {index}'} {args.speedup} "
                  f"{label:3s} CPU {cpu:6.2f} s", flush=True)
        print(f"  .pte equal: {ptes[0] == ptes[1]}", flush=True)
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    print(f"median CPU: {args.speedup} off {off:.2f} s, on {on:.2f} s, off/on {off / on:.3f}", flush=True)


if __name__ == "__main__":
    main()
