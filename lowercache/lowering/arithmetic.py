"""The settings a step's own float arithmetic runs under, as key parts: stock computes with this process's settings.

Why each is a part: docs/design.md#what-is-cached.
"""

from __future__ import annotations

import torch


def numeric_parts() -> dict[str, str]:
    """What picks the arithmetic a step's own float computations run (calibration, constant folding), read at each key:
    torch's intra-op thread count (a reduction split over more threads adds in another order: an XNNPACK int8
    attention block lowers to a .pte one byte apart with one thread and with two), the CPU capability its kernels
    dispatch to, whether oneDNN is on, deterministic algorithms, and the default dtype. Stock runs with this process's
    settings, so a step made under others is not this run's. Kept out of :func:`toolchain_parts`: a direct-mode hit
    imports no torch, and its record holds the machine and variables that set these (docs/direct-mode.md)."""
    return {
        "intra_op_threads": str(torch.get_num_threads()),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "onednn": str(torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled)),
        "deterministic": str(torch.are_deterministic_algorithms_enabled()),
        "default_dtype": str(torch.get_default_dtype()),
    }
