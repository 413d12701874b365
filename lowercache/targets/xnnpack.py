"""The XNNPACK family: ``xnnpack`` (fp32) and ``xnnpack-int8``, lowered by ExecuTorch's XNNPACK backend for Arm and x86 CPUs.

The stock objects are those ExecuTorch's XNNPACK documentation builds:
``XnnpackPartitioner()`` with its defaults and, for ``xnnpack-int8``,
``XNNPACKQuantizer`` set with the XNNPACK ``get_symmetric_quantization_config``
(per-channel weights, as the documentation's example; ``--per-tensor`` turns
that off). XNNPACK takes no compile spec: this family's "spec" is the
partitioner's keyword arguments (none: stock's defaults), and its key part
digests the partitioner built from them (``lowering/xnnpack.py``).

The names say the backend and, when quantized, the data type the model runs
in, as the Arm families do (``tosa-int``): ``xnnpack`` alone is what the
documentation calls lowering to XNNPACK (fp32), and ``-int8`` is the 8-bit
flow the same page shows (activations and weights int8).
"""

from __future__ import annotations

from typing import Any

from .family import Target

XNNPACK_MODULE = "executorch.backends.xnnpack.xnnpack_preprocess"  # XnnpackBackend.preprocess
QUANTIZER_MODULE = "executorch.backends.xnnpack.quantizer.xnnpack_quantizer"


class Xnnpack:
    """XNNPACK targets: one delegate per partition, no per-target options."""

    name = "xnnpack"
    title = "XNNPACK"
    backend = "XNNPACK"
    targets: tuple[str, ...] = ("xnnpack", "xnnpack-int8")
    options: dict[str, str] = {}
    stack = ("executorch.backends.xnnpack", QUANTIZER_MODULE)
    hook_modules: tuple[str, ...] = (XNNPACK_MODULE,)
    package = "executorch.backends.xnnpack"
    hooks = "lowercache.lowering.xnnpack"
    warm_up: tuple[str, ...] = ()
    # its quantizer's 12 conv-bn pattern exports are kept by the server once made (speed-up qpatterns)
    warm_on_use: tuple[str, ...] = ("xnnpack-int8",)
    steps: tuple[str, ...] = ("xnnpack",)  # each partition's XnnpackBackend.preprocess
    renamed_under: tuple[str, ...] = ()
    stock_script = '''
def xnnpack(target):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    quantizer = None
    if target == "xnnpack-int8":
        quantizer = XNNPACKQuantizer()
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))
    return None, quantizer, lambda _spec: XnnpackPartitioner()
'''

    def quantized(self, target: Target) -> bool:
        return target.name == "xnnpack-int8"

    def quantization_config(self, target: Target) -> str:
        if not target.quantized:
            return "none"
        return f"XNNPACKQuantizer get_symmetric_quantization_config(is_per_channel={target.per_channel})"

    def check_option(self, target: str, option: str, value: str) -> None:
        raise AssertionError(f"{self.name} takes no option {option}")

    def compile_spec(self, target: Target) -> Any:
        return {}  # XnnpackPartitioner's keyword arguments: stock's defaults

    def partitioner(self, target: Target, spec: Any) -> Any:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return XnnpackPartitioner(**spec)

    def quantizer(self, target: Target, spec: Any) -> Any:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

        quantizer = XNNPACKQuantizer()
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=target.per_channel))
        return quantizer

    def files(self, step: str, index: int, blobs: dict[str, bytes]) -> dict[str, bytes]:
        return {}  # the delegate's payload is inside the .pte


FAMILY = Xnnpack()
