"""A small self-attention block, seeded, whose int8 scales move with torch's thread count (docs/design.md, What is
cached): ``attention()`` is its factory, ``SOURCE`` this file's text, for tests that write it as a model file."""

from pathlib import Path

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.norm, self.qkv, self.proj = heads, nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1)
        return x + self.proj((weights @ v).transpose(1, 2).reshape(b, n, d))


def attention():
    torch.manual_seed(2)
    return Attention().eval(), (torch.randn(1, 6, 16),)


SOURCE = Path(__file__).read_text()
