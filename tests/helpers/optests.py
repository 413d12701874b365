"""A few of ExecuTorch's own Arm operator tests, run with pytest in their folder, and their outcomes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import executorch
import pytest

from . import references

OPS = os.path.join(list(executorch.__path__)[0], "backends", "arm", "test", "ops")
# Inputs that are the same in every process (the random ones are drawn unseeded, so their lowerings differ).
TESTS = ["test_abs.py::test_abs_tosa_FP[ones]", "test_abs.py::test_abs_tosa_INT[ones]", "test_relu.py::test_relu_tosa_INT[ramp]"]
PYTEST = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *TESTS]


def outcomes(result: subprocess.CompletedProcess) -> dict[str, str]:
    return _found(result.stdout.decode())


def _found(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^(test_\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", stdout, re.M))


def plain(base: Path) -> tuple[int, dict[str, str]]:
    """The tests run by plain pytest, as the reference: its exit status and outcomes (skipped when the wheel ships none).
    Run once per test run for the same environment (``helpers/references.py``); ``base``: the test's own directory."""
    if not os.path.isdir(OPS):
        pytest.skip("this ExecuTorch wheel ships no Arm op tests")
    result = references.run(PYTEST, cwd=Path(OPS), env=os.environ, outputs=[], places={base: "<tmp>"}, ignore=("__pycache__",),
                            timeout=600)  # the wheel's bytecode is its sources', whose release is in the key
    found = _found(result.stdout)
    assert len(found) == len(TESTS), result.stdout[-2000:]
    return result.returncode, found
