"""Code the interpreter runs at start is part of every identity: a ``sitecustomize.py`` that appears or changes in a
directory already on ``PYTHONPATH`` changes what every process runs (``lowercache/startup.py``, ``start_code``).

It runs before any audit hook can listen, and the variable ``PYTHONPATH``
does not change: direct mode, the warm server and ``run``'s replay each served
the old behaviour. Each case compares what is served with a fresh run in a
new process (``--no-cache --no-server``, or plain ``python``) after the file
appears, and again after it changes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.server import WAIT, fresh

PY = sys.executable
TARGET = "tosa-fp"

# The model's weights follow what the start-up code set: nothing a recorder hears (no file, no variable).
MODEL = textwrap.dedent(
    """
    import builtins
    import torch

    def model():
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 4)
        with torch.no_grad():
            layer.weight.mul_(getattr(builtins, "SCALE", 1.0))
        return layer.eval(), (torch.ones(1, 4),)
    """
)
SCRIPT = 'import builtins\nopen("out.txt", "w").write(str(getattr(builtins, "SCALE", 1.0)))\n'
SITECUSTOMIZE = "import builtins\nbuiltins.SCALE = {}\n"


def project(server) -> Path:
    """The model and script, and ``tools/`` on PYTHONPATH (empty for now)."""
    (server.project / "model.py").write_text(MODEL)
    (server.project / "script.py").write_text(SCRIPT)
    tools = server.project / "tools"
    tools.mkdir()
    server.env["PYTHONPATH"] += f":{tools}"
    return tools


def lower(server, out: Path, *flags: str, **env: str) -> tuple[bytes, str]:
    result = server("lower", "model.py:model", "-t", TARGET, "-o", str(out), *flags, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return (out / "model.pte").read_bytes(), result.stderr


def fresh_pte(server, base: Path, out: Path) -> bytes:
    """``--no-cache --no-server`` in a new process, shared across the run (``helpers/references.py``): the direct-mode
    and the server case lower the same project under the same start-up code."""
    result = fresh(server, base, "lower", "model.py:model", "-t", TARGET, "-o", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return (out / "model.pte").read_bytes()


def test_direct_mode_serves_what_a_new_sitecustomize_makes(own, tmp_path):
    server = own()
    server.env["LOWERCACHE_SERVER"] = "0"
    tools = project(server)
    plain = fresh_pte(server, tmp_path, tmp_path / "plain")
    for run in range(3):
        served, stderr = lower(server, tmp_path / f"a{run}")
        assert served == plain
    assert "direct mode: served from the record" in stderr
    for scale in (3.0, 5.0):
        (tools / "sitecustomize.py").write_text(SITECUSTOMIZE.format(scale))
        expected = fresh_pte(server, tmp_path, tmp_path / f"fresh{scale}")
        assert expected != plain
        for run in range(1 if scale == 3.0 else 3):  # then recorded, confirmed and served again
            assert lower(server, tmp_path / f"s{scale}-{run}")[0] == expected, (scale, run)
    explained = server("explain", "model.py:model", "-t", TARGET).stdout
    assert "direct mode, latest lookup: hit" in explained, explained


def test_the_server_serves_what_a_new_sitecustomize_makes(own, tmp_path):
    server = own()
    tools = project(server)
    server.start()
    plain = fresh_pte(server, tmp_path, tmp_path / "plain")
    assert lower(server, tmp_path / "a", "--no-direct", "--no-cache")[0] == plain
    for scale in (3.0, 5.0):
        (tools / "sitecustomize.py").write_text(SITECUSTOMIZE.format(scale))
        expected = fresh_pte(server, tmp_path, tmp_path / f"fresh{scale}")
        served, stderr = lower(server, tmp_path / f"s{scale}", "--no-direct", "--no-cache")
        assert served == expected and "warning" not in stderr, (scale, stderr)


def test_run_replays_only_what_the_same_sitecustomize_made(own, tmp_path):
    server = own()
    server.env["LOWERCACHE_SERVER"] = "0"
    tools = project(server)

    def wrapped() -> tuple[str, str]:
        result = subprocess.run([PY, "-m", "lowercache.cli", "run", "--", PY, "script.py"], cwd=server.project,
                                env=server.env, capture_output=True, text=True, timeout=WAIT)
        assert result.returncode == 0, result.stderr[-3000:]
        said = server("run", "--explain", "--", PY, "script.py").stdout
        return (server.project / "out.txt").read_text(), said

    def plain_python() -> str:
        subprocess.run([PY, "script.py"], cwd=server.project, env=server.env, check=True, timeout=WAIT)
        return (server.project / "out.txt").read_text()

    for run in range(3):
        assert wrapped()[0] == "1.0"
    assert "latest lookup: hit" in wrapped()[1]
    for scale in (3.0, 5.0):
        (tools / "sitecustomize.py").write_text(SITECUSTOMIZE.format(scale))
        expected = plain_python()
        assert expected == str(scale)
        for run in range(3):
            assert wrapped()[0] == expected, (scale, run)
