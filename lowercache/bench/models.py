"""Seeded model builders for the benchmark, the tests and the examples.

Every builder returns ``(module.eval(), example_inputs)`` and is a pure
function of its arguments: the weights and inputs are random (nothing is
downloaded) but come from ``torch.Generator`` objects seeded with
``manual_seed`` from a hash of ``(seed, module path)``.  Seeding per module
path, rather than drawing everything from one global stream, is what makes
the edit scenarios local: changing or re-initialising one block cannot shift
the random numbers drawn for any other layer, and building a model never
disturbs the caller's global RNG.

``edit`` selects one of the benchmark's repeatable edit scenarios:

* ``None``: the base model.
* ``"structure"``: the activations of one block (``EDITED_BLOCKS[name]``)
  change: the block's first ReLU is removed in the ReLU CNNs, its ReLU6
  become ReLU in MobileNetV2, and its MLP's GELU becomes ReLU in the
  transformers.  Activations have no parameters, so the state dict is
  identical to the base model's; only the graph (and the output) changes.
* ``"weights"``: same architecture; the parameters and buffers of that one
  block are re-initialised from a different seed, everything else is
  identical.

The ``transformers`` package is imported lazily, inside the builders that use
it, so importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

ExampleInputs = tuple[torch.Tensor, ...]
Builder = Callable[..., tuple[nn.Module, ExampleInputs]]

EDITS: tuple[str | None, ...] = (None, "structure", "weights")
"""The accepted values of every builder's ``edit`` argument."""

EDITED_BLOCKS: dict[str, str] = {
    "tiny_cnn": "block2",
    "residual_cnn": "stages.1.2",
    "transformer_block": "mlp",
    "mobilenet_v2": "features.9",
    "resnet": "model.resnet.encoder.stages.2.layers.1",
    "deit_tiny": "model.vit.layers.6",
}
"""Module path (in the returned module) of the block each edit touches.

The ``deit_tiny`` path is the one of transformers 5.x; with 4.x the same
layer lives at ``model.vit.encoder.layer.6`` (the builder resolves it).
"""

_WEIGHTS_EDIT_SALT = "weights-edit"


def _generator(seed: int, salt: str, name: str) -> torch.Generator:
    """Return a CPU generator seeded from a stable hash of its arguments.

    ``hashlib`` rather than ``hash()`` keeps the seed identical across
    processes regardless of ``PYTHONHASHSEED``.
    """
    digest = hashlib.blake2b(f"{seed}\0{salt}\0{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _init_module(module: nn.Module, gen: torch.Generator, bn_var: tuple[float, float]) -> None:
    """Initialise the direct parameters and buffers of one module.

    Convolutions use Kaiming-normal (variance preserving through ReLU) so the
    deep CNNs keep activations in a range that quantises sensibly; norm layers
    get non-trivial affine parameters and running statistics so that BatchNorm
    folding and LayerNorm actually change the numbers.  ``bn_var`` is the
    range of the BatchNorm running variances: the ResNets (identity
    shortcuts, no learned normalisation) need larger ones than MobileNetV2
    to keep their activations from growing block after block.
    """
    if isinstance(module, nn.modules.conv._ConvNd):
        nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu", generator=gen)
        if module.bias is not None:
            module.bias.uniform_(-0.1, 0.1, generator=gen)
    elif isinstance(module, nn.Linear):
        nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="linear", generator=gen)
        if module.bias is not None:
            module.bias.uniform_(-0.1, 0.1, generator=gen)
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        if module.affine:
            module.weight.uniform_(0.5, 1.5, generator=gen)
            module.bias.normal_(0.0, 0.1, generator=gen)
        if module.track_running_stats:
            module.running_mean.normal_(0.0, 0.1, generator=gen)
            module.running_var.uniform_(*bn_var, generator=gen)
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            module.weight.uniform_(0.8, 1.2, generator=gen)
        if module.bias is not None:
            module.bias.normal_(0.0, 0.02, generator=gen)
    else:
        for param in module.parameters(recurse=False):
            param.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def _init_params(
    module: nn.Module, seed: int, prefix: str = "", salt: str = "", bn_var: tuple[float, float] = (0.5, 1.5)
) -> None:
    """Initialise every submodule of ``module`` from ``(seed, salt, path)``.

    ``prefix`` is the path of ``module`` inside the full model, so that a
    block initialised on its own gets exactly the numbers it would get as
    part of the whole model.
    """
    for name, sub in module.named_modules(prefix=prefix):
        _init_module(sub, _generator(seed, salt, name), bn_var)


