"""``lowercache run`` in front of ExecuTorch's own aot_arm_compiler: the bytes it writes are the plain script's,
cold, confirmed, replayed and after an edit of the model file."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lowercache.cache.store import Store

from tests.helpers import aot
from tests.helpers.aot import AOT, MODEL, PTE


def _run(project, cache_dir, *flags: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", *flags, "--", sys.executable, *AOT], cwd=project,
                            capture_output=True, env=_env(cache_dir), timeout=600)
    assert result.returncode == 0, result.stderr
    return result


def _env(cache_dir) -> dict[str, str]:
    """Without run ahead: whether its runner or the script computes a step depends on timing, and these tests count outcomes."""
    return {**os.environ, "LOWERCACHE_DIR": str(cache_dir), "LOWERCACHE_RUN_AHEAD": "0"}


def test_aot_arm_compiler_is_replayed_byte_for_byte_and_an_edit_runs_again(tmp_path, cache_dir):
    project, expected = aot.project(tmp_path)
    for outcome in ("recorded", "confirmed", "replayed"):
        result = _run(project, cache_dir)
        assert (project / PTE).read_bytes() == expected, outcome
        assert b"NPU operators" in result.stdout  # Vela's summary, printed by the script, replayed too
    assert "latest lookup: hit" in _run(project, cache_dir, "--explain").stdout.decode()
    counters = Store(cache_dir).counters()
    assert counters.get("count/run/hit") == 1 and counters.get("count/tosa/hit") == 1 and counters.get("count/vela/hit") == 1

    aot.write_model(project, "torch.sigmoid")
    edited = aot.plain(project)
    assert edited != expected
    _run(project, cache_dir)
    assert (project / PTE).read_bytes() == edited
    assert "model.py changed" in _run(project, cache_dir, "--explain").stdout.decode()


@pytest.mark.parametrize("export", ["strict", "non-strict"])
def test_the_scripts_re_export_after_convert_is_lowers_step_and_a_weights_edit_hits(tmp_path, cache_dir, export):
    """aot_arm_compiler ends its quantization with ``torch.export.export(convert_pt2e(...), inputs)``, ``lower``'s own
    re-export (strict by default, as ``lower``'s with --non_strict_export): under ``run`` it goes through the
    ``reexport`` step. A re-run is served the stored program and its partition's TOSA step still hits (the served
    program keys as a fresh one, dynamo's metadata included); a weights edit fills the template. Every .pte is the
    plain script's."""
    project = tmp_path / "project"
    project.mkdir()
    seeded = MODEL.replace("ACT", "torch.relu").replace("torch.manual_seed(0)\nModelUnderTest = Tiny().eval()",
                                                        "torch.manual_seed(SEED)\nModelUnderTest = Tiny().eval()\ntorch.manual_seed(0)")
    assert "SEED" in seeded
    command = [*AOT, "--non_strict_export"] if export == "non-strict" else AOT
    expected = {}
    for seed, outcomes in ((1, {"reexport/miss": 1, "tosa/miss": 1}), (1, {"reexport/hit": 1, "tosa/hit": 1}),
                           (2, {"reexport/hit": 2, "tosa/miss": 2})):
        (project / "model.py").write_text(seeded.replace("SEED", str(seed)))
        time.sleep(0.1)
        if seed not in expected:
            expected[seed] = aot.plain(project, command)
        result = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--", sys.executable, *command], cwd=project,
                                capture_output=True, env=_env(cache_dir), timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert (project / PTE).read_bytes() == expected[seed], seed
        counters = Store(cache_dir).counters()
        assert all(counters.get(f"count/{name}") == n for name, n in outcomes.items()), counters
