"""ExecuTorch's own backend tests (shipped in the wheel), run with pytest in their folder: their outcomes and, through the
``lowercache_peer`` plugin (``helpers/peer/``), the digest of every delegate payload each test made.

A :class:`Sample` is some of one family's tests. ``plain`` runs it as the reference (plain pytest), ``under_run`` under
``lowercache run``; both load the same plugin, which also seeds torch's generator, so each test lowers the same inputs
in every process and its payloads can be compared. ``SMOKE`` is three Arm tests for the tests that only need outcomes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import executorch
import pytest

from . import references

_WHEEL = list(executorch.__path__)[0]
PLUGIN = Path(__file__).resolve().parent / "peer"
DIGESTS = "LOWERCACHE_PEER_DIGESTS"  # the file the plugin writes each payload's digest to
_ARM_TARGETS = ("tosa_FP", "tosa_INT", "u55_INT", "u85_INT")


@dataclass(frozen=True)
class Sample:
    family: str  # as a message names it
    folder: str  # the wheel's test folder pytest runs in
    tests: tuple[str, ...]  # pytest node ids in that folder
    plugin: bool = True  # with the digests plugin (else outcomes only, the command as a user types it)

    @property
    def pytest(self) -> list[str]:
        return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *(["-p", "lowercache_peer"] if self.plugin else []),
                *self.tests]


@dataclass(frozen=True)
class Outcome:
    """One run of a sample: pytest's exit status, each test's outcome, and each test's payloads in the order made
    (backend, sha256 of ``processed_bytes``, sha256 of each named-data buffer)."""

    status: int
    outcomes: dict[str, str]
    payloads: dict[str, list[list]]

    def count(self, backend: str) -> int:
        return sum(row[0] == backend for rows in self.payloads.values() for row in rows)


def differing(expected: Outcome, got: Outcome) -> list[str]:
    """The tests whose payloads in ``got`` are not those of ``expected``."""
    return sorted(t for t in set(expected.payloads) | set(got.payloads) if expected.payloads.get(t) != got.payloads.get(t))


def _arm(stem: str, param: str, quant: str = "") -> list[str]:
    """``stem``'s test for each Arm target family member, at ``param`` (``quant``: the suffix of the quantized ones)."""
    return [f"{stem}_{target}[{param}{'' if target == 'tosa_FP' else quant}]" for target in _ARM_TARGETS]


SMOKE = Sample("Arm", os.path.join(_WHEEL, "backends", "arm", "test", "ops"),
               ("test_abs.py::test_abs_tosa_FP[ones]", "test_abs.py::test_abs_tosa_INT[ones]", "test_relu.py::test_relu_tosa_INT[ramp]"),
               plugin=False)
# Operators that reach much of the Arm pass pipeline (convolution, matmul, normalization, decompositions, table ops);
# some draw random inputs, which the plugin's seed makes the same in every run.
ARM = Sample("Arm", SMOKE.folder, tuple(
    _arm("test_conv2d.py::test_convolution_2d", "2x2_3x2x14x14_nobias_circular", ",per_channel_quant=True")[:3]
    + ["test_conv2d.py::test_convolution_u85_INT[2x2_3x2x14x14_nobias_circular,per_channel_quant=True]"]
    + _arm("test_linear.py::test_linear", "model_linear_rank1_zeros", ",per_channel_quant=True")
    + _arm("test_add.py::test_add_tensor", "5d_float")
    + _arm("test_softmax.py::test_softmax", "ones")
    + _arm("test_layer_norm.py::test_native_layer_norm", "randn_last_dim")
    + _arm("test_mean_dim.py::test_adaptive_avg_pool2d", "zeros")))
