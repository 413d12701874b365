"""ExecuTorch's own ``aot_arm_compiler`` on a small model file: the command line, its output path and a plain run."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

from . import references

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)
            self.c2 = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.c2(ACT(self.c1(x))))


    torch.manual_seed(0)
    ModelUnderTest = Tiny().eval()
    ModelInputs = (torch.randn(1, 3, 16, 16),)
    """
)
AOT = ["-m", "executorch.backends.arm.scripts.aot_arm_compiler", "--model_name=model.py", "--delegate", "--quantize",
       "--target=ethos-u55-128", "--output=out"]
PTE = "out/model_arm_delegate_ethos-u55-128.pte"


def write_model(project, act: str) -> None:
    (project / "model.py").write_text(MODEL.replace("ACT", act))
    time.sleep(0.1)


def plain(project: Path, aot: list[str] = AOT) -> bytes:
    """The plain script's .pte for the project as it is now, in a new process: run once per test run for the same
    model file, command and environment (``helpers/references.py``); the project is in the test's own directory."""
    result = references.run([sys.executable, *aot], cwd=project, env=os.environ, outputs=[project / PTE],
                            places={project.parent: "<tmp>"}, timeout=600)
    assert result.returncode == 0, result.stderr
    data = (project / PTE).read_bytes()
    (project / PTE).unlink()
    return data


def project(tmp_path: Path) -> tuple[Path, bytes]:
    """A project holding the model with a ReLU, and the plain script's .pte for it."""
    folder = tmp_path / "project"
    folder.mkdir()
    write_model(folder, "torch.relu")
    return folder, plain(folder)
