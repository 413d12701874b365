"""Small seeded models beyond the benchmark's: more operators, and graph shapes a cache can get wrong.

``ZOO``: two models that between them use pooling, resizing, concatenation,
padding, splitting, strided slicing, elementwise arithmetic, table operators
(sigmoid, tanh, exp, rsqrt), normalization, softmax, batched matmul,
reductions and two outputs, each with an edit that swaps one activation, as
the benchmark's structure edits do. ``ODD``: an in-place buffer update, a
layer applied twice with a duplicated output, several inputs of other
dtypes, no parameters at all. ``unlowerable``: a model stock cannot lower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowercache.bench import models


class ConvZoo(nn.Module):
    """Conv/BN, hardswish, max pool, depthwise conv, SiLU, nearest upsampling, sigmoid, cat, pad, mean, tanh."""

    def __init__(self, act: type[nn.Module] = nn.Hardswish, avg_pool: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = act()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.side = nn.Conv2d(8, 4, 1)
        self.c2 = nn.Conv2d(12, 8, 3, stride=2)
        self.fc = nn.Linear(8, 5)
        self.avg_pool = avg_pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.c1(x)))
        x = F.max_pool2d(x, 2)
        y = self.pw(F.silu(self.dw(x)))
        y = F.interpolate(y, scale_factor=2, mode="nearest")
        z = F.interpolate(torch.sigmoid(self.side(x)), scale_factor=2, mode="nearest")
        y = self.c2(F.pad(torch.cat([y, z], dim=1), (1, 1, 1, 1)))
        y = F.avg_pool2d(y, 2) if self.avg_pool else F.relu(y)
        return torch.tanh(self.fc(y.mean(dim=(2, 3))))


class SeqZoo(nn.Module):
    """Conv1d, GELU, chunk, mul/sub/div/abs, clamp, exp, rsqrt, linear, layer norm, softmax, bmm,
    strided slices, sum, expand, cat, permute, reshape, maximum, amax; two outputs."""

    def __init__(self, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 12, 3, padding=1)
        self.act = act()
        self.l1 = nn.Linear(16, 16)
        self.l2 = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.act(self.conv(x)).chunk(2, dim=1)
        c = torch.clamp(a * b - a / (b.abs() + 1.0), -2.0, 2.0)
        d = torch.exp(c * 0.1) + torch.rsqrt(b * b + 1.0)
        e = self.ln(self.l1(d))
        f = torch.softmax(e @ e.transpose(1, 2) * 0.25, dim=-1) @ self.l2(e)
        g = f[:, ::2, :] + f[:, 1::2, :]
        out = torch.cat([g, g.sum(dim=-1, keepdim=True).expand(-1, -1, 4)], dim=-1)
        return out.permute(0, 2, 1).reshape(1, -1), torch.maximum(g, torch.zeros_like(g)).amax(dim=1)


class Stateful(nn.Module):
    """A buffer updated in place in forward (a running mean) and a plain tensor attribute (a lifted constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("running", torch.zeros(4))
        self.scale = torch.tensor([0.5, 1.0, 1.5, 2.0]).view(1, 4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        self.running.mul_(0.9).add_(y.mean(dim=(0, 2, 3)) * 0.1)
        return F.relu(y * self.scale) + self.running.view(1, 4, 1, 1)


class Shared(nn.Module):
    """One layer applied twice, an unused parameter, a duplicated output and an input returned as is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = self.lin(x)
        b = self.lin(torch.tanh(a))
        return a, b, b, x


class MultiInput(nn.Module):
    """Token ids (int64) through an embedding, a bool mask and a float input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 16)
        self.proj = nn.Linear(4, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.proj(feats)
        h = torch.where(mask.unsqueeze(-1), h, torch.zeros_like(h))
        return self.lin(torch.relu(h)).sum(dim=1)


class NoParameters(nn.Module):
    """No parameters at all, and a constant second output."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(x) * 2.0 - 1.0, torch.ones(2, 2)


def _seeded(module: nn.Module, shape: tuple[int, ...]) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The benchmark models' seeded initialisation (per module path) and input."""
    models._init_params(module, seed=0, salt="op-zoo")
    return module.eval(), (models._randn(shape, seed=0, salt="op-zoo"),)


def conv_zoo(edit: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(ConvZoo(act=nn.ReLU6 if edit else nn.Hardswish), (1, 3, 16, 16))


def seq_zoo(edit: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(SeqZoo(act=nn.SiLU if edit else nn.GELU), (1, 6, 16))


def unlowerable() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ConvZoo with an average pool that stock ExecuTorch 1.5.1 fails to lower for Ethos-U55 (a float input reaches it)."""
    return _seeded(ConvZoo(avg_pool=True), (1, 3, 16, 16))


def stateful() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(Stateful(), (1, 3, 8, 8))


def shared() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(Shared(), (2, 8))


def multi_input() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    module, (feats,) = _seeded(MultiInput(), (1, 6, 4))
    ids = torch.randint(0, 50, (1, 6), generator=models._generator(0, "op-zoo", "ids"))
    mask = torch.tensor([[True, False, True, True, False, True]])
    return module, (ids, mask, feats)


def no_parameters() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _seeded(NoParameters(), (1, 4, 4))


ZOO = {"conv_zoo": conv_zoo, "seq_zoo": seq_zoo}
"""Models with an ``edit`` variant, for every target."""

ODD = {
    "stateful": (stateful, ("tosa-int",)),
    "shared": (shared, ("tosa-fp", "ethos-u55-128")),
    "multi_input": (multi_input, ("tosa-fp", "tosa-int")),
    "no_parameters": (no_parameters, ("ethos-u55-128",)),
}
"""Graph shapes a cache can get wrong, with the targets stock lowers them for (a float in-place buffer update fails in stock)."""


class ChannelsLastNorm(nn.Module):
    """ConvNeXt's block: a depthwise conv, then LayerNorm and an MLP on channels last (permutes around them), residual."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 2, stride=2)
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for _ in range(2):
            y = self.dw(x).permute(0, 2, 3, 1)
            y = self.down(F.gelu(self.up(self.norm(y))))
            x = x + y.permute(0, 3, 1, 2)
        return self.head(x.mean((-2, -1)))


def channels_last_norm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Permutes a layout pass moves through LayerNorm and MLPs, as in ConvNeXt."""
    return _seeded(ChannelsLastNorm(), (1, 3, 16, 16))
