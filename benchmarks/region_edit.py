"""Where a one-block edit's lowering time goes on Ethos-U, and what region replay could take off it.

    OMP_NUM_THREADS=1 python benchmarks/region_edit.py --models convnext_like,mobilenet_v2 --target ethos-u55-128

For each model, in one process: a warm-up lowering of ``tiny_cnn`` (as the
warm server does), the base model into an empty cache, then the edited model
(``--edit``, default ``structure``) into the same cache. The edit is timed
and split:

- ``export``;
- quantization: ``prepare`` (of it the Arm annotation passes), ``calibrate``,
  ``convert``, ``re-export``;
- ``to_edge`` outside the partition's TOSA step and Vela (decompositions,
  partitioning, the edge verifier);
- the TOSA pass pipeline, split at the first layout pass
  (``FuseViewCopyTransformPass``): the ``prefix`` before it, which the pass
  census finds local up to names, and the ``suffix``, which holds the
  global passes;
- the rest of the TOSA step (node visitors, serialization);
- ``Vela``, ``to_executorch``, and what is left (hashing, the cache).

It also times the base lowering (``cold seconds``), reports the ``regions``
step of both lowerings when ``LOWERCACHE_SPEEDUPS`` names ``regions`` (its
outcome, seconds, and the pipeline passes' share of them), and cuts the
partition's pipeline input into regions at the depth of the edited block
and compares each region's key with the base model's. The
regions whose key is unchanged are what replay could serve; their share of
the nodes bounds what region replay of the pipeline prefix could save.

From these it gives the edit's ``floor``: the least the edit could take if
every region with an unchanged key were served at no cost in every
piece that works node by node (quantization, the rest of ``to_edge``, the
pipeline's prefix, the node visitors), with the pieces that run on the whole
model kept (export, the pipeline's suffix, Vela, ``to_executorch``), and
the rest counted as nothing. An aim below the floor is out of reach for a
replay of stock's pipeline, since calibration changes the scales of every
block after the edited one, and so their keys.

``convnext_like`` is built here, from code, and is in no other list: a
held-out model (stem, 4 stages of ConvNeXt-style blocks with depthwise 7x7
convolutions, GELU MLPs as 1x1 convolutions and residual adds, downsampling
between stages; 64x64 input). Its edits touch ``stages.2.2``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from lowercache.bench import models

CONVNEXT_BLOCK = "stages.2.2"


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.BatchNorm2d(dim)
        self.pw1 = nn.Conv2d(dim, 4 * dim, 1)
        self.act = nn.GELU()
        self.pw2 = nn.Conv2d(4 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(self.act(self.pw1(self.norm(self.dwconv(x)))))


class ConvNeXtLike(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (16, 32, 64, 128), depths: tuple[int, ...] = (2, 2, 2, 2), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), nn.BatchNorm2d(dims[0]))
        self.stages = nn.ModuleList()
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            layers: list[nn.Module] = []
            if i:
                layers.append(nn.Sequential(nn.BatchNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)))
            layers += [_Block(dim) for _ in range(depth)]
            self.stages.append(nn.Sequential(*layers))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((-2, -1)))


def convnext_like(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = models._build(ConvNeXtLike, seed, edit, CONVNEXT_BLOCK, models._gelu_to_relu)
    return model, (models._randn((1, 3, 64, 64), seed, "convnext_like"),)


BUILDERS = {"convnext_like": convnext_like, **models.MODELS}
BLOCKS = {"convnext_like": CONVNEXT_BLOCK, **models.EDITED_BLOCKS}

_timers: collections.Counter = collections.Counter()
_captured: list[Any] = []  # per lowering: the region parts of the first partition's pipeline input


def _timed_convert(program: Any, target: Any, spec: Any, calibration: Any) -> Any:
    """``quantize.convert`` (the stock stage up to its re-export), each part timed."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    start = time.perf_counter()
    prepared = prepare_pt2e(program.module(check_guards=False), target.quantizer(spec))
    _timers["prepare"] += time.perf_counter() - start
    start = time.perf_counter()
    for sample in calibration:
        prepared(*sample)
    _timers["calibrate"] += time.perf_counter() - start
    start = time.perf_counter()
    converted = convert_pt2e(prepared)
    _timers["convert"] += time.perf_counter() - start
    return converted