def _randn(shape: Sequence[int], seed: int, salt: str) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=_generator(seed, salt, "input"))


def _swap_children(
    block: nn.Module, match: Callable[[nn.Module], bool], factory: Callable[[], nn.Module]
) -> int:
    """Replace every descendant of ``block`` for which ``match`` holds; return the count."""
    count = 0
    for parent in list(block.modules()):
        for attr, child in list(parent.named_children()):
            if match(child):
                setattr(parent, attr, factory())
                count += 1
    return count


def _build(
    factory: Callable[[], nn.Module],
    seed: int,
    edit: str | None,
    block: str | Callable[[nn.Module], str],
    swap: Callable[[nn.Module], int],
    bn_var: tuple[float, float] = (0.5, 1.5),
) -> nn.Module:
    """Construct, initialise and edit a model; ``block`` is the edited submodule's path.

    Construction runs under ``fork_rng`` because layer constructors draw
    their default initialisation from the global RNG: the caller's RNG stays
    untouched, and the (overwritten) defaults are seeded anyway in case a
    tensor is ever missed by ``_init_params``.  The base weights are always
    written first, so an edited model differs from the base model only
    inside ``block``.
    """
    if edit not in EDITS:
        raise ValueError(f"unknown edit {edit!r}; expected one of {EDITS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    if callable(block):
        block = block(model)
    _init_params(model, seed, bn_var=bn_var)
    target = model.get_submodule(block)
    if edit == "structure":
        if swap(target) == 0:
            raise RuntimeError(f"structure edit found nothing to change in {block!r}")
    elif edit == "weights":
        _init_params(target, seed, prefix=block, salt=_WEIGHTS_EDIT_SALT, bn_var=bn_var)
    return model.eval()


def _remove_first_relu(block: nn.Module) -> int:
    """Replace the first ReLU of ``block`` (in registration order) by ``nn.Identity``.

    ReLU -> ReLU6 would be the gentler edit, but with these weights the
    small CNNs rarely exceed 6, so the "edited" model would compute exactly
    what the base model does.
    """
    for parent in block.modules():
        for attr, child in parent.named_children():
            if type(child) is nn.ReLU:
                setattr(parent, attr, nn.Identity())
                return 1
    return 0


def _relu6_to_relu(block: nn.Module) -> int:
    return _swap_children(block, lambda m: type(m) is nn.ReLU6, nn.ReLU)


def _gelu_to_relu(block: nn.Module) -> int:
    return _swap_children(block, lambda m: "gelu" in type(m).__name__.lower(), nn.ReLU)


class TinyCNN(nn.Module):
    """Two 3x3 convolutions with ReLU and a linear classifier; the smallest useful model."""

    def __init__(self, num_classes: int = 10, size: int = 16) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(8 * size * size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(x))
        return self.fc(torch.flatten(x, 1))


def tiny_cnn(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, ExampleInputs]:
    """Build ``TinyCNN`` with input 1x3x16x16.

    Edits touch ``block2`` (the second conv): ``"structure"`` removes its
    ReLU, ``"weights"`` re-initialises its convolution.
    """
    model = _build(TinyCNN, seed, edit, EDITED_BLOCKS["tiny_cnn"], _remove_first_relu)
    return model, (_randn((1, 3, 16, 16), seed, "tiny_cnn"),)


class _BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU, conv-BN, add (projected) shortcut, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        self.act2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act2(y + self.shortcut(x))


class ResidualCNN(nn.Module):
    """Small ResNet: stem + three stages of basic blocks (31 Conv2d in total)."""

    def __init__(
        self,
        channels: Sequence[int] = (8, 16, 32),
        blocks: Sequence[int] = (5, 5, 4),
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels[0], 3, padding=1, bias=False), nn.BatchNorm2d(channels[0]), nn.ReLU()
        )
        stages = []
        cin = channels[0]
        for i, (cout, n) in enumerate(zip(channels, blocks)):
            first = _BasicBlock(cin, cout, 1 if i == 0 else 2)
            stages.append(nn.Sequential(first, *[_BasicBlock(cout, cout, 1) for _ in range(n - 1)]))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def residual_cnn(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, ExampleInputs]:
    """Build ``ResidualCNN`` (31 convs, 8-32 channels) with input 1x3x32x32.

    Edits touch block ``stages.1.2`` (second stage, third block):
    ``"structure"`` removes its inner ReLU (``act1``; the ReLU after the
    residual add stays), ``"weights"`` re-initialises its convolutions and
    BatchNorms.
    """
    model = _build(ResidualCNN, seed, edit, EDITED_BLOCKS["residual_cnn"], _remove_first_relu, bn_var=(1.0, 3.0))
    return model, (_randn((1, 3, 32, 32), seed, "residual_cnn"),)


