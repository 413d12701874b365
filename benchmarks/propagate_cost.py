"""CPU time of ``PropagateViewCopyPermute{Down,Up}`` and its whole-graph retraces, stock vs the ``propagate`` speed-up.

    OMP_NUM_THREADS=1 python benchmarks/propagate_cost.py [--model deit_tiny] [--target ethos-u55-128] [--rounds 2]

Lowers the model uncached in one process, alternating every speed-up but
``propagate`` with every speed-up, after one warm-up pair. For each lowering
it prints the CPU time (``time.process_time``) spent inside the two passes,
the whole-graph retraces made inside them (stock's own and those of the
fusion passes they call), the speed-up's counts of retraces made stock and in
place, and whether the ``.pte`` bytes of the pair are equal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from typing import Any

NAMES = ("PropagateViewCopyPermuteDownPass", "PropagateViewCopyPermuteUpPass")


class _Meter:
    """Wraps ``ArmPass.__call__`` (CPU time inside the two passes) and counts retraces made inside them.

    A retrace is counted at ``_validate_symbolic_input_snapshots``, which every ``call_submodule`` runs once and no
    speed-up pins (wrapping a pinned function would switch its speed-up off).
    """

    def __init__(self) -> None:
        self.cpu = 0.0
        self.retraces = 0
        self.calls = 0
        self._depth = 0

    def install(self) -> None:
        from executorch.backends.arm._passes.arm_pass import ArmPass
        from executorch.exir.pass_base import _ExportPassBase

        call, validate = ArmPass.__call__, _ExportPassBase._validate_symbolic_input_snapshots
        meter = self

        def timed(pass_: Any, graph_module: Any) -> Any:
            if type(pass_).__name__ not in NAMES:
                return call(pass_, graph_module)
            meter._depth += 1
            start = time.process_time()
            try:
                return call(pass_, graph_module)
            finally:
                meter.cpu += time.process_time() - start
                meter.calls += 1
                meter._depth -= 1

        def counted(pass_: Any, old: Any, new: Any) -> Any:
            if meter._depth:
                meter.retraces += 1
            return validate(pass_, old, new)

        ArmPass.__call__ = timed
        _ExportPassBase._validate_symbolic_input_snapshots = counted

    def reset(self) -> None:
        self.cpu, self.retraces, self.calls = 0.0, 0, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deit_tiny")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import lowercache
    from lowercache.bench import models, passgraphs
    from lowercache.speedups import propagate

    meter = _Meter()
    meter.install()
    module, example = models.MODELS[args.model]()
    for index in range(args.rounds + 1):
        ptes = []
        for speedups in ("all,-propagate", "all"):
            meter.reset()
            propagate.reset_stats()
            with contextlib.redirect_stdout(io.StringIO()):  # Vela's summary
                artifacts = passgraphs.lowered_with(
                    speedups, lambda: lowercache.lower(module, example, target=args.target, use_cache=False)
                )
            ptes.append(artifacts.pte)
            stats = propagate.stats()
            print(
                f"{args.model} {args.target} {'warm-up' if index == 0 else f'round {index}'} {speedups:15s} "
                f"pass CPU {meter.cpu:6.2f} s in {meter.calls} calls, whole-graph retraces {meter.retraces:3d} "
                f"(propagate: {stats['real']} stock, {stats['local']} in place)",
                flush=True,
            )
        print(f"  .pte equal: {ptes[0] == ptes[1]}", flush=True)


if __name__ == "__main__":
    main()
