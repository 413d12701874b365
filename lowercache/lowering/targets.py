"""Target names and the stock ExecuTorch objects each one maps to.

A target is a compile spec, a partitioner and, for integer targets, a
quantizer with ``get_symmetric_quantization_config()``. Nothing here is
lowercache-specific: these are the objects a stock Arm export script builds.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import LowercacheError

TOSA_TARGETS = {"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}
ETHOSU_TARGETS = (
    "ethos-u55-32",
    "ethos-u55-64",
    "ethos-u55-128",
    "ethos-u55-256",
    "ethos-u65-256",
    "ethos-u65-512",
    "ethos-u85-128",
    "ethos-u85-256",
    "ethos-u85-512",
    "ethos-u85-1024",
    "ethos-u85-2048",
)
TARGETS = tuple(TOSA_TARGETS) + ETHOSU_TARGETS
# The Vela config file ExecuTorch's EthosUCompileSpec names by default, and the section kinds the options choose from.
VELA_CONFIG = "Arm/vela.ini"
VELA_OPTIONS = (("--system-config", "System_Config"), ("--memory-mode", "Memory_Mode"))


@dataclass(frozen=True)
class Target:
    """One lowering target, named as on the command line."""

    name: str
    per_channel: bool = True  # weights quantized per channel (the stock default) or per tensor
    system_config: Optional[str] = None  # Vela's system config (None: ExecuTorch's default for the target)
    memory_mode: Optional[str] = None  # Vela's memory mode (None: ExecuTorch's default for the target)

    @property
    def quantization_config(self) -> str:
        """What the quantizer is configured with; recorded as a key part."""
        if not self.quantized:
            return "none"
        return f"get_symmetric_quantization_config(is_per_channel={self.per_channel})"

    @property
    def quantized(self) -> bool:
        return self.name != "tosa-fp"

    @property
    def is_ethosu(self) -> bool:
        return self.name.startswith("ethos-u")

    def compile_spec(self) -> Any:
        if self.is_ethosu:
            from executorch.backends.arm.ethosu import EthosUCompileSpec

            return EthosUCompileSpec(self.name, system_config=self.system_config, memory_mode=self.memory_mode)
        from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec

        return TosaCompileSpec(TOSA_TARGETS[self.name])

    def partitioner(self, spec: Any) -> Any:
        if self.is_ethosu:
            from executorch.backends.arm.ethosu import EthosUPartitioner

            return EthosUPartitioner(spec)
        from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

        return TOSAPartitioner(spec)

    def quantizer(self, spec: Any) -> Any:
        from executorch.backends.arm.quantizer import (
            EthosUQuantizer,
            TOSAQuantizer,
            get_symmetric_quantization_config,
        )

        quantizer = EthosUQuantizer(spec) if self.is_ethosu else TOSAQuantizer(spec)
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=self.per_channel))
        return quantizer


def resolve(name: str, per_channel: bool = True, system_config: Optional[str] = None, memory_mode: Optional[str] = None) -> Target:
    """The target called ``name`` with Vela's options, or a one-line error listing the known targets or option values."""
    key = name.strip().lower()
    if key not in TARGETS:
        raise LowercacheError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    for (flag, kind), value in zip(VELA_OPTIONS, (system_config, memory_mode)):
        if value is None:
            continue
        if not key.startswith("ethos-u"):
            raise LowercacheError(f"{flag} applies to Ethos-U targets only, not {key}")
        known = vela_sections(kind)
        if value not in known:
            raise LowercacheError(f"unknown {flag} {value!r}; Vela's {VELA_CONFIG} has: {', '.join(known) or 'none'}")
    return Target(key, per_channel, system_config, memory_mode)


@functools.cache
def vela_sections(kind: str) -> tuple[str, ...]:
    """The ``[kind.NAME]`` section names of Vela's bundled config file, found without importing Vela (or torch)."""
    spec = importlib.util.find_spec("ethosu")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        try:
            with open(os.path.join(root, "config_files", VELA_CONFIG)) as f:
                text = f.read()
        except OSError:
            continue
        return tuple(re.findall(rf"^\[{kind}\.([^\]]+)\]", text, re.MULTILINE))
    return ()
