"""The stock ExecuTorch Arm flow as a user's export script: no lowercache code on the way (the README's flow).

    python stockscript.py path/to/model.py:factory ethos-u55-128 out.pte

``factory()`` returns ``(nn.Module, example_inputs)``, as for ``lowercache lower``. The process-level
benchmark (``process.py``) copies this file into its project directory and runs it there, so nothing of
lowercache is on its import path: it imports torch, ExecuTorch and torchao only.
"""

import importlib.util
import sys

import torch
from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
from executorch.backends.arm.quantizer import EthosUQuantizer, TOSAQuantizer, get_symmetric_quantization_config
from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
from executorch.exir import to_edge_transform_and_lower
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e


def main(model: str, target: str, out: str) -> None:
    path, factory = model.rsplit(":", 1)
    spec_ = importlib.util.spec_from_file_location("user_model", path)
    user = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(user)
    module, example = getattr(user, factory)()
    ep = torch.export.export(module, example)
    ethos = target.startswith("ethos-u")
    spec = EthosUCompileSpec(target) if ethos else TosaCompileSpec({"tosa-int": "TOSA-1.0+INT", "tosa-fp": "TOSA-1.0+FP"}[target])
    if target != "tosa-fp":
        quantizer = EthosUQuantizer(spec) if ethos else TOSAQuantizer(spec)
        quantizer.set_global(get_symmetric_quantization_config())
        prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
        prepared(*example)
        ep = torch.export.export(convert_pt2e(prepared), example)
    partitioner = EthosUPartitioner(spec) if ethos else TOSAPartitioner(spec)
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner])
    with open(out, "wb") as f:
        f.write(edge.to_executorch().buffer)


if __name__ == "__main__":
    main(*sys.argv[1:])