class _SelfAttention(nn.Module):
    """Multi-head self-attention with explicit matmul + softmax (no SDPA kernels)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer encoder block: LN, self-attention, LN, GELU MLP, residual adds."""

    def __init__(self, dim: int = 64, heads: int = 4, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _MLP(dim, dim * mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def transformer_block(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, ExampleInputs]:
    """Build one ``TransformerBlock`` (hidden 64, 4 heads, MLP 256) with input 1x16x64.

    Edits touch the MLP: ``"structure"`` turns its GELU into ReLU,
    ``"weights"`` re-initialises ``mlp.fc1`` and ``mlp.fc2``.
    """
    model = _build(TransformerBlock, seed, edit, EDITED_BLOCKS["transformer_block"], _gelu_to_relu)
    return model, (_randn((1, 16, 64), seed, "transformer_block"),)


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round channel counts as the reference MobileNetV2 does."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _conv_bn_relu6(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class _InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, linear 1x1 project, optional residual."""

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(cin * expand_ratio))
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(cin, hidden, kernel=1))
        layers += [
            _conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0, standard inverted-residual table) in plain torch.

    Layout and module names follow the reference implementation (``features``,
    ``classifier``); the classifier's dropout is left out because it is the
    identity in eval mode.
    """

    SETTINGS = (  # expand ratio t, channels c, repeats n, first stride s
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        super().__init__()
        cin = _make_divisible(32 * width_mult)
        last = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [_conv_bn_relu6(3, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(_InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(_conv_bn_relu6(cin, last, kernel=1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(last, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(seed: int = 0, edit: str | None = None, size: int = 96) -> tuple[nn.Module, ExampleInputs]:
    """Build ``MobileNetV2`` (1000 classes) with input 1x3x``size``x``size``.

    Edits touch ``features.9`` (a 64-channel stride-1 residual block):
    ``"structure"`` turns its two ReLU6 into ReLU, ``"weights"``
    re-initialises its convolutions and BatchNorms.
    """
    model = _build(MobileNetV2, seed, edit, EDITED_BLOCKS["mobilenet_v2"], _relu6_to_relu)
    return model, (_randn((1, 3, size, size), seed, "mobilenet_v2"),)


class LogitsOnly(nn.Module):
    """Adapt a ``transformers`` image classifier to ``forward(tensor) -> logits``.

    ``torch.export`` and the Arm partitioners want plain tensors in and out,
    not ``ModelOutput`` dataclasses.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def resnet(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, ExampleInputs]:
    """Build a ResNet-18-shaped ``transformers`` ResNet (1000 classes) with input 1x3x64x64.

    Edits touch ``model.resnet.encoder.stages.2.layers.1`` (the second basic
    block of the third stage): ``"structure"`` removes its inner ReLU (the
    one after its first convolution), ``"weights"`` re-initialises its
    convolutions and BatchNorms.
    """
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3,
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        hidden_act="relu",
        num_labels=1000,
    )
    model = _build(
        lambda: LogitsOnly(ResNetForImageClassification(config)),
        seed,
        edit,
        EDITED_BLOCKS["resnet"],
        _remove_first_relu,
        bn_var=(1.0, 3.0),
    )
    return model, (_randn((1, 3, 64, 64), seed, "resnet"),)


