"""A user's module named like one lowercache's dependencies import (issue 40, section 5).

``colorsys.py`` on ``PYTHONPATH`` made every command that loads typer (rich
imports ``colorsys``) die with a traceback, while the user's plain
``python s.py`` worked. lowercache's own imports must not pick up the user's
module, and the user's code run later in the same process must still get it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from tests.helpers import ROOT


# Has what torch's imports take from colorsys (mpmath: hsv_to_rgb, hls_to_rgb), lacks what rich.color takes (rgb_to_hls).
USER_COLORSYS = "WIDTH = 12\n\ndef hls_to_rgb(h, l, s):\n    return (l, l, l)\n\nhsv_to_rgb = hls_to_rgb\n"
MODEL = """
import colorsys
import torch

def model():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, colorsys.WIDTH, 3)
    return torch.nn.Sequential(conv, torch.nn.ReLU()).eval(), (torch.randn(1, 3, 8, 8),)
"""
STOCK = """
import sys
sys.path.insert(0, sys.argv[1])
from model import model
from tests.helpers.oracle import stock_pte
sys.stdout.buffer.write(stock_pte(*model(), "tosa-int"))
"""


def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    user = tmp_path / "userlib"
    user.mkdir()
    (user / "colorsys.py").write_text(USER_COLORSYS)
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.py").write_text(MODEL)
    (work / "s.py").write_text("import colorsys\nprint('width', colorsys.WIDTH)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), str(ROOT)]), "LOWERCACHE_DIR": str(tmp_path / "cache"),
           "LOWERCACHE_SERVER": "0"}
    return work, env


def lc(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowercache.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_commands_that_load_typer_work_beside_a_shadowing_module(tmp_path):
    work, env = project(tmp_path)
    plain = subprocess.run([sys.executable, "s.py"], env=env, cwd=work, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout == "width 12\n", plain.stderr
    for args in (["run", "--explain", "--", sys.executable, "s.py"], ["stats"], ["config"], ["run", "--out", "o", "--", sys.executable, "s.py"]):
        result = lc(*args, env=env, cwd=work)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr, args
    assert result.stdout == "width 12\n"  # the script run under ``run`` got the user's module


def test_the_factory_in_the_same_process_gets_the_users_module(tmp_path):
    """lowercache's imports (rich) took the standard library's colorsys; the factory, run later in the process, the user's."""
    work, env = project(tmp_path)
    result = lc("lower", "model.py:model", "-t", "tosa-int", "-o", str(tmp_path / "out"), "--no-server", "--no-cache", env=env, cwd=work)
    assert result.returncode == 0, result.stderr[-2000:]
    stock = subprocess.run([sys.executable, "-c", STOCK, str(work)], env=env, cwd=ROOT, capture_output=True, timeout=600)
    assert stock.returncode == 0, stock.stderr[-2000:]
    assert (tmp_path / "out" / "model.pte").read_bytes() == stock.stdout


def test_a_module_nobody_shadows_is_kept(tmp_path):
    """Only modules the user's path resolves elsewhere are forgotten: the rest stay imported once."""
    code = ("import sys; from lowercache.shadowing import own_imports\n"
            "with own_imports():\n    import colorsys, wave\n"
            "print('colorsys' in sys.modules, 'wave' in sys.modules)\n"
            "import colorsys; print(colorsys.WIDTH)\n")
    user = tmp_path / "user"  # the interpreter writes its bytecode beside the user's module: never in the checkout
    user.mkdir()
    (user / "colorsys.py").write_text(USER_COLORSYS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "12"]
