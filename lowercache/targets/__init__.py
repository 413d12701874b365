"""Target families: one module per ExecuTorch backend family behind one protocol (``family.Family``).

:data:`FAMILIES` is the registry: the CLI's target list and help, name
resolution, and every place that asks what a target's family does, read it.
A new family is a module with a ``FAMILY`` and one line here.
"""

from __future__ import annotations

from typing import Optional

from ..errors import LowercacheError
from . import arm_ethosu, arm_tosa, xnnpack
from .family import Family, Target

FAMILIES: tuple[Family, ...] = (arm_tosa.FAMILY, arm_ethosu.FAMILY, xnnpack.FAMILY)
TARGETS: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.targets)
_FAMILY_OF = {t: f for f in FAMILIES for t in f.targets}

__all__ = ["FAMILIES", "TARGETS", "Family", "Target", "family_of", "help_text", "resolve"]


def family_of(target: str) -> Family:
    """The family of a known target name."""
    return _FAMILY_OF[target]


def help_text() -> str:
    """``--target``'s help: every target, those that differ in a number only grouped (``ethos-u55-32/64/128/256``)."""
    groups: dict[str, list[str]] = {}
    for name in TARGETS:
        stem, _, number = name.rpartition("-")
        groups.setdefault(stem if number.isdigit() else name, []).append(number)
    return ", ".join(stem if stem in TARGETS else f"{stem}-{'/'.join(numbers)}" for stem, numbers in groups.items()) + "."


def resolve(name: str, per_channel: bool = True, system_config: Optional[str] = None, memory_mode: Optional[str] = None) -> Target:
    """The target called ``name`` with its options, or a one-line error listing the known targets or option values."""
    key = name.strip().lower()
    if key not in TARGETS:
        raise LowercacheError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    family = _FAMILY_OF[key]
    for option, value in (("system_config", system_config), ("memory_mode", memory_mode)):
        if value is None:
            continue
        if option not in family.options:
            owner = next(f for f in FAMILIES if option in f.options)
            raise LowercacheError(f"{owner.options[option]} applies to {owner.title} targets only, not {key}")
        family.check_option(key, option, value)
    return Target(family, key, per_channel, system_config, memory_mode)