# fp32, static int8 (the XNNPACK quantizer and the re-export after convert_pt2e) and dynamic int8 lowerings, some with
# several partitions; the cheaper tests of each kind (a test of the wheel's can lower dozens of shapes).
XNNPACK = Sample("XNNPACK", os.path.join(_WHEEL, "backends", "xnnpack", "test", "ops"), (
    "test_add.py::TestAdd::test_fp32_add_constant", "test_add.py::TestAdd::test_qs8_add_relu_seq",
    "test_conv2d.py::TestConv2d::test_fp32_conv2d_seq", "test_conv2d.py::TestConv2d::test_dq_conv2d_seq",
    "test_conv2d.py::TestConv2d::test_fp32_conv2d_bn_hardtanh_mean_sequence",
    "test_avgpool2d.py::TestAvgPool2d::test_fp32_avgpool2d", "test_sigmoid.py::TestSigmoid::test_fp32_sigmoid"))
OPS, PYTEST = SMOKE.folder, SMOKE.pytest


def outcomes(result: subprocess.CompletedProcess) -> dict[str, str]:
    return _found(result.stdout if isinstance(result.stdout, str) else result.stdout.decode())


def _found(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^(\S+\.py::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", stdout, re.M))


def environment(sample: Sample, base: dict[str, str], digests: Path) -> dict[str, str]:
    """``base`` with the plugin importable and its output file named (when the sample loads it)."""
    if not sample.plugin:
        return base
    path = os.pathsep.join(p for p in (str(PLUGIN), base.get("PYTHONPATH", "")) if p)
    return {**base, "PYTHONPATH": path, DIGESTS: str(digests)}


def _payloads(path: Path) -> dict[str, list[list]]:
    found: dict[str, list[list]] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        row = json.loads(line)
        found.setdefault(row["test"], []).append([row["backend"], row["payload"], row["data"]])
    return found


def _outcome(sample: Sample, result: subprocess.CompletedProcess, digests: Path) -> Outcome:
    found = outcomes(result)
    assert len(found) == len(sample.tests), (result.stdout if isinstance(result.stdout, str) else result.stdout.decode())[-3000:]
    return Outcome(result.returncode, found, _payloads(digests))


def _skip_without(sample: Sample) -> None:
    if not os.path.isdir(sample.folder):
        pytest.skip(f"this ExecuTorch wheel ships no {sample.family} tests")


def plain(base: Path, sample: Sample = SMOKE) -> Outcome:
    """The sample run by plain pytest, as the reference (skipped when the wheel ships no such tests). Run once per test
    run for the same environment (``helpers/references.py``); ``base``: the test's own directory."""
    _skip_without(sample)
    digests = base / f"plain-{sample.family}.digests"
    outputs = [digests] if sample.plugin else []
    result = references.run(sample.pytest, cwd=Path(sample.folder), env=environment(sample, dict(os.environ), digests), outputs=outputs,
                            places={base: "<tmp>"}, ignore=("__pycache__",), timeout=900)  # bytecode follows its sources
    return _outcome(sample, result, digests)


def under_run(base: Path, sample: Sample, env: dict[str, str], name: str) -> Outcome:
    """The sample run under ``lowercache run`` with ``env`` (its cache), as ``name``."""
    digests = base / f"{name}-{sample.family}.digests"
    result = subprocess.run([sys.executable, "-m", "lowercache.cli", "run", "--", *sample.pytest], cwd=sample.folder,
                            capture_output=True, env=environment(sample, env, digests), timeout=900)
    return _outcome(sample, result, digests)


def _counters(cache_dir: Path) -> dict[str, int]:
    from lowercache.cache.store import Store

    return {k: v for k, v in Store(cache_dir).counters().items() if k.startswith("count/")}


def against_stock(base: Path, cache_dir: Path, sample: Sample) -> tuple[Outcome, Outcome, Outcome, dict[str, int]]:
    """The sample run plain, then under ``lowercache run`` cold and warm with one cache (every default speed-up on):
    the three runs, and the step counters the warm run moved (``count/<kind>/<hit|miss>``)."""
    stock = plain(base, sample)
    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir), "LOWERCACHE_RUN_AHEAD": "0"}  # exact counts: no runner's timing
    cold = under_run(base, sample, env, "cold")
    before = _counters(cache_dir)
    warm = under_run(base, sample, env, "warm")
    moved = {k: v - before.get(k, 0) for k, v in _counters(cache_dir).items() if v != before.get(k, 0)}
    return stock, cold, warm, moved
