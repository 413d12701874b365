"""Output a user sees: lowercache's own lines; third-party warnings held back, shown with -v."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from lowercache import quiet
from tests.helpers import ROOT

MODEL = f"{ROOT / 'examples' / 'tiny_cnn.py'}:model"
# What a first lowering prints here without lowercache's capture (torchao's CUDA extensions, pytree, FutureWarnings).
NOISE = ("Failed to load", "_pytree", "FutureWarning", "LeafSpec")


def _lower(run: Path, *extra: str) -> subprocess.CompletedProcess:
    """A cold lowering (an empty cache: a hit would not import the Arm backend, whose imports are the noise)."""
    env = {**os.environ, "LOWERCACHE_DIR": str(run / "cache"), "COLUMNS": "120"}
    env.pop("LOWERCACHE_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "lowercache.cli", *extra, "lower", MODEL, "-t", "tosa-int", "-o", str(run / "out")],
        capture_output=True, text=True, env=env, timeout=900,
    )


def test_a_first_lowering_prints_no_third_party_warning_and_v_shows_them_once(tmp_path):
    plain = _lower(tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not [line for line in plain.stderr.splitlines() if any(n in line for n in NOISE)], plain.stderr
    verbose = _lower(tmp_path / "verbose", "-v")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    held = [line for line in verbose.stderr.splitlines() if line.startswith("  ") and any(n in line for n in NOISE)]
    assert held, verbose.stderr  # the same imports happen: the noise exists, and -v shows it
    assert len(held) == len(set(held))  # each once


def test_capture_holds_third_party_and_passes_lowercache_and_errors(caplog):
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        with caplog.at_level(logging.WARNING), quiet.captured() as noise:
            logging.getLogger("torchao.fake").warning("extension failed to load")
            logging.getLogger("executorch.fake").error("a real error")
            warnings.warn_explicit("old API", FutureWarning, "site-packages/torch/x.py", 1)
            warnings.warn_explicit("ours", UserWarning, quiet.__file__, 1)
            logging.getLogger("lowercache.test_quiet").warning("a warning of ours")
    assert noise.lines == ["warning (torchao.fake): extension failed to load", "FutureWarning: old API"]
    assert [r.getMessage() for r in caplog.records] == ["a real error", "a warning of ours"]
    assert shown == ["ours"]


def test_a_failure_says_how_many_were_held_back(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def model():\n    raise ValueError('no model today')\n")
    env = {**os.environ, "LOWERCACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "lowercache.cli", "lower", f"{bad}:model", "-t", "tosa-int", "-o", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowercache: error:")]
    assert len(errors) == 1 and "no model today" in errors[0]
    assert not [line for line in result.stderr.splitlines() if any(n in line for n in NOISE)]
