"""One-layer weights edits of a small keyword-spotting CNN through a warm server, as whole commands (issue 53).

    python benchmarks/server_edit.py [--target ethos-u55-128] [--edits 4] [--tree DIR]

A five-block DS-CNN (a convolution, four depthwise-separable blocks, a pool
and a linear layer; 1x49x10 input) is written into a new project directory,
a warm server is started for it in a home of its own (``HOME``,
``XDG_RUNTIME_DIR``), and ``lowercache lower`` runs once cold and then once
per edit, each edit scaling one pointwise convolution's weights (a line of
the model file changes, as a user's edit would). Each command's wall seconds
and the stages of its ``manifest.json`` are printed, and the backstop's
calls in the server's child. ``--tree DIR``: run another checkout of
lowercache (``PYTHONPATH``), to compare two trees with the same
environment. Take the figures on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = '''"""A small keyword-spotting CNN (DS-CNN shape). Seeded."""
import torch
from torch import nn

EDIT = 0


def _ds(c):
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.ReLU())


class DSCNN(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, (10, 4), stride=(2, 2), padding=(5, 1)), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[_ds(c) for _ in range(4)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, 12)

    def forward(self, x):
        return self.fc(self.pool(self.blocks(self.stem(x))).flatten(1))


def model():
    torch.manual_seed(0)
    net = DSCNN().eval()
    if EDIT:
        with torch.no_grad():
            net.blocks[2][3].weight.mul_(1.0 + 0.01 * EDIT)
    return net, (torch.randn(1, 1, 49, 10),)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="ethos-u55-128")
    parser.add_argument("--edits", type=int, default=4)
    parser.add_argument("--tree", type=Path, default=None, help="another lowercache checkout to run (PYTHONPATH)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="lowercache-server-edit-"))
    run = base / "run"
    run.mkdir(mode=0o700)
    project = base / "project"
    (project / ".git").mkdir(parents=True)
    model = project / "kws.py"
    model.write_text(MODEL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
    env.update(HOME=str(base / "home"), XDG_RUNTIME_DIR=str(run), XDG_CACHE_HOME=str(base / "home" / ".cache"))
    if args.tree is not None:
        env["PYTHONPATH"] = str(args.tree.resolve())
    command = [sys.executable, "-m", "lowercache.cli"]
    try:
        subprocess.run([*command, "server", "start"], env=env, cwd=project, check=True, capture_output=True, timeout=600)
        for edit in range(args.edits + 1):
            model.write_text(re.sub(r"^EDIT = .*$", f"EDIT = {edit}", model.read_text(), flags=re.M))
            started = time.perf_counter()
            subprocess.run([*command, "lower", "kws.py:model", "-t", args.target, "-o", "out"], env=env, cwd=project,
                           check=True, capture_output=True, timeout=900)
            seconds = time.perf_counter() - started
            manifest = json.loads((project / "out" / "manifest.json").read_text())
            stages = " ".join(f"{k} {v:.2f}" for k, v in manifest.get("stages", {}).items())
            calls = manifest.get("backstop", {}).get("calls")
            print(f"{'cold' if edit == 0 else f'edit {edit}'}: {seconds:.2f} s ({stages}; backstop calls {calls})", flush=True)
    finally:
        subprocess.run([*command, "server", "stop"], env=env, cwd=project, capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
