"""The peer tier, Arm: a sample of ExecuTorch's own Arm backend tests (shipped in the wheel), tosa_FP, tosa_INT, u55_INT
and u85_INT, under ``lowercache run -- python -m pytest``: the same outcome per test as without it and the same digest
for every delegate payload, cold and warm, with the warm run's TOSA and Vela steps served from the cache.

pytest captures output through file descriptors, which no record can describe, so these runs are never
replayed: they run every time, with the Arm steps cached (``lowercache run --explain`` says so).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lowercache.cache.store import Store

from tests.helpers import optests
from tests.helpers.optests import ARM


@pytest.mark.peer
def test_arm_backend_tests_have_stock_outcomes_and_payloads_under_run(tmp_path, cache_dir):
    stock, cold, warm, moved = optests.against_stock(tmp_path, cache_dir, ARM)
    assert sorted(stock.payloads) == sorted(ARM.tests)  # every test lowered
    assert stock.count("TOSABackend") and stock.count("EthosUBackend")
    for name, run in (("cold", cold), ("warm", warm)):
        assert run.payloads == stock.payloads, (name, optests.differing(stock, run))
        assert (run.status, run.outcomes) == (stock.status, stock.outcomes), name
    partitions, ethos_u = stock.count("TOSABackend") + stock.count("EthosUBackend"), stock.count("EthosUBackend")
    # the warm run: every partition's TOSA and Vela step served
    assert (moved.get("count/tosa/hit"), moved.get("count/vela/hit")) == (partitions, ethos_u), moved
    assert not moved.get("count/tosa/miss") and not moved.get("count/vela/miss"), moved
    # a key is a function of its inputs: the warm run's decompositions are the cold run's, each served
    assert moved.get("count/decomp/hit") and not moved.get("count/decomp/miss"), moved

    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir)}
    explained = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--explain", "--", *ARM.pytest], cwd=ARM.folder,
                               capture_output=True, env=optests.environment(ARM, env, tmp_path / "explain"), timeout=120).stdout.decode()
    # never recorded, so never replayed; the first reason seen depends on the environment (pytest's capture
    # opens file descriptors; in a fresh venv a write into the temp directory may come first)
    assert "latest record: none: the command" in explained, explained
    assert Store(cache_dir).counters().get("count/run/hit") is None
