"""A tiny CNN: the smallest model worth lowering. Seeded, so every run has the same weights.

    lowercache lower examples/tiny_cnn.py:model --target ethos-u55-128 --out out/tiny
"""

import torch


class TinyCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The factory lowercache calls: (module in eval mode, example inputs)."""
    torch.manual_seed(0)
    return TinyCNN().eval(), (torch.randn(1, 3, 16, 16),)
