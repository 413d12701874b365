"""The Arm TOSA family: ``tosa-int`` and ``tosa-fp``, lowered by ExecuTorch's TOSA backend to TOSA flatbuffers.

The stock objects are those an Arm export script builds: ``TosaCompileSpec``,
``TOSAPartitioner`` and, for ``tosa-int``, ``TOSAQuantizer`` set with
``get_symmetric_quantization_config()``. ``arm_ethosu`` extends this family
(Ethos-U lowers through TOSA, then Vela).
"""

from __future__ import annotations

from typing import Any

from .family import Target

PROFILES = {"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}
TOSA_MODULE = "executorch.backends.arm.tosa.backend"  # TOSABackend._preprocess


class ArmTosa:
    """TOSA targets; the base of the Arm families (what they share: the quantizer, the TOSA step, the hooks)."""

    name = "arm-tosa"
    title = "TOSA"
    backend = "Arm"
    targets: tuple[str, ...] = tuple(PROFILES)
    options: dict[str, str] = {}
    stack = ("executorch.backends.arm.quantizer", "executorch.backends.arm.tosa.partitioner")
    hook_modules: tuple[str, ...] = (TOSA_MODULE,)
    package = "executorch.backends.arm"
    hooks = "lowercache.lowering.arm"
    warm_up: tuple[str, ...] = ()  # Ethos-U's warm-up runs the TOSA pipeline too
    warm_on_use: tuple[str, ...] = ()
    steps: tuple[str, ...] = ("tosa",)
    renamed_under: tuple[str, ...] = ()
    stock_script = '''
def arm_tosa(target):
    from executorch.backends.arm.quantizer import TOSAQuantizer, get_symmetric_quantization_config
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

    spec = TosaCompileSpec({"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}[target])
    quantizer = None
    if target != "tosa-fp":
        quantizer = TOSAQuantizer(spec)
        quantizer.set_global(get_symmetric_quantization_config())
    return spec, quantizer, TOSAPartitioner
'''

    def quantized(self, target: Target) -> bool:
        return target.name != "tosa-fp"

    def quantization_config(self, target: Target) -> str:
        if not target.quantized:
            return "none"
        return f"get_symmetric_quantization_config(is_per_channel={target.per_channel})"

    def check_option(self, target: str, option: str, value: str) -> None:
        raise AssertionError(f"{self.name} takes no option {option}")

    def compile_spec(self, target: Target) -> Any:
        from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec

        return TosaCompileSpec(PROFILES[target.name])

    def partitioner(self, target: Target, spec: Any) -> Any:
        from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

        return TOSAPartitioner(spec)

    def quantizer(self, target: Target, spec: Any) -> Any:
        from executorch.backends.arm.quantizer import get_symmetric_quantization_config

        quantizer = self._quantizer_class()(spec)
        quantizer.set_global(get_symmetric_quantization_config(is_per_channel=target.per_channel))
        return quantizer

    def _quantizer_class(self) -> Any:
        from executorch.backends.arm.quantizer import TOSAQuantizer

        return TOSAQuantizer

    def files(self, step: str, index: int, blobs: dict[str, bytes]) -> dict[str, bytes]:
        return {f"partition_{index}.tosa": blobs["tosa"]}


FAMILY = ArmTosa()
