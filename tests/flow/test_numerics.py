"""The numerics check (``lower --check``, lowering/check/numerics.py) in process: figures as ExecuTorch's own Arm tester gets them on
the same TOSA, cached, keyed by what they depend on, rejected and killed partitions reported, no lowered byte changed."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import lowercache
from lowercache.bench import models
from lowercache.lowering.check import numerics, numerics_report


def kinds(artifacts, kind: str) -> list[str]:
    return [r["outcome"] for r in artifacts.records if r["kind"] == kind]


def expected_figures(reference: list[torch.Tensor], lowered: list[torch.Tensor]) -> dict:
    """The figures written out independently, in numpy, from the float model's outputs and the tester's."""
    ref = np.concatenate([r.detach().numpy().astype(np.float64).ravel() for r in reference])
    got = np.concatenate([g.detach().numpy().astype(np.float64).ravel() for g in lowered])
    err = got - ref
    found = {
        "max_abs": np.abs(err).max(),
        "mean_abs": np.abs(err).mean(),
        "snr_db": 10 * np.log10((ref ** 2).sum() / (err ** 2).sum()),
        "cosine": (ref @ got) / (np.linalg.norm(ref) * np.linalg.norm(got)),
    }
    agree = [np.argmax(r.numpy(), axis=1) == np.argmax(g.numpy(), axis=1) for r, g in zip(reference, lowered)]
    found["top1"] = np.concatenate(agree).mean()
    return found


def stock_tester_outputs(module, example, calibration, target: str):
    """The stock flow, then each sample run as ExecuTorch's Arm tester runs its ToExecutorch stage: the program under
    TosaReferenceModelDispatch (TOSA targets), or each partition's TOSA through runner_utils.run_tosa_graph (Ethos-U,
    whose delegate holds Vela's stream). Returns the outputs per sample and the partitions' TOSA."""
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, TOSAQuantizer, get_symmetric_quantization_config
    from executorch.backends.arm.test.runner_utils import TosaReferenceModelDispatch, run_tosa_graph
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.backends.arm.tosa.specification import TosaSpecification
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    ep = torch.export.export(module, example)
    ethos = target.startswith("ethos-u")
    spec = EthosUCompileSpec(target) if ethos else TosaCompileSpec("TOSA-1.0+INT")
    quantizer = EthosUQuantizer(spec) if ethos else TOSAQuantizer(spec)
    quantizer.set_global(get_symmetric_quantization_config())
    prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
    for sample in calibration:
        prepared(*sample)
    ep = torch.export.export(convert_pt2e(prepared), example)
    tosa: list[bytes] = []
    if ethos:  # the TOSA Vela is given: ExecuTorch's own hook point, as its tests intercept it
        import executorch.backends.arm.ethosu.backend as ethosu_backend

        original = ethosu_backend.vela_compile

        def keep(tosa_flatbuffer, *args, **kwargs):
            tosa.append(bytes(tosa_flatbuffer))
            return original(tosa_flatbuffer, *args, **kwargs)

        ethosu_backend.vela_compile = keep
    try:
        edge = to_edge_transform_and_lower(ep, partitioner=[(EthosUPartitioner if ethos else TOSAPartitioner)(spec)])
    finally:
        if ethos:
            ethosu_backend.vela_compile = original
    program = edge.to_executorch().exported_program()
    outputs = []
    for sample in [example, *calibration]:
        if not ethos:
            with TosaReferenceModelDispatch():
                outputs.append(program.module()(*sample))
            continue
        (lowered,) = [m for _, m in program.graph_module.named_children() if hasattr(m, "processed_bytes")]
        from torch.overrides import TorchFunctionMode

        class EthosDispatch(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch._higher_order_ops.executorch_call_delegate:
                    output_node = args[0].original_module.graph.output_node()
                    return run_tosa_graph(tosa[0], TosaSpecification.create_from_string("TOSA-1.0+INT"), list(args[1:]), output_node)
                return func(*args, **(kwargs or {}))

        with EthosDispatch():
            outputs.append(program.module()(*sample))
    if not ethos:
        tosa = [bytes(m.processed_bytes) for _, m in program.graph_module.named_children() if hasattr(m, "processed_bytes")]
    return outputs, tosa


@pytest.mark.parametrize("target", ["tosa-int", "ethos-u55-128"])
def test_figures_agree_with_executorch_arm_tester_on_the_same_tosa(tmp_path, target):
    module, example = models.tiny_cnn()
    calibration = models.calibration_samples(example, n=3)
    artifacts = lowercache.lower(module, example, target=target, cache_dir=tmp_path / "c", calibration=calibration, check=True)
    tester, tosa = stock_tester_outputs(module, example, calibration, target)
    assert artifacts.tosa == tosa  # the same TOSA
    with torch.no_grad():
        floats = [module(*s) for s in [example, *calibration]]
    expected = expected_figures(floats, tester)
    (output,) = artifacts.numerics["outputs"]
    assert artifacts.numerics["samples"] == 4 and output["top1_rows"] == 4
    for name, value in expected.items():
        assert output[name] == pytest.approx(float(value), rel=1e-5, abs=1e-9), name
    assert artifacts.manifest["numerics"] == artifacts.numerics
    assert 5 < output["snr_db"] < 80  # quantized: an error, and a sane one


def test_a_warm_check_is_a_hit_and_changes_no_lowered_byte(tmp_path):
    module, example = models.tiny_cnn()
    plain = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path / "plain")
    first = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path / "c", check=True)
    assert first.files == plain.files  # the check is read after the .pte is made
    assert kinds(first, "check") == ["miss"] and kinds(first, "reference") == ["miss"]
    again = lowercache.lower(module, example, target="ethos-u55-128", cache_dir=tmp_path / "c", check=True)
    assert kinds(again, "flow") == ["hit"] and kinds(again, "check") == ["hit"]
    assert kinds(again, "reference") == [] and kinds(again, "quantize") == []  # nothing lowered again, nothing re-run
    assert again.numerics == first.numerics and again.files == first.files


def test_checking_after_a_plain_lowering_serves_the_inner_steps(tmp_path):
    module, example = models.tiny_cnn()
    lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c")
    checked = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check=True)
    assert kinds(checked, "flow") == ["hit"] and kinds(checked, "check") == ["miss"]
    assert set(kinds(checked, "quantize") + kinds(checked, "tosa")) == {"hit"}  # lowered again to run it, all from the cache
    assert checked.numerics["outputs"][0]["snr_db"] > 5


def test_changed_inputs_change_the_key_and_the_figures(tmp_path):
    """tosa-fp does not calibrate, so another calibration set keeps the flow's key: only the check's changes."""
    module, example = models.tiny_cnn()
    cache = tmp_path / "c"
    a = lowercache.lower(module, example, target="tosa-fp", cache_dir=cache, calibration=models.calibration_samples(example, n=2, seed=1), check=True)
    b = lowercache.lower(module, example, target="tosa-fp", cache_dir=cache, calibration=models.calibration_samples(example, n=2, seed=2), check=True)
    assert kinds(b, "flow") == ["hit"] and kinds(b, "check") == ["miss"]
    assert a.numerics["key_parts"]["flow"] == b.numerics["key_parts"]["flow"]
    assert a.numerics["key_parts"]["inputs"] != b.numerics["key_parts"]["inputs"]
    # the example input's run is the same partition on the same input: served; the two new samples ran
    assert kinds(b, "reference") == ["hit", "miss", "miss"]
    assert a.numerics["outputs"][0]["mean_abs"] != b.numerics["outputs"][0]["mean_abs"]
    assert a.numerics["outputs"][0]["snr_db"] > 60  # float TOSA: only rounding differs


def test_a_partition_the_reference_model_rejects_is_reported_not_fatal(tmp_path, monkeypatch):
    """A truncated flatbuffer crashes the reference model (segfault): in its forked child, so the lowering goes on."""
    module, example = models.tiny_cnn()
    original = numerics.Partitions.__init__

    def damaged(self, files, session):
        original(self, files, session)
        self.tosa = [t[: len(t) // 2] for t in self.tosa]

    monkeypatch.setattr(numerics.Partitions, "__init__", damaged)
    artifacts = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check=True)
    assert artifacts.pte  # lowered and returned
    (status,) = artifacts.numerics["partitions"]
    assert status["status"] == "rejected" and "crashed" in status["reason"]
    assert artifacts.numerics["outputs"] == [] and "partition 0" in artifacts.numerics["error"]
    assert numerics_report.worst_snr(artifacts.numerics) == -math.inf
    assert numerics_report.below(artifacts.numerics, None) is None and numerics_report.below(artifacts.numerics, 10.0)
    assert any("rejected by the reference model" in line for line in numerics_report.lines(artifacts.numerics))


def test_a_child_killed_from_outside_is_reported_and_not_stored(tmp_path, monkeypatch):
    """A SIGKILL (the OOM killer) is not the partition's answer: reported this run, run again the next."""
    import signal as signals

    module, example = models.tiny_cnn()
    real_call = numerics._call

    def killed(tosa, arrays):
        os.kill(os.getpid(), signals.SIGKILL)  # in the forked child

    monkeypatch.setattr(numerics, "_call", killed)
    first = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check=True)
    assert "killed (signal 9)" in first.numerics["partitions"][0]["reason"] and first.numerics["outputs"] == []
    monkeypatch.setattr(numerics, "_call", real_call)
    again = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check=True)
    assert kinds(again, "reference") == ["miss"] and again.numerics["outputs"][0]["snr_db"] > 5
