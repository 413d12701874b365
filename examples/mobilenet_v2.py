"""MobileNetV2 at 96x96 with seeded random weights: the bundled medium-size example.

    lowercache lower examples/mobilenet_v2.py:model --target ethos-u55-128 --out out/mobilenet_v2

The architecture lives in ``lowercache.bench.models`` (shared with the benchmark);
``model`` is the factory lowercache calls.
"""

import torch

from lowercache.bench import models


def model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return models.mobilenet_v2()


def edited() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The same model with one block's activation changed: try it after ``model``."""
    return models.mobilenet_v2(edit="structure")
