"""A small CNN with one deliberately lossy layer, for the per-layer check (``lower --check=layers``).

``lossy`` shifts its input far from zero and back: the quantizer's grid for
the shifted activation is coarse (a step of about 0.5), so the values come
back rounded and the SNR falls there, while every other layer keeps about
40 dB. Self-contained (it imports only torch): a CLI test copies this file
beside its project as the model file.
"""

import torch


class Lossy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 60.0) - 60.0


class LossyCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.lossy = Lossy()
        self.conv3 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8 * 10 * 10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = self.lossy(x)
        x = torch.relu(self.conv3(x))
        return self.fc(x.flatten(1))


def model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return LossyCNN().eval(), (torch.randn(1, 3, 16, 16),)
