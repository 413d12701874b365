"""ExecuTorch's own Arm operator tests (shipped in the wheel) under ``lowercache run -- python -m pytest``:
the same outcome per test as without it, cold and warm, with the warm run's TOSA steps served from the cache.

pytest captures output through file descriptors, which no record can describe, so these runs are never
replayed: they run every time, with the Arm steps cached (``lowercache run --explain`` says so).
"""

from __future__ import annotations

import os
import subprocess
import sys


from lowercache.cache.store import Store

from tests.helpers import optests
from tests.helpers.optests import OPS, PYTEST, TESTS, outcomes


def test_arm_op_tests_have_the_same_outcomes_under_run(tmp_path, cache_dir):
    status, expected = optests.plain(tmp_path)
    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir), "LOWERCACHE_RUN_AHEAD": "0"}  # exact counts: no runner's timing
    for run in ("cold", "warm"):
        result = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--", *PYTEST], cwd=OPS, capture_output=True,
                                env=env, timeout=600)
        assert (result.returncode, outcomes(result)) == (status, expected), run
    counters = Store(cache_dir).counters()
    assert counters.get("count/tosa/hit") == counters.get("count/tosa/miss") == len(TESTS)  # the warm run: every partition served
    explained = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--explain", "--", *PYTEST], cwd=OPS,
                               capture_output=True, env=env, timeout=120).stdout.decode()
    # never recorded, so never replayed; the first reason seen depends on the environment (pytest's capture
    # opens file descriptors; in a fresh venv a write into the temp directory may come first)
    assert "latest record: none: the command" in explained, explained
    assert Store(cache_dir).counters().get("count/run/hit") is None
