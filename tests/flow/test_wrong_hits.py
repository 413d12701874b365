"""Wrong cache hits (issue #4): a small edit must never be served the base model's artifacts.

For each kind of edit, a tiny seeded base model is lowered through lowercache
into a cache (warming it); then the edited model is lowered with that same
cache and must give exactly ``stock_pte(edited)``, and so must a cold
lowering of the edited model into a fresh cache. Every edit is checked to
change stock's own output (else the test could not fail), and the step
records say where the edited run missed: the flow step always; a TOSA or
Vela step may hit only where that partition's bytes are the base's.

The edits are the small ones a key could overlook: a single observer's range
(same graph and weights), one constant element (weight, bias, buffer, or a
tensor made in ``forward``), one shape, one op overload or argument, a
duplicated graph output, and constants that ``FuseEqualPlaceholdersPass``
merges (equal in one model, one element apart in the other, both ways).
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lowercache

from tests.helpers.graphs import outcomes
from tests.helpers.oracle import stock_pte


QUANTIZED = "ethos-u55-128"


# Tiny seeded models. Every builder seeds the global RNG itself, so a base and
# its edited variant start from the very same weights.


def _input(*shape: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(*shape, generator=gen) + 0.5,)  # off-centre: the input's range is not symmetric


class AbsNet(nn.Module):
    """abs() first: negating the calibration input moves the input observer only (|-x| == |x|)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x.abs()))


class Net(nn.Module):
    """The base of the constant, overload, output and input-shape edits; ``edit`` changes exactly one thing.

    ``offset`` is a non-persistent buffer and ``factors`` become a tensor
    constant made in ``forward``: both reach the program as lifted constants
    (``ExportedProgram.constants``), the weights as parameters (``state_dict``).
    """

    def __init__(self, edit: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 4).reshape(1, 4, 1, 1), persistent=False)
        self.factors = [0.5, -1.0, 1.5, 2.0]
        self.edit = edit
        with torch.no_grad():
            if edit == "weight":
                self.conv.weight[1, 0, 1, 1] += 0.75
            elif edit == "bias":
                self.conv.bias[2] += 0.5
            elif edit == "buffer":
                self.offset[0, 3, 0, 0] = 2.0
            elif edit == "tensor_constant":
                self.factors[2] = -1.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = (self.conv(x) + self.offset) * torch.tensor(self.factors).reshape(1, 4, 1, 1)
        if self.edit == "add_alpha":
            a = torch.add(h, torch.relu(h), alpha=2.0)  # add.Tensor, one more argument
        elif self.edit == "add_scalar":
            a = torch.add(h, 2.0)  # a scalar other
        else:
            a = torch.add(h, torch.relu(h))  # add.Tensor
        b = h.mean(dim=(2, 3), keepdim=self.edit == "mean_keepdim")
        if self.edit == "outputs_clone":
            return a, b, b.clone()
        if self.edit == "outputs_single":
            return a, b
        return a, b, b  # one node, two graph outputs


