"""The fast free-attribute-name search gives torch's answer, and is installed only while active."""

from __future__ import annotations

import torch
import torch.ao.quantization.fx.utils as ao_utils

from lowercache.speedups import attrnames


def torch_version(prefix):
    original = ao_utils.get_new_attr_name_with_prefix
    assert original is not attrnames.get_new_attr_name_with_prefix
    return original(prefix)


class WithClassAttrs(torch.nn.Module):
    obs_2 = 5  # on the class: taken

    @property
    def obs_4(self):  # a property that raises: not taken, even when the instance dict holds it
        raise AttributeError("obs_4")


class CustomGetattr(torch.nn.Module):
    def __getattr__(self, name):
        if name.startswith("obs_") and int(name[4:]) < 7:
            return 1
        return super().__getattr__(name)


def modules():
    graph_module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    for i in range(0, 40, 1):
        if i % 5 == 3:
            continue
        kind = i % 4
        if kind == 0:
            graph_module.register_buffer(f"obs_{i}", torch.zeros(1))
        elif kind == 1:
            graph_module.register_parameter(f"obs_{i}", None)
        elif kind == 2:
            graph_module.add_module(f"obs_{i}", torch.nn.Identity())
        else:
            setattr(graph_module, f"obs_{i}", i)
    with_class = WithClassAttrs()
    for i in range(6):
        with_class.__dict__[f"obs_{i}"] = i
    return [graph_module, with_class, CustomGetattr(), torch.nn.Module()]


def test_same_names_as_torch():
    for module in modules():
        for prefix in ("obs_", "obs.", "other_", "obs_1"):
            expected = torch_version(prefix)(module)
            assert attrnames.get_new_attr_name_with_prefix(prefix)(module) == expected, (type(module), prefix)


def test_names_follow_registration_like_torch():
    ours, theirs = modules()[0], modules()[0]
    for _ in range(30):
        for module, finder in ((ours, attrnames.get_new_attr_name_with_prefix), (theirs, torch_version)):
            module.register_buffer(finder("obs_")(module), torch.ones(1))
    assert list(ours._buffers) == list(theirs._buffers)


def test_installed_only_while_active():
    import executorch.backends.arm._passes.scalars_to_attribute_pass as holder

    before = holder.get_new_attr_name_with_prefix
    with attrnames.active():
        assert holder.get_new_attr_name_with_prefix is attrnames.get_new_attr_name_with_prefix
        assert ao_utils.get_new_attr_name_with_prefix is attrnames.get_new_attr_name_with_prefix
    assert holder.get_new_attr_name_with_prefix is before
