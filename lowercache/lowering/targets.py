"""Target names and the stock ExecuTorch objects each one maps to.

A target is a compile spec, a partitioner and, for integer targets, a
quantizer with ``get_symmetric_quantization_config()``. Nothing here is
lowercache-specific: these are the objects a stock Arm export script builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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



@dataclass(frozen=True)
class Target:
    """One lowering target, named as on the command line."""

    name: str
    per_channel: bool = True  # weights quantized per channel (the stock default) or per tensor

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

            return EthosUCompileSpec(self.name)
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


def resolve(name: str, per_channel: bool = True) -> Target:
    """The target called ``name``, or a one-line error listing the known ones."""
    key = name.strip().lower()
    if key not in TARGETS:
        raise LowercacheError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return Target(key, per_channel)
