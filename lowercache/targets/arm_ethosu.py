"""The Arm Ethos-U family: ``ethos-u55-*``, ``ethos-u65-*``, ``ethos-u85-*``, lowered through TOSA to Vela's command streams.

The stock objects are ``EthosUCompileSpec`` (with Vela's ``system_config``
and ``memory_mode`` when given), ``EthosUPartitioner`` and ``EthosUQuantizer``.
A lowering writes each partition's TOSA and Vela's output (command stream,
summary text and CSVs). Region replay (the ``regions`` speed-up) acts on these
targets only; with it on, a served ``.tosa`` may differ from stock's in tensor
names and constant order, which Vela's stream does not reach.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any

from ..errors import LowercacheError
from .arm_tosa import ArmTosa, TOSA_MODULE
from .family import Target

TARGETS = (
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
ETHOSU_MODULE = "executorch.backends.arm.ethosu.backend"  # vela_compile, imported by name
# The temporary directory a Vela compile step writes its files in: lowercache's own, never a recorded command's output.
VELA_SCRATCH_PREFIX = "lowercache-vela-"
# The Vela config file ExecuTorch's EthosUCompileSpec names by default, and the section kind each option chooses from.
VELA_CONFIG = "Arm/vela.ini"
VELA_SECTIONS = {"system_config": "System_Config", "memory_mode": "Memory_Mode"}


class ArmEthosU(ArmTosa):
    """Ethos-U targets: the TOSA family's flow with Ethos-U's objects, and Vela after each partition's TOSA."""

    name = "arm-ethosu"
    title = "Ethos-U"
    targets = TARGETS
    options = {"system_config": "--system-config", "memory_mode": "--memory-mode"}
    stack = ("executorch.backends.arm.ethosu", "executorch.backends.arm.quantizer")
    hook_modules = (TOSA_MODULE, ETHOSU_MODULE)
    warm_up = ("ethos-u55-128",)
    warm_on_use: tuple[str, ...] = ()
    steps = ("tosa", "vela")
    renamed_under = ("regions",)
    stock_script = '''
def arm_ethosu(target):
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, get_symmetric_quantization_config

    spec = EthosUCompileSpec(target)
    quantizer = EthosUQuantizer(spec)
    quantizer.set_global(get_symmetric_quantization_config())
    return spec, quantizer, EthosUPartitioner
'''

    def quantized(self, target: Target) -> bool:
        return True

    def check_option(self, target: str, option: str, value: str) -> None:
        known = vela_sections(VELA_SECTIONS[option])
        if value not in known:
            raise LowercacheError(f"unknown {self.options[option]} {value!r}; Vela's {VELA_CONFIG} has: {', '.join(known) or 'none'}")

    def compile_spec(self, target: Target) -> Any:
        from executorch.backends.arm.ethosu import EthosUCompileSpec

        return EthosUCompileSpec(target.name, system_config=target.system_config, memory_mode=target.memory_mode)

    def partitioner(self, target: Target, spec: Any) -> Any:
        from executorch.backends.arm.ethosu import EthosUPartitioner

        return EthosUPartitioner(spec)

    def _quantizer_class(self) -> Any:
        from executorch.backends.arm.quantizer import EthosUQuantizer

        return EthosUQuantizer

    def files(self, step: str, index: int, blobs: dict[str, bytes]) -> dict[str, bytes]:
        if step == "tosa":
            return super().files(step, index, blobs)
        out = {}
        for name, data in blobs.items():
            if name == "command_stream":
                out[f"partition_{index}.vela.bin"] = data
            elif name == "summary.txt":
                out[f"partition_{index}.vela_summary.txt"] = data
            elif name.startswith("output/"):
                out[f"partition_{index}.vela_{name[len('output/'):]}"] = data
        return out


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


FAMILY = ArmEthosU()
