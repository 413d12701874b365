"""Key sensitivity: what must change the flow key does; what must not, does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowercache.lowering import arithmetic, flow
from lowercache.bench import models
from lowercache.cache import toolchain
from lowercache.cache.steps import step_key
from lowercache.targets import resolve


def parts_of(module, example, target="ethos-u55-128", calibration=None, per_channel=True):
    program = flow.export(module, example)
    return flow.flow_parts(program, resolve(target, per_channel), example, calibration or [example])


def changed(a, b):
    return sorted(k for k in a if a[k] != b[k])


@pytest.fixture(scope="module")
def base():
    module, example = models.tiny_cnn()
    return module, example, parts_of(module, example)


@pytest.mark.quick
def test_rerun_gives_the_same_key(base):
    module, example, parts = base
    again, example2 = models.tiny_cnn()
    assert parts_of(again, example2) == parts
    assert step_key("flow", parts_of(again, example2)) == step_key("flow", parts)


@pytest.mark.quick
def test_one_weight_changes_constants_only(base):
    module, example, parts = base
    edited, _ = models.tiny_cnn()
    with torch.no_grad():
        edited.get_parameter("block2.0.weight")[0, 0, 0, 0] += 1e-3
    assert changed(parts, parts_of(edited, example)) == ["program.constants"]


def test_target_quantizer_and_calibration_change_the_key(base):
    module, example, parts = base
    assert "target" in changed(parts, parts_of(module, example, target="ethos-u85-256"))
    assert "compile_spec" in changed(parts, parts_of(module, example, target="ethos-u55-256"))
    assert changed(parts, parts_of(module, example, per_channel=False)) == ["quantizer"]
    samples = models.calibration_samples(example)
    assert changed(parts, parts_of(module, example, calibration=samples)) == ["calibration"]


def test_toolchain_version_changes_the_key(base, monkeypatch):
    module, example, parts = base
    fake = dict(toolchain.toolchain_parts(), vela="0.0.0")
    monkeypatch.setattr(arithmetic, "toolchain_parts", lambda: fake)  # what step keys read it through
    assert changed(parts, parts_of(module, example)) == ["vela"]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        hidden = self.conv(x)
        return torch.relu(hidden)


class _NetRenamed(_Net):
    def forward(self, x):
        renamed_local = self.conv(x)
        return torch.relu(renamed_local)


def test_renaming_a_local_variable_keeps_the_key():
    torch.manual_seed(0)
    a = _Net().eval()
    b = _NetRenamed().eval()
    b.load_state_dict(a.state_dict())
    example = (torch.randn(1, 3, 8, 8),)
    assert parts_of(a, example) == parts_of(b, example)


def test_key_is_independent_of_pythonhashseed():
    code = (
        "from lowercache.lowering import flow; from lowercache.bench import models; from lowercache.cache.steps import step_key;"
        "from lowercache.targets import resolve;"
        "m, e = models.tiny_cnn(); p = flow.flow_parts(flow.export(m, e), resolve('tosa-int'), e, [e]);"
        "print(step_key('flow', p))"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**_env(), "PYTHONHASHSEED": seed}
        ).stdout.strip().splitlines()[-1]
        for seed in ("1", "987")
    }
    assert len(keys) == 1


def _env():
    import os

    return dict(os.environ)


def test_keys_cover_lowercaches_own_producing_code():
    """A change to the code of a room that produces results changes every key's toolchain part; the CLI's does not."""

    package = Path(toolchain.__file__).resolve().parent.parent
    before = toolchain.lowercache_digest()
    assert toolchain.toolchain_parts()["lowercache_src"] == before
    probe = package / "speedups" / "_key_probe_for_test.py"

    def digest_with(text: str) -> str:
        probe.write_text(text)
        toolchain.lowercache_digest.cache_clear()
        return toolchain.lowercache_digest()

    try:
        code = digest_with('"""A step."""\nSCALE = 2\n')
        same_code = digest_with('"""A step, its docstring edited."""\n# and a comment\nSCALE = 2  # the same code\n')
        other_code = digest_with('"""A step."""\nSCALE = 3\n')
    finally:
        probe.unlink()
        toolchain.lowercache_digest.cache_clear()
    assert code != before and other_code != code
    assert same_code == code  # a docstring or comment edit keeps every key
    assert toolchain.lowercache_digest() == before
    modules = toolchain.byte_shaping_modules()
    assert "lowering/flow.py" in modules and "cache/steps.py" in modules
    assert not any(m.startswith(("cache/remote/", "cli/", "record/", "run/")) for m in modules)  # transport, CLI, record, run
    assert "cache/store.py" not in modules and "direct.py" not in modules


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the lowercache package to edit, and its byte-shaping digest as it is."""
    import shutil

    package = Path(toolchain.__file__).resolve().parent.parent
    copy = tmp_path / "lowercache"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy, toolchain.package_digest(str(copy), remember=False)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is no longer in {path.name}: choose another line to edit"
    path.write_text(text.replace(old, new, 1))


