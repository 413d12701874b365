"""The memoized signature mappings equal torch's after every kind of change, and are installed only while active."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export.graph_signature import (
    ConstantArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    TensorArgument,
)

from lowercache.speedups import signature

PROPERTIES = ("inputs_to_parameters", "inputs_to_buffers", "inputs_to_lifted_tensor_constants")
STOCK = {name: vars(ExportGraphSignature)[name].fget for name in PROPERTIES}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))
        self.scale = torch.tensor([2.0])  # a lifted tensor constant

    def forward(self, x):
        return self.linear(x) * self.scale + self.offset


def program_signature() -> ExportGraphSignature:
    return torch.export.export(Model(), (torch.randn(2, 4),)).graph_signature


def check(sig: ExportGraphSignature) -> None:
    for name in PROPERTIES:
        assert list(getattr(sig, name).items()) == list(STOCK[name](sig).items()), name  # order too


def mutations():
    """Each changes what one of the mappings holds."""

    def kind(sig):
        spec = next(s for s in sig.input_specs if s.kind == InputKind.PARAMETER)
        spec.persistent = True
        spec.kind = InputKind.BUFFER

    def arg_name(sig):
        next(s for s in sig.input_specs if s.kind == InputKind.BUFFER).arg.name = "renamed"

    def target(sig):
        next(s for s in sig.input_specs if s.kind == InputKind.PARAMETER).target = "other.weight"

    def arg_type(sig):
        spec = next(s for s in sig.input_specs if s.kind == InputKind.CONSTANT_TENSOR)
        spec.arg = ConstantArgument(name=spec.arg.name, value=1)

    def append(sig):
        sig.input_specs.append(InputSpec(InputKind.BUFFER, TensorArgument("b_new"), "new", persistent=True))

    def insert(sig):
        sig.input_specs.insert(0, InputSpec(InputKind.PARAMETER, TensorArgument("p_new"), "new.weight"))

    def remove(sig):
        sig.input_specs.pop(next(i for i, s in enumerate(sig.input_specs) if s.kind == InputKind.PARAMETER))

    def replace_item(sig):
        i = next(i for i, s in enumerate(sig.input_specs) if s.kind == InputKind.BUFFER)
        sig.input_specs[i] = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument("c_new"), "c")

    def replace_list(sig):
        sig.input_specs = [s for s in sig.input_specs if s.kind != InputKind.BUFFER]

    def reorder(sig):
        sig.input_specs.reverse()

    def raw_dict_write(sig):
        # Writes that bypass __setattr__ on a fresh copy of a spec (as copy.copy does)
        # still replace the object in the list, which the check sees.
        i = next(i for i, s in enumerate(sig.input_specs) if s.kind == InputKind.PARAMETER)
        clone = copy.copy(sig.input_specs[i])
        clone.__dict__["target"] = "cloned.weight"
        sig.input_specs[i] = clone

    return [kind, arg_name, target, arg_type, append, insert, remove, replace_item, replace_list, reorder, raw_dict_write]


@pytest.mark.parametrize("mutate", mutations(), ids=lambda f: f.__name__)
def test_each_change_is_seen(mutate):
    sig = program_signature()
    with signature.active():
        check(sig)
        before = {name: list(getattr(sig, name).items()) for name in PROPERTIES}
        served = signature.stats()["served"]
        check(sig)
        assert signature.stats()["served"] > served  # unchanged: served from the memo
        mutate(sig)
        check(sig)
        assert {name: list(getattr(sig, name).items()) for name in PROPERTIES} != before  # the change mattered


def test_equal_replacement_and_new_signatures():
    sig = program_signature()
    with signature.active():
        check(sig)
        sig.input_specs[0] = copy.deepcopy(sig.input_specs[0])  # equal spec, new object
        check(sig)
        other = copy.deepcopy(sig)  # the memo does not travel with a copy
        other.input_specs[0].arg.name = "copy_only"
        check(other)
        check(sig)
        assert all(getattr(other, name) is not getattr(sig, name) for name in PROPERTIES)


def test_mappings_are_read_only():
    with signature.active():
        mapping = program_signature().inputs_to_buffers
        with pytest.raises(TypeError):
            mapping["x"] = "y"


def test_installed_only_while_active():
    stock_setattr = InputSpec.__setattr__
    with signature.active():
        assert vars(ExportGraphSignature)["inputs_to_buffers"].fget is not STOCK["inputs_to_buffers"]
        assert InputSpec.__setattr__ is not stock_setattr
    assert all(vars(ExportGraphSignature)[name].fget is STOCK[name] for name in PROPERTIES)
    assert InputSpec.__setattr__ is stock_setattr and "__setattr__" not in vars(TensorArgument)


def test_a_lowering_is_served_from_the_memo(tmp_path):
    import lowercache
    from lowercache.config import Settings
    from lowercache.bench.models import tiny_cnn

    module, example = tiny_cnn()
    served = signature.stats()["served"]
    lowercache.lower(module, example, target="tosa-int", settings=Settings(cache_dir=str(tmp_path)))
    assert signature.stats()["served"] > served
