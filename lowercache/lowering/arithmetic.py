"""The settings a step's own float arithmetic runs under, as key parts: stock computes with this process's settings.

Why each is a part: docs/design.md#what-is-cached.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..cache.digests import digest, digest_json
from ..cache.toolchain import toolchain_parts

# Variables the native math libraries read for their own arithmetic (instruction sets, reproducibility modes, reduction
# order, scheduling), by prefix; the thread-count ones are left out, since the count they give is a part of its own.
NATIVE_PREFIXES = ("DNNL_", "ONEDNN_", "MKL_", "KMP_", "OMP_", "GOMP_", "OPENBLAS_")
THREAD_COUNT = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"})


def step_parts() -> dict[str, str]:
    """What a step computes with, for its key: the toolchain (code and versions) and the numeric settings."""
    return {**toolchain_parts(), **numeric_parts()}


def numeric_parts() -> dict[str, str]:
    """What picks the arithmetic a step's own float computations run (calibration, constant folding), read at each key:
    torch's intra-op thread count (a reduction split over more threads adds in another order: a small attention block
    lowers to a .pte one byte apart with one thread and with two), the CPU capability its kernels dispatch to, oneDNN,
    deterministic algorithms, float32 matmul precision, whether denormals are flushed, the default dtype, and the
    native math libraries' variables; and ``arithmetic``, the bytes of a few computations like a lowering's own, for
    whatever setting no name here covers. Stock runs with this process's settings, so a step made under others is not this
    run's. Not in ``toolchain_parts``: a direct-mode hit imports no torch, and its record holds the machine and the
    whole environment instead (docs/direct-mode.md)."""
    return {**named_parts(), "arithmetic": canary()}


def named_parts() -> dict[str, str]:
    """The settings ``numeric_parts`` knows by name."""
    native = sorted((k, v) for k, v in os.environ.items() if k.startswith(NATIVE_PREFIXES) and k not in THREAD_COUNT)
    return {
        "intra_op_threads": str(torch.get_num_threads()),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "onednn": str(torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled)),
        "deterministic": str(torch.are_deterministic_algorithms_enabled()),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "flush_denormal": str(_flushes_denormals()),
        "default_dtype": str(torch.get_default_dtype()),
        "native_env": digest_json(native) if native else "none",
    }


def _flushes_denormals() -> bool:
    """Whether ``torch.set_flush_denormal(True)`` is in force (torch has no getter): a denormal float32 times one."""
    with _disable_current_modes():
        return bool(_denormal_product().item() == 0.0)


def _denormal_product() -> torch.Tensor:
    """A denormal float32 times one: zero where denormals are flushed."""
    return torch.tensor([1e-39], dtype=torch.float32, device="cpu") * 1.0


# The canary's input: 2**17 values, four of torch's parallel grains (32,768), so a sum splits over up to four threads.
_CANARY_SIZE = 1 << 17


def canary() -> str:
    """A digest of a few float computations of the kinds a lowering makes (a parallel sum, a matrix product, a
    convolution, a softmax, an exponential, a denormal product) on fixed inputs, computed now: a check that does not
    depend on knowing every setting. Whatever moves these results (a thread count, an instruction set, a library's
    mode, one no name above covers) moves the key. Computed at each key, with no memo: a memo would need to know what
    invalidates it. About half a millisecond. Real CPU tensors even under a fake mode or another default device."""
    with _disable_current_modes(), torch.no_grad():
        x = torch.arange(_CANARY_SIZE, dtype=torch.float32, device="cpu").mul_(0.6180339887).frac_().sub_(0.5)
        a, b = x[: 64 * 128].view(64, 128), x[-128 * 64 :].view(128, 64)
        image, weight = x[: 8 * 16 * 16].view(1, 8, 16, 16), x[: 8 * 8 * 9].view(8, 8, 3, 3)
        results = (
            x.sum(),
            a @ b,
            torch.nn.functional.conv2d(image, weight, padding=1),
            torch.softmax(a, dim=-1),
            x[:4096].exp(),
            _denormal_product(),
        )
        return digest(b"".join(r.contiguous().numpy().tobytes() for r in results))