def _vit_layer_path(model: nn.Module, index: int) -> str:
    """Path of encoder layer ``index``; it moved between transformers 4.x and 5.x."""
    vit = model.get_submodule("model.vit")
    if hasattr(vit, "layers"):
        return f"model.vit.layers.{index}"
    return f"model.vit.encoder.layer.{index}"


def deit_tiny(seed: int = 0, edit: str | None = None) -> tuple[nn.Module, ExampleInputs]:
    """Build a DeiT-tiny-shaped ``transformers`` ViT (1000 classes) with input 1x3x224x224.

    Eager attention keeps the graph to matmul + softmax (no SDPA).  Under
    ``torch.export`` transformers 5.x cannot prove the attention mask is
    unneeded, so the exported graph also builds an all-zero additive mask
    (arange/ge/where) and adds it to each layer's attention scores.  Edits
    touch encoder layer 6: ``"structure"`` turns its MLP GELU into ReLU,
    ``"weights"`` re-initialises the whole layer (attention, MLP, norms).
    """
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=192,
        num_hidden_layers=12,
        num_attention_heads=3,
        intermediate_size=768,
        image_size=224,
        patch_size=16,
        num_labels=1000,
        attn_implementation="eager",
    )
    model = _build(
        lambda: LogitsOnly(ViTForImageClassification(config)),
        seed,
        edit,
        lambda m: _vit_layer_path(m, 6),
        _gelu_to_relu,
    )
    return model, (_randn((1, 3, 224, 224), seed, "deit_tiny"),)


def calibration_samples(example_inputs: Sequence[torch.Tensor], n: int = 4, seed: int = 1) -> list[ExampleInputs]:
    """Return ``n`` seeded input tuples shaped like ``example_inputs``.

    Used for the "calibration change" scenario: the model is unchanged but the
    quantiser sees a different calibration set.  Non-float inputs are copied
    unchanged.
    """
    gen = _generator(seed, "calibration", "samples")
    samples = []
    for _ in range(n):
        samples.append(
            tuple(
                torch.randn(t.shape, dtype=t.dtype, generator=gen) if t.is_floating_point() else t.clone()
                for t in example_inputs
            )
        )
    return samples


MODELS: dict[str, Builder] = {
    "tiny_cnn": tiny_cnn,
    "residual_cnn": residual_cnn,
    "transformer_block": transformer_block,
    "mobilenet_v2": mobilenet_v2,
    "resnet": resnet,
    "deit_tiny": deit_tiny,
}
"""Builders by name; all accept ``seed`` and ``edit`` keyword arguments."""

SMALL: tuple[str, ...] = ("tiny_cnn", "residual_cnn", "transformer_block")
"""Models that lower in seconds; used by the tests and quick benchmarks."""

LARGE: tuple[str, ...] = ("mobilenet_v2", "resnet", "deit_tiny")
"""Realistic models for the full benchmark (minutes to lower)."""


def scenario_calibration(example: Sequence[torch.Tensor], custom: bool) -> list[ExampleInputs] | None:
    """The calibration set of a measured lowering: None means the flow's default (the example inputs)."""
    return calibration_samples(example) if custom else None


# The builders' parts, for builders and edits made elsewhere (``bench/weights.py``).
init_params = _init_params
build = _build
gelu_to_relu = _gelu_to_relu
seeded_inputs = _randn
vit_layer_path = _vit_layer_path
BN_VARIANCES = {"residual_cnn": (1.0, 3.0), "resnet": (1.0, 3.0)}
"""The BatchNorm running-variance range each builder that does not use the default passes to ``_build``."""
