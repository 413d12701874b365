"""The numerics check (``lower --check``, lowering/numerics.py): figures as ExecuTorch's own Arm tester gets them, cached,
keyed by what they depend on, a rejected partition reported, no lowered byte changed, direct mode without torch."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import lowercache
from lowercache.bench import models
from lowercache.lowering import numerics


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
    assert numerics.worst_snr(artifacts.numerics) == -math.inf
    assert numerics.below(artifacts.numerics, None) is None and numerics.below(artifacts.numerics, 10.0)
    assert any("rejected by the reference model" in line for line in numerics.lines(artifacts.numerics))


def test_a_refusal_is_a_reason_not_an_exception():
    assert "Incorrect number of input arrays" in numerics.reference_run(b"\0" * 64, []) or numerics.reference_run(b"\0" * 64, [])
    said = numerics.reference_run(b"\0" * 64, [np.zeros((1, 3), np.int8)])
    assert isinstance(said, str) and said


def test_figures_of_an_exact_match_and_of_a_zero_output():
    same = [torch.ones(2, 4)]
    exact = numerics.figures(same, same)
    assert exact["snr_db"] is None and exact["cosine"] == 1.0 and exact["max_abs"] == 0.0 and exact["top1"] == 1.0
    assert numerics.snr_text(exact["snr_db"]) == "inf"
    zero = numerics.figures([torch.zeros(3)], [torch.ones(3)])
    assert zero["snr_db"] == -999.0 and "top1" not in zero and zero["cosine"] == 0.0


def _cli(cwd, cache, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
    env.update({"LOWERCACHE_DIR": str(cache), "LOWERCACHE_SERVER": "0", "LOWERCACHE_CONFIG": str(cwd / "none.toml")})
    return subprocess.run([sys.executable, "-m", "lowercache.cli", "lower", "tiny.py:model", "-t", "ethos-u55-128", "-o", "out", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_cli_check_direct_mode_hit_prints_the_figures_without_torch_and_min_snr_fails_only_when_asked(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / "tiny.py").write_text("from lowercache.bench import models\n\ndef model():\n    return models.tiny_cnn()\n")
    cache = tmp_path / "cache"
    for _ in range(2):  # record, confirm
        run = _cli(tmp_path, cache, "--check")
        assert run.returncode == 0, run.stderr[-2000:]
    cold = json.loads((tmp_path / "out" / "manifest.json").read_text())["numerics"]
    run = _cli(tmp_path, cache, "--check", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["direct"] == {"outcome": "hit", "torch_imported": False}
    assert manifest["numerics"] == cold and summary["numerics"]["outputs"] == cold["outputs"]
    assert "input): output 0 (1, 10): SNR" in run.stderr
    snr = cold["outputs"][0]["snr_db"]
    low = _cli(tmp_path, cache, "--check", "--min-snr", f"{snr - 1:.1f}")
    assert low.returncode == 0, low.stderr[-2000:]
    high = _cli(tmp_path, cache, "--min-snr", f"{snr + 1:.1f}")  # --min-snr implies --check
    assert high.returncode == 1 and f"below --min-snr {snr + 1:.1f} dB" in high.stderr
    assert (tmp_path / "out" / "model.pte").exists()
    plain = _cli(tmp_path, cache)  # no check asked: none said
    assert plain.returncode == 0 and "numerics" not in plain.stderr
    assert "numerics" not in json.loads((tmp_path / "out" / "manifest.json").read_text())


def test_watch_shows_the_figures_against_the_previous_lowering(tmp_path):
    (tmp_path / ".git").mkdir()
    model = tmp_path / "tiny.py"
    model.write_text("from lowercache.bench import models\n\ndef model():\n    return models.tiny_cnn(seed=0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
    env.update({"LOWERCACHE_DIR": str(tmp_path / "cache"), "LOWERCACHE_SERVER": "0", "LOWERCACHE_CONFIG": str(tmp_path / "none.toml")})

    def watch_once() -> str:
        run = subprocess.run([sys.executable, "-m", "lowercache.cli", "watch", "tiny.py:model", "-t", "ethos-u55-128", "-o", "out",
                              "--check", "--max-runs", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return run.stdout

    first = watch_once()
    assert "  numerics:" in first and "output 0 (1, 10): SNR" in first and "(against the previous lowering)" not in first.split("numerics")[1]
    model.write_text(model.read_text().replace("seed=0", "seed=1"))
    second = watch_once()
    after = second.split("  numerics (against the previous lowering):", 1)[1]
    assert "Vela estimate (against the previous lowering)" in second
    assert re.search(r"SNR [\d.]+ dB \([+-][\d.]+ dB\)", after) or "SNR" in after and "(=)" in after, after
    assert re.search(r"cosine [\d.]+ \([+-=]", after), after


def test_build_report_has_the_figures_and_compare_flags_an_snr_drop_beyond_the_build_file_threshold():
    from lowercache.build import report

    def row(snr, model="kws", error=None):
        checked = {"samples": 4, "snr_db": snr, "cosine": 0.99, "max_abs": 0.1, "top1": 0.75}
        if error:
            checked = {"samples": 4, "error": error}
        return {"model": model, "target": "ethos-u55-128", "outcome": "miss", "seconds": 1.0, "pte": {"size": 1, "xxh3_128": "x"}, "estimate": None,
                "numerics": checked}

    before = {"pairs": [row(38.0), row(30.0, "vww"), row(20.0, "kwt")]}
    after = [row(33.5), row(29.0, "vww"), row(None, "kwt", error="not compared: partition 0: crashed")]
    assert report.compare(before, after) == [
        "kws on ethos-u55-128: SNR 38.0 dB -> 33.5 dB (-4.5 dB)",
        "vww on ethos-u55-128: SNR 30.0 dB -> 29.0 dB (-1.0 dB)",
        "kwt on ethos-u55-128: SNR 20.0 dB -> not compared",
    ]
    assert report.regressions(before, after, 3.0) == [
        "kws on ethos-u55-128: SNR fell 4.5 dB (38.0 dB -> 33.5 dB), more than max-snr-drop 3 dB",
        "kwt on ethos-u55-128: SNR fell from a measure to none (20.0 dB -> not compared), more than max-snr-drop 3 dB",
    ]
    assert report.regressions(before, after[:2], 5.0) == []
    text = report.markdown({"pairs": after, "regressions": ["kws ..."]})
    assert "| SNR | cosine | top-1 |" in text and "| 33.5 dB | 0.990000 | 75.0% |" in text and "not compared" in text
    assert "### Numerics regressions" in text


def test_build_with_check_reports_the_figures_and_fails_on_a_drop(tmp_path):
    (tmp_path / "tiny.py").write_text("import os\nfrom lowercache.bench import models\n\n"
                                      "def model():\n    return models.tiny_cnn(seed=int(os.environ.get('TINY_SEED', '0')))\n")
    (tmp_path / "lowercache.toml").write_text('check = true\nmax-snr-drop = 0.01\n\n[models.tiny]\nmodel = "tiny.py:model"\n'
                                             'targets = ["tosa-int"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWERCACHE_")}
    env.update({"LOWERCACHE_DIR": str(tmp_path / "cache"), "LOWERCACHE_SERVER": "0", "LOWERCACHE_CONFIG": str(tmp_path / "none.toml")})

    def build(*args, seed="0"):
        return subprocess.run([sys.executable, "-m", "lowercache.cli", "build", "-j", "1", *args], cwd=tmp_path,
                              env={**env, "TINY_SEED": seed}, capture_output=True, text=True, timeout=900)

    first = build()
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    saved = tmp_path / "before.json"
    saved.write_text((tmp_path / "build" / "build-report.json").read_text())
    (row,) = json.loads(saved.read_text())["pairs"]
    assert row["numerics"]["snr_db"] > 5 and row["numerics"]["samples"] == 1
    assert "| SNR | cosine | top-1 |" in (tmp_path / "build" / "build-report.md").read_text()
    same = build("--compare", str(saved))
    assert same.returncode == 0 and "no changes since the compared build" in same.stdout, same.stdout[-2000:]
    worse = build("--compare", str(saved), seed="2")  # seed 2's tiny_cnn: 34.5 dB on tosa-int, seed 0's 37.3 dB
    (after,) = json.loads((tmp_path / "build" / "build-report.json").read_text())["pairs"]
    assert after["numerics"]["snr_db"] < row["numerics"]["snr_db"] - 1
    assert worse.returncode == 1 and "numerics regression: tiny on tosa-int: SNR fell" in worse.stdout, worse.stdout[-2000:]
    assert "### Numerics regressions" in (tmp_path / "build" / "build-report.md").read_text()


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
