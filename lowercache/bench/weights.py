"""Weights-only edits of the benchmark's models: what a retrained checkpoint looks like to a lowering.

Issue 54's edits keep a model's structure and change its weights, so
calibration moves the quantization parameters of everything downstream:

* ``"retrained"``: every parameter and buffer re-initialised (a new checkpoint
  of the same architecture);
* ``"block"``: one block's (``models.EDITED_BLOCKS``) parameters and buffers;
* ``"head"``: the last linear layer only (a fine-tuned classifier head).

Each edit takes a ``seed``, so that many distinct edits of one model can be
made, and keeps the base model's example inputs (``models`` seeds the inputs
from the model seed, which an edit must not move). ``convnext`` is a small
ConvNeXt built from a ``transformers`` config (the ``bench`` extra).
"""

from __future__ import annotations

from torch import nn

from . import models

KINDS: tuple[str, ...] = ("retrained", "block", "head")

CONVNEXT_BLOCK = "model.convnext.encoder.stages.2.layers.1"


def convnext(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, models.ExampleInputs]:
    """A ConvNeXt (hidden sizes 16-32-48-64, depths 1-1-2-1, 10 classes) from ``transformers``, input 1x3x64x64.

    Edits touch ``CONVNEXT_BLOCK``: ``"structure"`` turns its GELU into ReLU,
    ``"weights"`` re-initialises it.
    """
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1], image_size=64, num_labels=10)
    model = models.build(
        lambda: models.LogitsOnly(ConvNextForImageClassification(config)), seed, edit, CONVNEXT_BLOCK, models.gelu_to_relu
    )
    return model, (models.seeded_inputs((1, 3, 64, 64), seed, "convnext"),)


MODELS: dict[str, models.Builder] = {**models.MODELS, "convnext": convnext}
BLOCKS: dict[str, str] = {**models.EDITED_BLOCKS, "convnext": CONVNEXT_BLOCK}


def head_path(module: nn.Module) -> str:
    """The module path of the model's last linear layer (its classifier head)."""
    last = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not last:
        raise ValueError(f"{type(module).__name__} has no linear layer")
    return last[-1]


def edited(name: str, kind: str, seed: int = 1) -> tuple[nn.Module, models.ExampleInputs]:
    """The base model ``name`` with a weights-only edit ``kind`` drawn from ``seed``; the base's example inputs."""
    if kind not in KINDS:
        raise ValueError(f"unknown weights edit {kind!r}; expected one of {KINDS}")
    module, example = MODELS[name]()
    if kind == "retrained":
        scope = ""
    elif kind == "block":
        scope = BLOCKS[name] if name != "deit_tiny" else models.vit_layer_path(module, 6)
    else:
        scope = head_path(module)
    target = module.get_submodule(scope) if scope else module
    models.init_params(target, seed, prefix=scope, salt=f"{kind}-edit", bn_var=models.BN_VARIANCES.get(name, (0.5, 1.5)))
    return module.eval(), example
