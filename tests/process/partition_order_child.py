"""Child process for test_partition_order: lower a two-partition model once, print JSON.

``python -m tests.partition_order_child {stock|lowercache} OUT [CACHE_DIR]`` writes
the .pte to OUT and prints the order stock's own partitioner produced its
tags in (observed before lowercache sees the result) and the .pte digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path

import torch
from torch import nn


class MaskedAttention(nn.Module):
    """Two attention-like layers with an integer-built additive mask (the shape of
    transformers' ViT under export): the mask's arange branch becomes its own
    Ethos-U55 partition, separated from the main one by ``ge``/``where``, which
    stay on the CPU."""

    def __init__(self, d: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Conv2d(3, d, 4, stride=4)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(2).transpose(1, 2)
        pos = torch.arange(h.shape[1]) + 1
        mask = torch.where(pos[None, None, :] >= torch.full((1, 1, 1), 0), 0.0, -256.0)
        for norm, mlp in zip(self.norms, self.mlps):
            y = norm(h)
            scores = (y @ y.transpose(1, 2) + mask).softmax(-1)
            h = h + mlp(scores @ y)
        return h


def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MaskedAttention().eval()
    return model, (torch.randn(1, 3, 16, 16, generator=gen),)


def main(mode: str, out: str, cache_dir: str | None = None) -> None:
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

    orders = []
    original = TOSAPartitioner.partition

    def observed(self, program):
        result = original(self, program)
        orders.append(list(result.partition_tags))
        return result

    TOSAPartitioner.partition = observed
    model, example = build()
    with contextlib.redirect_stdout(io.StringIO()):
        if mode == "stock":
            from tests.helpers.oracle import stock_pte

            pte = stock_pte(model, example, "ethos-u55-128")
        else:
            import lowercache

            use_cache = cache_dir is not None
            pte = lowercache.lower(model, example, target="ethos-u55-128", cache_dir=cache_dir, use_cache=use_cache).pte
    Path(out).write_bytes(bytes(pte))
    print(json.dumps({"orders": orders, "sha256": hashlib.sha256(bytes(pte)).hexdigest()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