def _install(depth: list[int]) -> None:
    """Time the quantization stage's parts; note the region parts of each partition's pipeline input (untimed)."""
    from lowercache.lowering import arm, quantize
    from lowercache.lowering.replay import regions

    quantize.convert = _timed_convert
    original = arm.tosa_parts

    def tosa_parts(edge_program: Any, compile_spec: Any) -> Any:
        start = time.perf_counter()
        parts = regions.region_parts(edge_program, depth[0])
        sizes = collections.Counter(regions.membership(edge_program.graph_module, depth[0]).values())
        _captured.append({r: (p, sizes[r]) for r, p in parts.items()})
        _timers["untimed"] += time.perf_counter() - start
        return original(edge_program, compile_spec)

    arm.tosa_parts = tosa_parts


def split(artifacts: Any, total: float) -> dict[str, float]:
    """The edit's seconds by piece."""
    records = artifacts.records
    quantize_at = next((i for i, r in enumerate(records) if r["kind"] == "quantize"), -1)
    annotation = sum(r["seconds"] for r in records[:quantize_at] if r["kind"] == "pass")
    pipeline = [r for r in records[quantize_at + 1:] if r["kind"] == "pass"]
    at = next((i for i, r in enumerate(pipeline) if r["name"] == "FuseViewCopyTransformPass"), len(pipeline))
    prefix = sum(r["seconds"] for r in pipeline[:at])
    suffix = sum(r["seconds"] for r in pipeline[at:])

    def step(kind: str) -> float:
        return sum(r["seconds"] for r in records if r["kind"] == kind)

    stages = artifacts.stages
    to_edge = stages.get("to_edge", 0.0) - _timers["untimed"]
    out = {
        "export": stages.get("export", 0.0),
        "prepare": _timers["prepare"],
        "of it annotation passes": annotation,
        "calibrate": _timers["calibrate"],
        "convert": _timers["convert"],
        "re-export": step("reexport"),
        "to_edge outside TOSA and Vela": to_edge - step("tosa") - step("vela"),
        "TOSA pipeline prefix": prefix,
        "TOSA pipeline suffix (layout passes on)": suffix,
        "TOSA visitors and serialization": step("tosa") - prefix - suffix,
        "Vela": step("vela"),
        "to_executorch": stages.get("to_executorch", 0.0),
    }
    counted = sum(v for k, v in out.items() if not k.startswith("of it"))
    out["rest (hash, cache, start-up of steps)"] = total - _timers["untimed"] - counted
    out["total"] = total - _timers["untimed"]
    return {k: round(v, 3) for k, v in out.items()}


def reuse(base: dict[str, Any], edited: dict[str, Any], block: str) -> dict[str, Any]:
    """Which regions of the pipeline input keep their key, and their share of the nodes; and the share of the
    edited block's own regions (``block`` and the regions inside it)."""
    same = [r for r in edited if r in base and base[r][0] == edited[r][0]]
    nodes = sum(n for _p, n in edited.values())
    kept = sum(edited[r][1] for r in same)
    own = sum(n for r, (_p, n) in edited.items() if r == block or r.startswith(block + "."))
    sequence = list(base) == list(edited)
    return {"regions": len(edited), "unchanged": len(same), "node share unchanged": round(kept / max(nodes, 1), 3),
            "node share of the edited block": round(own / max(nodes, 1), 3),
            "same region sequence": sequence, "changed": [r for r in edited if r not in same]}


# The pieces a replay of unchanged regions could shrink to the dirty share, at best: they work node by node
# over the model (quantization over the float graph, the rest of ``to_edge`` and the pipeline's prefix over
# the edge graph, the node visitors over the partition). The others run whole whatever is served: the export
# that keys everything, the pipeline's suffix (its layout passes move nodes across blocks: docs/regions.md,
# the census), TOSA serialization and Vela on the partition, ``to_executorch`` on the program.
REGIONABLE = ("prepare", "calibrate", "convert", "re-export", "to_edge outside TOSA and Vela", "TOSA pipeline prefix",
              "TOSA visitors and serialization")
WHOLE = ("export", "TOSA pipeline suffix (layout passes on)", "Vela", "to_executorch")


