"""``lower --check`` on the command line: direct mode serves the figures without torch, ``--min-snr`` fails only when asked;
``watch --check`` shows the change against the last save; ``build`` reports the figures and its ``max-snr-drop`` gate."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.cli import command_env

pytestmark = pytest.mark.usefixtures("through_server")


def _cli(cwd, cache, *args, model="tiny.py:model", target="ethos-u55-128", env=None):
    """``lower`` in a new process, through the worker's warm server (``through_server``)."""
    return subprocess.run([sys.executable, "-m", "lowercache.cli", "lower", model, "-t", target, "-o", "out", *args],
                          cwd=cwd, env=command_env({"LOWERCACHE_DIR": str(cache), **(env or {})}), capture_output=True,
                          text=True, timeout=900)


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


def test_cli_check_layers_names_the_lossy_layer_cold_from_the_variable_and_from_a_direct_mode_hit(tmp_path):
    (tmp_path / ".git").mkdir()
    shutil.copy(ROOT / "tests" / "helpers" / "lossy.py", tmp_path / "lossy.py")
    cache = tmp_path / "cache"
    cold = _cli(tmp_path, cache, "--check=layers", "--json", model="lossy.py:model", target="tosa-int")
    assert cold.returncode == 0, cold.stderr[-2000:]
    summary = json.loads(cold.stdout)
    assert summary["step_counts"]["layers"] == {"miss": 1}
    assert [r["module"] for r in summary["numerics"]["layers"]["modules"]] == ["conv1", "conv2", "lossy", "conv3", "fc"]
    assert "key_parts" not in summary["numerics"]["layers"]
    assert "error enters at lossy: SNR drops from" in cold.stderr and re.search(r"lowercache:   lossy +[\d.]+ dB", cold.stderr)
    recorded = json.loads((tmp_path / "out" / "manifest.json").read_text())["numerics"]
    variable = _cli(tmp_path, cache, model="lossy.py:model", target="tosa-int", env={"LOWERCACHE_CHECK": "layers"})  # confirms
    assert variable.returncode == 0 and "error enters at lossy" in variable.stderr, variable.stderr[-2000:]
    warm = _cli(tmp_path, cache, "--check=layers", model="lossy.py:model", target="tosa-int")
    assert warm.returncode == 0, warm.stderr[-2000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["direct"] == {"outcome": "hit", "torch_imported": False}
    assert manifest["step_counts"]["layers"] == {"hit": 1} and manifest["numerics"] == recorded
    assert "error enters at lossy: SNR drops from" in warm.stderr


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