def test_a_docstring_or_comment_edit_in_a_byte_shaping_module_keeps_the_key(package_copy):
    copy, before = package_copy
    flow_py = copy / "lowering" / "flow.py"
    _edit(flow_py, '"""', '"""An edited docstring.\n\n')
    flow_py.write_text(flow_py.read_text() + "\n# a comment at the end\n")
    assert toolchain.package_digest(str(copy), remember=False) == before


def test_a_code_edit_in_a_byte_shaping_module_changes_the_key(package_copy):
    copy, before = package_copy
    _edit(copy / "lowering" / "flow.py", "\nfrom __future__ import annotations\n", "\nfrom __future__ import annotations\n\nEDITED = 1\n")
    assert toolchain.package_digest(str(copy), remember=False) != before


def test_a_code_edit_outside_the_byte_shaping_modules_keeps_the_key(package_copy):
    """The Redis transport, the CLI and the store move or check bytes; the numerics checks read a lowering and key their
    steps by their own code; they make none, so editing them keeps every key."""
    copy, before = package_copy
    for module in ("cache/remote/redis.py", "cli/commands.py", "cache/store.py", "lowering/check/numerics.py", "lowering/check/numerics_layers.py",
                   "lowering/check/numerics_report.py"):
        _edit(copy / module, "\nfrom __future__ import annotations\n", "\nfrom __future__ import annotations\n\nEDITED = 1\n")
    assert toolchain.package_digest(str(copy), remember=False) == before


_FIRST_AND_LATER_EXPORT = """
import json
from lowercache.bench import models
from benchmarks import pass_census as census
from lowercache.lowering.arm import tosa_parts
from lowercache.lowering.flow import export
from lowercache.targets import resolve

target = resolve("ethos-u55-128", True)
seen = []
for _ in range(2):
    module, example = models.transformer_block()
    edge, spec = census.pipeline_input(export(module, example), target, example, models.calibration_samples(example))
    marks = sum(any(str(k).startswith("_torchdynamo_disable") for k in n.meta.get("custom", {})) for n in edge.graph_module.graph.nodes)
    seen.append({"marks": marks, "parts": tosa_parts(edge, spec)})
print(json.dumps(seen))
"""


def test_a_processs_first_export_keys_its_partition_as_later_ones_do():
    """The first quantized export in a process leaves dynamo-disable marks later ones do not.

    A server's children export after the server's warm-up, a fresh process
    exports first: keyed, the marks made each miss the other's TOSA steps.
    """
    done = subprocess.run([sys.executable, "-c", _FIRST_AND_LATER_EXPORT], capture_output=True, text=True, timeout=600, check=True)
    first, later = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["marks"] != later["marks"], "torch no longer marks the first export; this test has nothing left to show"
    assert first["parts"] == later["parts"]


@pytest.mark.quick
def test_the_numeric_settings_a_run_computes_under_change_the_key(base, monkeypatch):
    """Each setting its own named part, and the canary (``arithmetic``) where the setting moves its sums
    (test_numeric_platform.py shows a thread count moving stock's bytes)."""
    module, example, parts = base

    def changed_with(named: str) -> list[str]:
        now = changed(parts, parts_of(module, example))
        assert named in now and set(now) <= {named, "arithmetic"}, now
        return now

    threads, dtype, precision = torch.get_num_threads(), torch.get_default_dtype(), torch.get_float32_matmul_precision()
    try:
        torch.set_num_threads(threads + 1)
        assert changed_with("intra_op_threads") == ["arithmetic", "intra_op_threads"]  # a sum split over one more thread
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True)
        changed_with("deterministic")
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("medium")
        changed_with("matmul_precision")
        torch.set_float32_matmul_precision(precision)
        if torch.set_flush_denormal(True):  # False where the CPU cannot
            changed_with("flush_denormal")
        torch.set_flush_denormal(False)
        monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
        changed_with("native_env")
        monkeypatch.setenv("OMP_NUM_THREADS", "7")  # a thread count's variable: the count it gives is the part
        changed_with("native_env")
        monkeypatch.delenv("DNNL_MAX_CPU_ISA")
        torch.set_default_dtype(torch.float64)
        assert "default_dtype" in changed(parts, parts_of(module, example))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision(precision)
        torch.set_flush_denormal(False)
        torch.set_default_dtype(dtype)
    assert parts_of(module, example) == parts


@pytest.mark.quick
def test_the_canary_moves_with_what_moves_a_sum_and_only_then():
    """``arithmetic`` is computed, not looked up: the same settings give the same digest, and a thread count (as any
    setting that moves a sum) gives another, though the canary reads no setting."""
    from lowercache.lowering import arithmetic

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = arithmetic.canary()
        torch.set_num_threads(2)
        two = arithmetic.canary()
        assert arithmetic.canary() == two and one != two
        torch.set_num_threads(1)
        assert arithmetic.canary() == one
    finally:
        torch.set_num_threads(threads)


def test_the_numeric_parts_compute_on_real_tensors_under_a_fake_mode_or_another_default_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowercache.lowering import arithmetic

    expected = arithmetic.numeric_parts()
    with FakeTensorMode():
        assert arithmetic.numeric_parts() == expected
    with torch.device("meta"):
        assert arithmetic.numeric_parts() == expected