def floor(seconds: dict[str, float], unchanged_share: float, block_share: float, cold: float) -> dict[str, float]:
    """The least an edit could take with every region whose key is unchanged served at no cost, from this run's pieces.

    The region-able pieces shrink to the share of the nodes in changed regions
    (time taken as even across nodes); the whole-model pieces stay; the rest
    (hashing, the cache) and a command's own costs count as nothing. Today only
    the unchanged regions before the first changed one can be served, so this
    is an optimistic floor: an aim below it cannot be reached by a replay of
    stock's pipeline that serves unchanged regions, however well built.

    ``if only the edited block re-ran``: the same floor if the blocks after the
    edited one, whose keys change only because calibration moved their scales,
    were served as well (``block_share``: the edited block's share of the nodes).
    ``if the blocks after it re-ran from the TOSA pipeline on``: served up to the
    pipeline with their new scales filled in (quantization and ``to_edge`` copy
    scales through as literals; the pipeline's passes compute from them), and
    the pipeline's prefix and the visitors run for every changed region.
    """
    dirty = 1.0 - unchanged_share
    whole = sum(seconds[k] for k in WHOLE)
    regionable = sum(seconds[k] for k in REGIONABLE)
    in_pipeline = seconds["TOSA pipeline prefix"] + seconds["TOSA visitors and serialization"]
    suffix = seconds["TOSA pipeline suffix (layout passes on)"]
    edit = whole + dirty * regionable
    return {"whole-model pieces": round(whole, 3), "region-able pieces": round(regionable, 3),
            "dirty share": round(dirty, 3), "edit floor": round(edit, 3),
            "edit floor, suffix region-able too": round(edit - (1.0 - dirty) * suffix, 3),
            "cold / edit floor": round(cold / edit, 2) if edit else 0.0,
            "edit floor if only the edited block re-ran": round(whole + block_share * regionable, 3),
            "edit floor if the blocks after it re-ran from the TOSA pipeline on": round(
                whole + block_share * (regionable - in_pipeline) + dirty * in_pipeline, 3)}


def measure(name: str, target: str, edit: str) -> dict[str, Any]:
    from lowercache import api

    cache = tempfile.mkdtemp(prefix="region-edit-")
    module, example = BUILDERS[name]()
    _timers.clear()
    start = time.perf_counter()
    cold = api.lower(module, example, target=target, cache_dir=cache)
    cold_seconds = time.perf_counter() - _timers["untimed"] - start
    base = _captured[-1]
    module, example = BUILDERS[name](edit=edit)
    _timers.clear()
    start = time.perf_counter()
    artifacts = api.lower(module, example, target=target, cache_dir=cache)
    total = time.perf_counter() - start
    seconds = split(artifacts, total)
    regions = reuse(base, _captured[-1], BLOCKS[name])
    return {"model": name, "target": target, "edit": edit, "cold seconds": round(cold_seconds, 3), "seconds": seconds,
            "regions": regions, "floor": floor(seconds, regions["node share unchanged"], regions["node share of the edited block"], cold_seconds),
            "regions step": {"cold": _regions_step(cold), "edit": _regions_step(artifacts)}}


def _regions_step(artifacts: Any) -> dict[str, Any] | None:
    """The ``regions`` speed-up's step (``LOWERCACHE_SPEEDUPS=all,regions``): what it did and its seconds."""
    records = artifacts.records
    step = next((r for r in records if r["kind"] == "regions"), None)
    if step is None:
        return None
    quantize_at = next((i for i, r in enumerate(records) if r["kind"] == "quantize"), -1)
    passes = sum(r["seconds"] for r in records[quantize_at + 1:] if r["kind"] == "pass")
    return {"outcome": step["outcome"], "name": step["name"], "seconds": round(step["seconds"], 3),
            "of it passes": round(passes, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="convnext_like,mobilenet_v2")
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--edit", default="structure", choices=("structure", "weights"))
    args = parser.parse_args(argv)
    from lowercache import api

    depth = [1]
    _install(depth)
    module, example = models.tiny_cnn()
    api.lower(module, example, target=args.target, cache_dir=tempfile.mkdtemp(prefix="region-edit-warm-"))
    for name in args.models.split(","):
        depth[0] = len(BLOCKS[name].split("."))
        print(json.dumps(measure(name, args.target, args.edit)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
