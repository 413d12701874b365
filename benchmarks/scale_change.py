"""What a one-block weights edit changes in the TOSA graph of an Ethos-U partition, beyond the edited block.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/scale_change.py --models convnext_like,resnet,mobilenet_v2

A weights edit leaves every block's structure as it was, but calibration
moves the scales of every block after the edited one, so their region keys
change (docs/regions.md, the edit's floor). Serving those blocks again would
need their lowering to differ from the base's in values only. For each
model, this lowers the base and the weights edit (``region_edit.BUILDERS``)
for Ethos-U55-128 in fresh caches and compares the first partition's TOSA
in canonical form (``lowering/replay/tosacanon.py``, names replaced by position):
whether the operators, their order and every tensor's shape and type are the
same, how many operators read a constant whose bytes changed, and which
operators' attributes changed. Research code: evidence on these models,
not a proof for any pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

from lowercache import api
from lowercache.lowering.replay import tosacanon

from region_edit import BUILDERS


def _block(name: str, edit: str | None, target: str) -> list[Any]:
    module, example = BUILDERS[name](edit=edit)
    tosa = api.lower(module, example, target=target, cache_dir=tempfile.mkdtemp(prefix="scale-change-")).tosa[0]
    return tosacanon.canonical(tosa)[1][1][0]  # the first region's first block: [name, inputs, outputs, ops, tensors, consts]


def compare(name: str, target: str) -> dict[str, Any]:
    base, edited = _block(name, None, target), _block(name, "weights", target)
    ops, edited_ops = base[3], edited[3]

    def constants(op: list[Any]) -> list[Any]:
        return [a for a in op[3] if isinstance(a, list) and a and a[0] == "const"]

    same_ops = [o[0] for o in ops] == [o[0] for o in edited_ops]
    return {
        "model": name,
        "operators": len(ops),
        "same operators in the same order": same_ops,
        "same tensor shapes and types": [t[:3] for t in base[4]] == [t[:3] for t in edited[4]],
        "operators whose constant inputs changed": sum(constants(a) != constants(b) for a, b in zip(ops, edited_ops)),
        "operators whose attributes changed": [[a[2][0], a[2][1], b[2][1]] for a, b in zip(ops, edited_ops) if a[2] != b[2]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="convnext_like,resnet,mobilenet_v2")
    parser.add_argument("--target", default="ethos-u55-128")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        print(json.dumps(compare(name, args.target)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
