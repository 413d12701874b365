"""An exact, fast ``get_new_attr_name_with_prefix``: a name held in the module's own attribute dicts is taken, so the quadratic ``hasattr`` scan runs only where the answer is not certain.

Why it is exact, and figures: docs/speedups.md#attrnames.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from .patching import AttributePatch

# Modules that hold the function under its own name (imported with ``from``).
_HOLDERS = (
    "torch.ao.quantization.fx.utils",
    "torch.ao.quantization.fx.prepare",
    "torchao.quantization.pt2e.utils",
    "executorch.backends.arm._passes.deduplicate_get_attr_pass",
    "executorch.backends.arm._passes.scalars_to_attribute_pass",
)
_NAME = "get_new_attr_name_with_prefix"


def _slow_name(prefix: str, module: torch.nn.Module) -> str:
    i = 0
    while hasattr(module, prefix + str(i)):
        i += 1
    return prefix + str(i)


def get_new_attr_name_with_prefix(prefix: str) -> Callable[[torch.nn.Module], str]:
    """Same contract as torch's: a function giving the first unused ``prefix<i>``."""
    prefix = prefix.replace(".", "_")

    def get_new_attr_name(module: torch.nn.Module) -> str:
        cls = type(module)
        if cls.__getattr__ is not torch.nn.Module.__getattr__ or cls.__getattribute__ is not object.__getattribute__:
            return _slow_name(prefix, module)
        taken = set(module.__dict__).union(module._parameters, module._buffers, module._modules)
        taken.difference_update(*map(vars, cls.__mro__))  # a class attribute may shadow or raise: ask hasattr
        i = 0
        name = prefix + "0"
        while name in taken or hasattr(module, name):
            i += 1
            name = prefix + str(i)
        return name

    return get_new_attr_name


_patch = AttributePatch(lambda: [importlib.import_module(m) for m in _HOLDERS], _NAME, get_new_attr_name_with_prefix)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
