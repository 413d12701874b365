"""The other supported ExecuTorch release (docs/releases.md): in a venv that holds it beside
this torch, lowercache's bytes equal stock's, cold and warm, and ``lowercache speedups``
says which speed-ups are on there.

The venv is built once under ``~/.cache/lowercache-ci/`` (``LOWERCACHE_CI_VENVS`` moves it)
with ``--system-site-packages``, so it shares this interpreter's torch, tosa-tools and Vela
and installs only the ExecuTorch wheel (about 140 MB, tens of seconds); later runs reuse it.
The tests are skipped, with pip's words, only when the package registry cannot be reached.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lowercache.speedups import registry
from lowercache.targets import family_of
from tests.helpers import ROOT


# The supported releases (pyproject.toml) other than the one installed here, and the
# speed-ups whose pinned sources differ there, so they switch themselves off.
# The default speed-ups each release turns off (its sources differ from the audited ones): on 1.4.1, legalize's
# create_submodule_from_nodes among them.
OTHER_RELEASES = {"1.4.1": {"decompositions", "legalize", "propagate"}, "1.5.0": set()}
# A quantized model through Vela and a float one through TOSA-FP: between them every speed-up has work.
CASES = ("tiny_cnn:ethos-u55-128", "transformer_block:tosa-fp")

VENVS = Path(os.environ.get("LOWERCACHE_CI_VENVS") or Path.home() / ".cache" / "lowercache-ci")
_OFFLINE = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Temporary failure in name resolution|Name or service not known"
    r"|Network is unreachable|Connection refused|No matching distribution found for executorch"
)


def _torch() -> str:
    return importlib.metadata.version("torch").split("+")[0]


def _child_env() -> dict[str, str]:
    """This checkout's lowercache (and tests package) first, whatever the venv's site-packages hold."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1"}


def _build(venv: Path, release: str) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    # torch pinned to this interpreter's: ExecuTorch's wheels are built against one torch,
    # and any other torch would be a multi-gigabyte download.
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--timeout", "60", "--retries", "2",
         f"executorch[ethos-u]=={release}", f"torch=={_torch()}"],
        capture_output=True, text=True,
    )
    if install.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        tail = (install.stdout + install.stderr)[-1500:]
        if _OFFLINE.search(install.stdout + install.stderr):
            pytest.skip(f"the package registry is unreachable, so ExecuTorch {release} cannot be installed: {tail}")
        pytest.fail(f"pip could not install ExecuTorch {release} beside torch {_torch()}:\n{tail}")


@pytest.fixture(scope="module", params=sorted(OTHER_RELEASES))
def release_python(request) -> tuple[str, Path]:
    """(release, the venv's python), built on first use and reused while this interpreter,
    its torch and the release are the same."""
    release = request.param
    VENVS.mkdir(parents=True, exist_ok=True)
    venv = VENVS / f"venv-executorch-{release}"
    want = {"python": sys.version, "base": sys.base_prefix, "torch": importlib.metadata.version("torch"), "executorch": release}
    marker = venv / "lowercache-ready.json"
    with open(VENVS / f"venv-executorch-{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then reuse its venv
        try:
            ready = json.loads(marker.read_text()) == want
        except (OSError, ValueError):
            ready = False
        if not ready:
            shutil.rmtree(venv, ignore_errors=True)
            _build(venv, release)
            marker.write_text(json.dumps(want))
    return release, venv / "bin" / "python"


@pytest.fixture(scope="module")
def lowered(release_python, tmp_path_factory) -> tuple[str, dict]:
    release, python = release_python
    out = tmp_path_factory.mktemp("other-release") / "found.json"
    cache = out.parent / "cache"
    run = subprocess.run(
        [str(python), "-m", "tests.env.other_release_child", str(out), str(cache), *CASES],
        cwd=ROOT, env=_child_env(), capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return release, json.loads(out.read_text())


def test_the_release_installs_beside_this_torch(lowered):
    release, found = lowered
    assert found["versions"]["executorch"] == release
    assert found["versions"]["torch"] == importlib.metadata.version("torch")
    assert Path(found["lowercache"]).resolve().is_relative_to(ROOT)
    assert found["foreign_modules"] == []  # nothing came from this interpreter's own ExecuTorch


@pytest.mark.parametrize("case", CASES)
def test_cold_and_warm_match_stock(lowered, case):
    release, found = lowered
    got = found["cases"][case]
    assert got["cold_flow"] == ["miss"] and got["warm_flow"] == ["hit"]
    assert "tosa" in got["cold_steps"]  # the backend hooks ran on this release
    if case.split(":")[1].startswith("ethos"):
        assert "vela" in got["cold_steps"]
    assert got["cold"] == got["stock"], f"ExecuTorch {release}: lowercache's .pte differs from stock's"
    assert got["warm"] == got["stock"]
    assert got["files_equal"]


def test_speedups_report_on_the_release(lowered, release_python):
    release, found = lowered
    _, python = release_python
    result = subprocess.run(
        [str(python), "-m", "lowercache.cli", "speedups"], cwd=ROOT, env=_child_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"executorch {release}," in result.stdout
    # A row's first line names the speed-up; a long reason wraps onto lines whose name column is blank.
    rows = {line.split()[1]: line for line in result.stdout.splitlines()
            if line.startswith("│ ") and len(line.split()) > 3 and line.split()[1] != "│"}
    states = {name: "off: installed source differs" if "installed source differs" in row else
              "off: disabled by setting" if "disabled by setting" in row else "on" if "│ on " in row else row
              for name, row in rows.items()}
    expected_off = OTHER_RELEASES[release]
    assert states == {name: "off: installed source differs" if name in expected_off else
                      "off: disabled by setting" if name in registry.OPT_IN else "on" for name in rows}
    assert len(rows) == len(found["cases"][CASES[0]]["speedups"])
    # The lowering itself recorded the same states in its manifest; a speed-up proven on another family only is off for it.
    for case in CASES:
        family = family_of(case.split(":")[1]).name
        states = found["cases"][case]["speedups"]
        assert {n for n, s in states.items() if s != "on" and registry.applies(n, family)} <= expected_off | registry.OPT_IN
        assert {s for n, s in states.items() if not registry.applies(n, family)} <= {f"off: not for {family}"}
