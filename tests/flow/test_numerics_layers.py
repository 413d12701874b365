"""The per-layer check (``lower --check=layers``, lowering/check/numerics_layers.py) in process: it names the layer where the
error enters, is cached, serves the same figures however the quantized program was had, and changes no lowered byte."""

from __future__ import annotations

import lowercache
from tests.helpers import lossy
from lowercache.lowering.check import numerics_report


def kinds(artifacts, kind: str) -> list[str]:
    return [r["outcome"] for r in artifacts.records if r["kind"] == kind]


def test_the_table_names_the_lossy_layer_and_a_warm_check_is_a_hit_with_the_same_bytes(tmp_path):
    module, example = lossy.model()
    plain = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "plain")
    cold = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check="layers")
    assert cold.files == plain.files  # the check reads the lowering, after the .pte is made
    assert kinds(cold, "layers") == ["miss"] and kinds(cold, "check") == ["miss"]
    layers = cold.numerics["layers"]
    rows = {r["module"]: r for r in layers["modules"]}
    assert [r["module"] for r in layers["modules"]] == ["conv1", "conv2", "lossy", "conv3", "fc"]  # in the order they run
    assert rows["conv1"]["snr_db"] > 30 and rows["conv2"]["snr_db"] > 30 and rows["lossy"]["snr_db"] < 20
    assert numerics_report.largest_drop(layers)["module"] == "lossy" and rows["lossy"]["drop_db"] > 15
    assert set(layers["key_parts"]) == {"flow", "inputs", "layers"}  # named, for explain
    # the last layer is the program's output: its quantized-model figure is near the TOSA reference model's
    assert abs(rows["fc"]["snr_db"] - cold.numerics["outputs"][0]["snr_db"]) < 3
    assert cold.manifest["numerics"]["layers"] == layers
    assert any(line.startswith("error enters at lossy: SNR drops from") for line in numerics_report.lines(cold.numerics))
    warm = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check="layers")
    assert kinds(warm, "flow") == ["hit"] and kinds(warm, "check") == ["hit"] and kinds(warm, "layers") == ["hit"]
    assert kinds(warm, "quantize") == []  # nothing lowered again
    assert warm.numerics == cold.numerics and warm.files == plain.files


def test_layers_after_a_plain_lowering_serve_the_quantize_step_and_agree_with_a_cold_run(tmp_path):
    """On a flow hit the quantized program comes from the quantize step's entry, not from the lowering just made: the
    figures are the same."""
    module, example = lossy.model()
    cold = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "a", check="layers")
    lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "b", check=True)
    later = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "b", check="layers")
    assert kinds(later, "flow") == ["hit"] and kinds(later, "check") == ["hit"] and kinds(later, "layers") == ["miss"]
    assert kinds(later, "quantize") == ["hit"]
    assert later.numerics["layers"]["modules"] == cold.numerics["layers"]["modules"]


def test_a_float_target_has_no_per_layer_error_to_find(tmp_path):
    module, example = lossy.model()
    found = lowercache.lower(module, example, target="tosa-fp", cache_dir=tmp_path / "c", check="layers")
    assert found.numerics["layers"]["error"].startswith("the target is not quantized")
    assert found.numerics["outputs"]  # the outputs check still runs


def test_a_convolution_whose_batch_norm_is_folded_has_no_row_and_its_block_has_a_sane_one():
    """The quantizer folds a norm into the convolution before it: the convolution's own output is not in the quantized
    program, so comparing it there would show a false drop."""
    import torch

    from lowercache.lowering.check import numerics_layers
    from lowercache.lowering import quantize
    from lowercache.targets import resolve

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    block[1].running_mean.uniform_(-1, 1)
    block[1].running_var.uniform_(0.5, 4)
    module = torch.nn.Sequential(block, torch.nn.Conv2d(8, 4, 3)).eval()
    example = (torch.randn(1, 3, 12, 12),)
    program = torch.export.export(module, example)
    target = resolve("tosa-int")
    quantized = quantize.run_stock(program, target, target.compile_spec(), example, [example])
    rows = {r["module"]: r for r in numerics_layers.compute(program, quantized, [example]).meta["modules"]}
    assert "0.0" not in rows and "0.1" not in rows  # the convolution (folded into) and the norm (folded away)
    assert rows["0"]["snr_db"] > 25 and rows["1"]["snr_db"] > 20


def test_a_failing_per_layer_check_is_said_not_stored_and_never_fails_the_lowering(tmp_path, monkeypatch):
    from lowercache.lowering.check import numerics_layers

    def broken(*args):
        raise RuntimeError("an operator the interpreter cannot run")

    module, example = lossy.model()
    monkeypatch.setattr(numerics_layers, "compute", broken)
    failed = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check="layers")
    assert failed.numerics["layers"]["error"] == "not compared: RuntimeError: an operator the interpreter cannot run"
    assert kinds(failed, "layers") == ["bypass"] and failed.numerics["outputs"] and "model.pte" in failed.files
    monkeypatch.undo()
    again = lowercache.lower(module, example, target="tosa-int", cache_dir=tmp_path / "c", check="layers")
    assert kinds(again, "layers") == ["miss"] and "error" not in again.numerics["layers"]
