"""What a target family provides: the one protocol each family module (``arm_tosa``, ``arm_ethosu``) implements.

A family is the targets one ExecuTorch backend lowers to, and everything
lowercache needs to know about them: their names and options, the stock
objects a user's export script builds for them (compile spec, quantizer,
partitioner), where lowercache hooks into the backend, the per-partition files
a lowering writes, what ``verify`` allows,
and its part of the benchmark's stock script. Everything but the three stock
objects is plain data, so the CLI and direct mode read it without torch. Which
exact speed-ups are proven on a family is the speed-up registry's to say
(``speedups/registry.py``, each entry's ``families``, by the family's ``name``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


@dataclass(frozen=True)
class Target:
    """One lowering target, named as on the command line, with its family."""

    family: "Family" = field(repr=False, compare=False)
    name: str
    per_channel: bool = True  # weights quantized per channel (the stock default) or per tensor
    system_config: Optional[str] = None  # Vela's system config (None: ExecuTorch's default for the target)
    memory_mode: Optional[str] = None  # Vela's memory mode (None: ExecuTorch's default for the target)

    @property
    def quantized(self) -> bool:
        return self.family.quantized(self)

    @property
    def quantization_config(self) -> str:
        """What the quantizer is configured with; recorded as a key part."""
        return self.family.quantization_config(self)

    def compile_spec(self) -> Any:
        return self.family.compile_spec(self)

    def partitioner(self, spec: Any) -> Any:
        return self.family.partitioner(self, spec)

    def quantizer(self, spec: Any) -> Any:
        return self.family.quantizer(self, spec)


class Family(Protocol):
    """A target family: plain data, and the stock ExecuTorch objects built only when asked (they import torch)."""

    name: str  # "arm-ethosu"
    title: str  # how a message names its targets: "Ethos-U"
    backend: str  # the ExecuTorch backend that lowers them, as a user reads it: "Arm"
    targets: tuple[str, ...]  # the names ``--target`` takes, in the order ``--help`` lists them
    options: dict[str, str]  # the target options it takes beyond ``per_channel`` (Target's fields), each with its flag
    stack: tuple[str, ...]  # the modules a lowering imports (the warm server imports them once)
    hook_modules: tuple[str, ...]  # the backend modules lowercache wraps, named only, so listing them is free
    package: str  # the ExecuTorch package they live in: ``run`` wraps them once no module of it is half imported
    hooks: str  # the lowercache module that wraps them: import_backend, hooks, install_permanently, the spec digests
    warm_up: tuple[str, ...]  # the targets the warm server lowers a tiny model for once, so a child finds the flow warm
    # the same, lowered once the server has served one of the family's targets (or ``server start --target`` named one):
    # a family whose warm-up would lengthen every server's start for users who never lower to it
    warm_on_use: tuple[str, ...]
    steps: tuple[str, ...]  # the per-partition steps (first: the one a partition's tensor names come from)
    renamed_under: tuple[str, ...]  # speed-ups with which a served .tosa may differ from stock's in names (verify)
    # ``def <name with _>(target)`` -> (spec, quantizer or None, partitioner class), for the benchmark's stock script: the
    # partitioner is made after quantization, which can change the spec it serializes (docs/design.md, The flow)
    stock_script: str

    def quantized(self, target: Target) -> bool: ...

    def quantization_config(self, target: Target) -> str: ...

    def check_option(self, target: str, option: str, value: str) -> None:
        """Raise a one-line LowercacheError when ``value`` is no value of ``option`` (one of :attr:`options`)."""

    def compile_spec(self, target: Target) -> Any: ...

    def partitioner(self, target: Target, spec: Any) -> Any: ...

    def quantizer(self, target: Target, spec: Any) -> Any: ...

    def files(self, step: str, index: int, blobs: dict[str, bytes]) -> dict[str, bytes]:
        """The output files of partition ``index``'s ``step`` entry (its blobs), by the names a lowering writes."""
