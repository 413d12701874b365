"""The stock ExecuTorch flow as a user's export script: no lowercache code on the way (the README's flow).

:func:`source` is the script's text: the flow, and each target family's part of it
(``stock_script``: the compile spec, quantizer and partitioner a stock script builds for
the target). The process-level benchmark (``process.py``) writes it into its project
directory and runs it there, so nothing of lowercache is on its import path: it imports
torch, ExecuTorch and torchao only::

    python export.py path/to/model.py:factory ethos-u55-128 out.pte

``factory()`` returns ``(nn.Module, example_inputs)``, as for ``lowercache lower``.
"""

from __future__ import annotations

from ..targets import FAMILIES

_HEAD = '''"""The stock ExecuTorch flow, as a user's export script (written by lowercache's benchmark).

    python export.py path/to/model.py:factory TARGET out.pte
"""

import importlib.util
import sys

import torch
from executorch.exir import to_edge_transform_and_lower
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
'''

_MAIN = '''

def lower(module, example, target):
    ep = torch.export.export(module, example)
    spec, quantizer, partitioner = FAMILY[target](target)
    if quantizer is not None:
        prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
        prepared(*example)
        ep = torch.export.export(convert_pt2e(prepared), example)
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner(spec)])  # after quantization, as stock
    return edge.to_executorch().buffer


def main(model, target, out):
    path, factory = model.rsplit(":", 1)
    spec_ = importlib.util.spec_from_file_location("user_model", path)
    user = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(user)
    module, example = getattr(user, factory)()
    data = lower(module, example, target)
    with open(out, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    main(*sys.argv[1:])
'''


def source() -> str:
    """The stock script's text, with every family's part and the target -> family table."""
    table = ", ".join(f"{t!r}: {f.name.replace('-', '_')}" for f in FAMILIES for t in f.targets)
    return "".join([_HEAD, *(f"\n{f.stock_script}" for f in FAMILIES), f"\n\nFAMILY = {{{table}}}\n", _MAIN])