class LinearNet(nn.Module):
    def __init__(self, out_features: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class FuseNet(nn.Module):
    """Two convolutions whose weights (and biases) are equal, or one element apart.

    Equal constants are merged into one placeholder by the Arm pipeline's
    FuseEqualPlaceholdersPass.
    """

    def __init__(self, equal: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
            self.b.bias.copy_(self.a.bias)
            if not equal:
                self.b.weight[2, 1, 0, 2] += 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@dataclass(frozen=True)
class Model:
    """One lowering input: a module builder and what ``lower`` is called with."""

    name: str
    build: Callable[[], nn.Module]
    example: Callable[[], tuple[torch.Tensor, ...]]
    calibration: Callable[[], list[tuple[torch.Tensor, ...]] | None] = lambda: None
    per_channel: bool = True

    def lower(self, target: str, cache_dir: Any) -> lowercache.Artifacts:
        return lowercache.lower(
            self.build().eval(),
            self.example(),
            target=target,
            cache_dir=cache_dir,
            calibration=self.calibration(),
            per_channel=self.per_channel,
        )

    def stock(self, target: str) -> bytes:
        return stock_pte(self.build().eval(), self.example(), target, calibration=self.calibration(), per_channel=self.per_channel)


def _x() -> tuple[torch.Tensor, ...]:
    return _input(1, 3, 8, 8)


def _negated_x() -> list[tuple[torch.Tensor, ...]]:
    return [(-_x()[0],)]


ABS = Model("abs", AbsNet, _x)
NET = Model("net", Net, _x)
LINEAR = Model("linear5", lambda: LinearNet(5), lambda: _input(2, 8))
FUSE_EQUAL = Model("fuse_equal", lambda: FuseNet(equal=True), lambda: _input(1, 4, 8, 8))
FUSE_APART = Model("fuse_apart", lambda: FuseNet(equal=False), lambda: _input(1, 4, 8, 8))


@dataclass(frozen=True)
class Edit:
    id: str
    base: Model
    edited: Model
    targets: tuple[str, ...]
    partition_changes: bool = True  # else the delegated partition is the base's: its steps must hit
    qparams: dict[str, Callable[[int], bool]] = field(default_factory=dict)  # checks of qparams outcome counts
    fused: str | None = None  # "base" or "edited": the side whose equal weights the Arm pipeline merges


def _edited(base: Model, name: str, **changes: Any) -> Model:
    return dataclasses.replace(base, name=f"{base.name}:{name}", **changes)


def _net_edit(kind: str, what: str, float_too: bool = True, **kwargs: Any) -> Edit:
    edited = _edited(NET, what, build=lambda: Net(what))
    return Edit(f"{kind}_{what}", NET, edited, (QUANTIZED, "tosa-fp") if float_too else (QUANTIZED,), **kwargs)


EDITS = [
    # 1. only a qparam: same graph and weights, one activation observer's range moves
    Edit(
        "qparam_one_observer",
        ABS,
        _edited(ABS, "negated-calibration", calibration=_negated_x),
        (QUANTIZED,),
        # the input observer alone saw new statistics; the others (and their second asks) hit
        qparams={"miss": lambda n: n == 1, "hit": lambda n: n > 1},
    ),
    Edit(
        "qparam_per_tensor_weights",
        ABS,
        _edited(ABS, "per-tensor", per_channel=False),
        (QUANTIZED,),
        # the weight observer's type changed; the activation observers are the base's
        qparams={"miss": lambda n: n >= 1, "hit": lambda n: n >= 1},
    ),
    # 2. only a constant: a weight, a bias, a non-persistent buffer, a tensor made in forward
    # (on TOSA-FP, the bias and the buffer reach the program as the weight and the tensor constant do)
    _net_edit("constant", "weight"),
    _net_edit("constant", "bias", float_too=False),
    _net_edit("constant", "buffer", float_too=False),
    _net_edit("constant", "tensor_constant"),
    # 3. only a shape
    Edit("shape_input_width", NET, _edited(NET, "input_width", example=lambda: _input(1, 3, 8, 12)), (QUANTIZED, "tosa-fp")),
    Edit("shape_out_features", LINEAR, _edited(LINEAR, "linear6", build=lambda: LinearNet(6)), (QUANTIZED,)),
    # 4. only an op overload or its arguments (add.Tensor with alpha, with a scalar; mean with keepdim)
    _net_edit("overload", "add_alpha"),
    _net_edit("overload", "add_scalar", float_too=False),
    _net_edit("overload", "mean_keepdim"),
    # 5. the duplicated graph output made distinct, or dropped: the partition itself is unchanged by "single"
    _net_edit("duplicate", "outputs_clone"),
    _net_edit("duplicate", "outputs_single", float_too=False, partition_changes=False),
    # 6. constants that FuseEqualPlaceholdersPass merges, then do not (and the reverse)
    Edit("fuse_equal_then_apart", FUSE_EQUAL, FUSE_APART, ("tosa-int", "tosa-fp"), fused="base"),
    Edit("fuse_apart_then_equal", FUSE_APART, FUSE_EQUAL, ("tosa-int", "tosa-fp"), fused="edited"),
]

CASES = [pytest.param(edit, target, id=f"{edit.id}-{target}") for edit in EDITS for target in edit.targets]

# Computed once per test session: stock outputs, and a cache warmed with each base model.
_stock: dict[tuple[str, str], bytes] = {}
_warm: dict[tuple[str, str], tuple[Any, lowercache.Artifacts]] = {}


def stock(model: Model, target: str) -> bytes:
    if (model.name, target) not in _stock:
        _stock[model.name, target] = model.stock(target)
    return _stock[model.name, target]


def warmed_cache(base: Model, target: str, tmp_path_factory: pytest.TempPathFactory, into: Any) -> lowercache.Artifacts:
    """Copy a cache holding exactly the base model's lowering to ``into``; the base's artifacts."""
    if (base.name, target) not in _warm:
        template = tmp_path_factory.mktemp(f"warm-{base.name}-{target}") / "cache"
        artifacts = base.lower(target, template)
        assert outcomes(artifacts, "flow") == ["miss"]
        assert artifacts.pte == stock(base, target)
        _warm[base.name, target] = (template, artifacts)
    template, artifacts = _warm[base.name, target]
    shutil.copytree(template, into)
    return artifacts


def partition_files(artifacts: lowercache.Artifacts, suffix: str) -> list[bytes]:
    return [data for name, data in sorted(artifacts.files.items()) if name.endswith(suffix)]


@pytest.mark.parametrize("edit,target", CASES)
def test_edit_is_never_served_the_base_artifacts(edit: Edit, target: str, tmp_path, tmp_path_factory):
    expected = stock(edit.edited, target)
    assert expected != stock(edit.base, target), "the edit does not change stock's output: the test could not fail"

    base = warmed_cache(edit.base, target, tmp_path_factory, tmp_path / "warm")
    warm = edit.edited.lower(target, tmp_path / "warm")
    assert outcomes(warm, "flow") == ["miss"]
    assert warm.pte == expected
    assert warm.pte != base.pte

    cold = edit.edited.lower(target, tmp_path / "cold")
    assert outcomes(cold, "flow") == ["miss"]
    assert cold.pte == expected
    assert warm.files == cold.files  # every partition artifact too, not only the .pte

    # Where the warm run missed: a partition step may hit only where its bytes are the base's.
    for kind, suffix in (("tosa", ".tosa"), ("vela", ".vela.bin")):
        base_bytes, edited_bytes = partition_files(base, suffix), partition_files(warm, suffix)
        got = outcomes(warm, kind)
        assert len(got) == len(edited_bytes)
        for i, (outcome, data) in enumerate(zip(got, edited_bytes)):
            if i >= len(base_bytes) or data != base_bytes[i]:
                assert outcome == "miss", f"{kind} step {i} hit although its bytes differ from the base's"
    if edit.partition_changes:
        assert "miss" in outcomes(warm, "tosa")
    else:
        assert set(outcomes(warm, "tosa")) == {"hit"}  # a right hit: the .pte above is stock's

    if edit.fused is not None:
        # The merge really happened: the side with equal weights stores one
        # conv weight (4*4*3*3 elements, int8 or float) fewer in its TOSA.
        equal, apart = (base, warm) if edit.fused == "base" else (warm, base)
        assert len(apart.tosa[0]) - len(equal.tosa[0]) >= 4 * 4 * 3 * 3

    counts = warm.manifest["step_counts"].get("qparams", {})
    for outcome, check in edit.qparams.items():
        assert check(counts.get(outcome, 0)), f"qparams {outcome}: {counts}"
