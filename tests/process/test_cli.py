"""The CLI end to end, in subprocesses: outputs, bad input, corrupt entries, concurrency."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy
import pytest
import torch

from lowercache.bench import models
from lowercache.cache.store import Store

from tests.helpers.cli import ROOT, TINY, cli, error_lines, stock_tiny
from tests.helpers.isolation import isolate
from tests.helpers.oracle import reference, stock_pte
from tests.helpers.seeded import restored, set_aside

pytestmark = pytest.mark.usefixtures("through_server")


@pytest.fixture(scope="module")
def _lowered_once(tmp_path_factory):
    """examples/tiny_cnn.py lowered by the CLI for ethos-u55-128 into an empty cache, once for the tests that start
    there, then copied aside: the result."""
    base = tmp_path_factory.mktemp("lowered")
    with pytest.MonkeyPatch.context() as env:
        isolate(env, base)
        first = cli("lower", TINY, "--target", "ethos-u55-128", "--out", base / "out", cache_dir=base / "cache")
    assert first.returncode == 0, first.stderr
    set_aside(base, "out", "cache")
    return base, first


@pytest.fixture
def lowered_once(_lowered_once):
    """That lowering's result, output directory and cache, restored for this test at the paths it wrote them to."""
    base, first = _lowered_once
    out, cache = restored(base, "out", "cache")
    return first, out, cache


def test_lower_twice_writes_identical_outputs_and_explains(tmp_path, lowered_once):
    first, out, cache_dir = lowered_once
    assert first.returncode == 0, first.stderr
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"model.pte", "partition_0.tosa", "partition_0.vela.bin", "manifest.json"} <= set(files)
    assert files["model.pte"] == stock_tiny("ethos-u55-128")
    manifest = json.loads(files["manifest.json"])
    assert [s["outcome"] for s in manifest["steps"] if s["kind"] == "flow"] == ["miss"]
    assert manifest["toolchain"]["executorch"] == "1.5.1"

    second = cli("lower", TINY, "--target", "ethos-u55-128", "--out", out, cache_dir=cache_dir)
    assert second.returncode == 0, second.stderr
    manifest2 = json.loads((out / "manifest.json").read_text())
    assert [s["outcome"] for s in manifest2["steps"]] == ["hit"]
    assert (out / "model.pte").read_bytes() == files["model.pte"]

    stats = cli("stats", cache_dir=cache_dir)
    assert stats.returncode == 0 and re.search(r"│ whole lowering +│ +1 │ +1 │ +50% │", stats.stdout), stats.stdout

    # An edit: explain names the part that changed.
    edited = tmp_path / "edited.py"
    text = (ROOT / "examples" / "tiny_cnn.py").read_text()
    for seed in (1, 1, 2):
        edited.write_text(text.replace("torch.manual_seed(0)", f"torch.manual_seed({seed})"))
        result = cli("lower", f"{edited}:model", "-t", "ethos-u55-128", "-o", out, cache_dir=cache_dir)
        assert result.returncode == 0, result.stderr
    explained = cli("explain", f"{edited}:model", "-t", "ethos-u55-128", cache_dir=cache_dir)
    lines = explained.stdout.splitlines()
    assert "flow ethos-u55-128: missed; changed: calibration, example_inputs, program.constants" in lines, lines
    assert any(line.startswith("tosa partition 0: missed; changed: ") and "program.constants" in line for line in lines), lines
    assert "quantize ethos-u55-128: missed; changed: calibration, example_inputs, program.constants" in lines, lines
    # Per pass: the last run was a hit, so the passes shown are the edited run's.
    explained = cli("explain", f"{edited}:model", "-t", "ethos-u55-128", "--passes", cache_dir=cache_dir)
    lines = explained.stdout.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.startswith(("FoldAndAnnotateQParamsPass ", "ConvertSplitToSlicePass "))}
    assert rows["FoldAndAnnotateQParamsPass"][0] == "ran" and int(rows["FoldAndAnnotateQParamsPass"][2]) + int(rows["FoldAndAnnotateQParamsPass"][4]) > 0
    assert rows["ConvertSplitToSlicePass"][0] == "skip"
    assert any(line.endswith(" s") and " passes: " in line for line in lines), lines


BAD_FACTORIES = {
    "raises": "def model():\n    raise ValueError('no weights here')\n",
    "wrong_type": "def model():\n    return 42\n",
}


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_file", "model file not found"),
        ("raises", "raised ValueError: no weights here"),
        ("wrong_type", "must return (nn.Module, tuple of example inputs), got int"),
        ("unknown_target", "unknown target 'ethos-u99'"),
        ("corrupt_pt2", "cannot load saved program"),
        ("unwritable_cache", "is not writable"),
        ("output_under_a_file", "a-file is not a directory"),
        ("bad_calibration", "cannot load calibration file"),
        ("bad_npz_calibration", "same, non-zero number of samples"),
        ("pickled_npz_calibration", "cannot load calibration file"),
    ],
)
def test_bad_input_gives_one_line_and_leaves_nothing(case, expected, tmp_path, cache_dir):
    out = tmp_path / "out"
    model, target, extra = TINY, "ethos-u55-128", []
    if case == "missing_file":
        model = f"{tmp_path}/nope.py:model"
    elif case in BAD_FACTORIES:
        (tmp_path / "bad.py").write_text(BAD_FACTORIES[case])
        model = f"{tmp_path}/bad.py:model"
    elif case == "unknown_target":
        target = "ethos-u99"
    elif case == "corrupt_pt2":
        (tmp_path / "broken.pt2").write_bytes(b"PK\x03\x04 this is not a saved program")
        model = str(tmp_path / "broken.pt2")
    elif case == "unwritable_cache":
        (tmp_path / "a-file").write_text("")
        cache_dir = tmp_path / "a-file" / "cache"
    elif case == "output_under_a_file":
        (tmp_path / "a-file").write_text("")
        out = tmp_path / "a-file" / "out"
    elif case == "bad_calibration":
        (tmp_path / "calib.pt").write_bytes(b"not a torch file")
        extra = ["--calibration", tmp_path / "calib.pt"]
    elif case == "bad_npz_calibration":
        numpy.savez(tmp_path / "calib.npz", numpy.zeros((2, 1, 3, 16, 16), "float32"), numpy.zeros((3, 1), "float32"))
        extra = ["--calibration", tmp_path / "calib.npz"]
    elif case == "pickled_npz_calibration":
        numpy.savez(tmp_path / "calib.npz", numpy.array([{"a": 1}], dtype=object))
        extra = ["--calibration", tmp_path / "calib.npz"]
    result = cli("lower", model, "--target", target, "--out", out, *extra, cache_dir=cache_dir)
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1 and expected in lines[0], result.stderr
    if case == "raises":  # the user's own line, where the error was raised
        assert lines[0].endswith(f"(at {tmp_path}/bad.py:2)"), lines[0]
    assert not out.exists()
    assert not list(tmp_path.glob(".out.tmp-*"))
    assert not list(tmp_path.rglob(".lowercache-probe-*"))
    if cache_dir.is_dir():
        assert Store(cache_dir).entry_count() == {"actions": 0, "blobs": 0}


def test_saved_program_and_calibration_file(tmp_path, cache_dir):
    module, example = models.tiny_cnn()
    torch.export.save(torch.export.export(module, example), tmp_path / "tiny.pt2")
    samples = models.calibration_samples(example)
    torch.save(samples, tmp_path / "calib.pt")
    out = tmp_path / "out"
    result = cli("lower", tmp_path / "tiny.pt2", "-t", "tosa-int", "-o", out, "--calibration", tmp_path / "calib.pt", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr

    assert (out / "model.pte").read_bytes() == stock_pte(module, example, "tosa-int", calibration=samples)


def test_npz_calibration_file_equals_the_same_samples(tmp_path):
    from lowercache.lowering.loading import load_calibration

    _, example = models.transformer_block()
    samples = models.calibration_samples(example, n=3)
    numpy.savez(tmp_path / "calib.npz", *[numpy.stack([s[i].numpy() for s in samples]) for i in range(len(example))])
    loaded = load_calibration(str(tmp_path / "calib.npz"))
    assert len(loaded) == 3
    for got, want in zip(loaded, samples):
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_corrupt_entry_is_recomputed_with_a_warning(tmp_path, cache_dir):
    out = tmp_path / "out"
    assert cli("lower", TINY, "-t", "tosa-int", "-o", out, cache_dir=cache_dir).returncode == 0
    expected = (out / "model.pte").read_bytes()
    for path in (cache_dir / "entries").rglob("*.val"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
    again = cli("lower", TINY, "-t", "tosa-int", "-o", out, cache_dir=cache_dir)
    assert again.returncode == 0, again.stderr
    assert "lowercache: warning:" in again.stderr and "recomputing" in again.stderr
    assert (out / "model.pte").read_bytes() == expected
    third = cli("lower", TINY, "-t", "tosa-int", "-o", out, cache_dir=cache_dir)
    assert "warning" not in third.stderr
    assert json.loads((out / "manifest.json").read_text())["steps"][0]["outcome"] == "hit"


@pytest.mark.usefixtures("new_processes")  # a server's warm-up imported the quantizer
def test_quantize_hit_in_a_fresh_process_matches_stock(tmp_path, lowered_once):
    """A fresh process that hits the quantize step (flow entry gone) never imported
    the Arm quantizer; the out variants it loads must still be there for to_executorch."""
    first, _, cache_dir = lowered_once
    assert first.returncode == 0
    store = Store(cache_dir)
    flow_keys = [key for kind, key in store.actions() if kind == "flow"]
    assert flow_keys
    for key in flow_keys:
        store._discard(f"action/flow/{key}")
    store.close()
    again = cli("lower", TINY, "-t", "ethos-u55-128", "-o", tmp_path / "again", cache_dir=cache_dir)
    assert again.returncode == 0, again.stderr
    outcomes = {s["kind"]: s["outcome"] for s in json.loads((tmp_path / "again" / "manifest.json").read_text())["steps"]}
    assert outcomes["flow"] == "miss" and outcomes["quantize"] == "hit", outcomes
    assert (tmp_path / "again" / "model.pte").read_bytes() == stock_tiny("ethos-u55-128")


def test_concurrent_processes_share_one_cache(tmp_path, cache_dir):
    jobs = [
        ("tiny_cnn", "ethos-u55-128"),
        ("tiny_cnn", "ethos-u55-128"),
        ("tiny_cnn", "tosa-int"),
        ("transformer_block", "tosa-fp"),
    ]
    script = tmp_path / "factories.py"
    script.write_text(
        textwrap.dedent(
            """
            from lowercache.bench import models
            def tiny_cnn():
                return models.tiny_cnn()
            def transformer_block():
                return models.transformer_block()
            """
        )
    )
    procs = []
    for i, (model, target) in enumerate(jobs):
        cmd = [sys.executable, "-m", "lowercache.cli", "lower", f"{script}:{model}", "-t", target, "-o", str(tmp_path / f"out{i}")]
        env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr
    for i, (model, target) in enumerate(jobs):
        assert (tmp_path / f"out{i}" / "model.pte").read_bytes() == reference(model, target)
    again = cli("lower", f"{script}:tiny_cnn", "-t", "ethos-u55-128", "-o", tmp_path / "again", cache_dir=cache_dir)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again" / "manifest.json").read_text())["steps"][0]["outcome"] == "hit"


def test_help_names_the_environment_variables():
    """Every command's --help shows the env var beside --cache-dir / --remote (rich markup once ate it)."""
    import typer.main
    from typer.testing import CliRunner

    from lowercache.cli.commands import app

    command = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for name in command.commands:
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
        assert result.exit_code == 0, (name, result.output)
        for option, variable in (("--cache-dir", "[env: LOWERCACHE_DIR]"), ("--remote", "[env: LOWERCACHE_REMOTE]")):
            if option in result.output:
                assert variable in result.output, (name, option)
                checked += 1
    assert checked >= 10


@pytest.mark.quick
def test_usage_lines_name_arguments_as_users_write_them():
    """``lower [OPTIONS] MODEL``, not typer's ``{MODEL}`` (nor ``{model}``)."""
    from typer.testing import CliRunner

    from lowercache.cli.commands import app

    usage = {}
    for name in ("lower", "verify", "watch", "explain", "build", "export", "import"):
        result = CliRunner().invoke(app, [name, "--help"], prog_name="lowercache", env={"COLUMNS": "200", "TERM": "dumb"})
        usage[name] = next(line.strip() for line in result.output.splitlines() if "Usage:" in line)
    assert usage["lower"] == "Usage: lowercache lower [OPTIONS] MODEL" and usage["build"] == "Usage: lowercache build [OPTIONS] [NAME]..."
    assert usage["export"].endswith(" FILE") and not any("{" in line for line in usage.values()), usage


@pytest.mark.quick
def test_no_help_page_shows_a_value_for_a_flag():
    """A flag takes no value: no ``--help``, ``--json`` or ``--install-completion <bool>`` in any command's or group's help,
    nested groups' commands included."""
    import click
    import typer.main
    from typer.testing import CliRunner

    from lowercache.cli.commands import app

    def paths(command: click.Command, prefix: list[str]) -> list[list[str]]:
        found = [prefix]
        for name, sub in getattr(command, "commands", {}).items():
            found += paths(sub, [*prefix, name])
        return found

    pages = paths(typer.main.get_command(app), [])
    for path in pages:
        result = CliRunner().invoke(app, [*path, "--help"], prog_name="lowercache", env={"COLUMNS": "200", "TERM": "dumb"})
        assert result.exit_code == 0 and "--help" in result.output, (path, result.output)
        assert "<bool>" not in result.output and "BOOLEAN" not in result.output, (path, result.output)
    assert ["server", "start"] in pages and len(pages) >= 15


def test_a_model_stock_cannot_lower_gives_the_root_cause(tmp_path, cache_dir):
    """ExecuTorch wraps the failure in a line listing every pass; the error names the cause and the node instead."""
    model = f"{ROOT}/tests/helpers/op_zoo.py:unlowerable"
    for command in ("lower", "verify"):
        out = tmp_path / f"out-{command}"
        extra = ["--out", out] if command == "lower" else []
        result = cli(command, model, "--target", "ethos-u55-128", *extra, cache_dir=cache_dir)
        assert result.returncode == 1, result.stderr
        lines = error_lines(result)
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("lowercache: error: lowering failed: TosaValueError: Unsupported input dtype torch.float32")
        assert lines[0].endswith("(while executing node aten_avg_pool2d_default)")
        assert "Traceback" not in result.stderr
        assert not out.exists()


def test_config_is_aligned_and_readable(tmp_path):
    result = cli("config", cache_dir=tmp_path / "cache", env={"LOWERCACHE_MAX_SIZE": "1536M"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    values = {line.split()[0]: line for line in lines}
    assert "1.5G" in values["max_size"] and "env LOWERCACHE_MAX_SIZE" in values["max_size"]
    starts = {len(line) - len(line[len(line.split()[0]):].lstrip()) for line in lines if not line.startswith("config file")}
    assert len(starts) == 1  # every value starts in the same column
    assert "None" not in result.stdout


def test_json_summary_and_plain_progress_lines_in_a_log(tmp_path):
    """Not a terminal (a CI log): the stages as plain lines on stderr; --json: one JSON document on stdout."""
    runs = []
    for _ in range(2):
        result = cli("lower", TINY, "-t", "tosa-int", "-o", tmp_path / "out", "--json", cache_dir=tmp_path / "cache")
        assert result.returncode == 0, result.stderr
        runs.append((json.loads(result.stdout), result.stderr))
    (cold, cold_err), (warm, _) = runs
    assert cold["flow"] == "miss" and warm["flow"] == "hit"
    assert cold["target"] == "tosa-int" and cold["step_counts"]["flow"] == {"miss": 1}
    assert warm["files"]["model.pte"]["size"] == (tmp_path / "out" / "model.pte").stat().st_size
    assert warm["saved_seconds"] > 0
    assert any(re.fullmatch(r"lowercache: \[2/\d\] export: \d+\.\d\d s", line) for line in cold_err.splitlines()), cold_err


RFFT = """
import torch

class M(torch.nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x).abs()

def model():
    return M().eval(), (torch.randn(1, 8),)
"""

BAD_VIEW = """
import torch

class M(torch.nn.Module):
    def forward(self, x):
        return x.view(3, -1)

def model():
    return M().eval(), (torch.randn(1, 8),)
"""


def test_a_failed_lowering_is_one_line_with_the_innermost_cause_and_the_users_line(tmp_path, cache_dir):
    """A multi-line cause keeps its later lines (the operator), joined; the user's file and line are named; nothing
    advertises held-back third-party warnings."""
    (tmp_path / "rfft.py").write_text(RFFT)
    (tmp_path / "view.py").write_text(BAD_VIEW)
    rfft = cli("lower", "rfft.py:model", "-t", "ethos-u55-128", "-o", tmp_path / "a", cache_dir=cache_dir, cwd=tmp_path)
    view = cli("lower", "view.py:model", "-t", "ethos-u55-128", "-o", tmp_path / "b", cache_dir=cache_dir, cwd=tmp_path)
    for result in (rfft, view):
        assert result.returncode == 1
        assert len(error_lines(result)) == 1, result.stderr
        assert "held back" not in result.stderr
    assert "aten.abs.default" in error_lines(rfft)[0] and 'rfft.py", line 6' in error_lines(rfft)[0]
    assert error_lines(view)[0].endswith("(at view.py:6)"), view.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_help_never_starts_the_server(tmp_path, cache_dir):
    run = tmp_path / "run"
    run.mkdir()
    for command in ("lower", "verify"):
        result = cli(command, "--help", cache_dir=cache_dir, env={"LOWERCACHE_SERVER": "1", "XDG_RUNTIME_DIR": str(run)})
        assert result.returncode == 0 and "--target" in result.stdout
    assert not (run / "lowercache" / "server.sock").exists()


@pytest.mark.quick
def test_version_and_explain_of_a_missing_model(tmp_path, cache_dir):
    version = cli("--version", cache_dir=cache_dir)
    assert version.returncode == 0 and version.stdout.startswith("lowercache 0.1.0 (torch 2.13.0")
    missing = cli("explain", "nothere.py:model", "-t", "tosa-fp", cache_dir=cache_dir, cwd=tmp_path)
    assert missing.returncode == 2 and error_lines(missing) == ["lowercache: error: model file nothere.py does not exist"]


# The CLI as a new process, then whether it imported torch and ExecuTorch, and its exit code, on the last line of stderr.
_IMPORTS_TORCH = ("import runpy, sys\nsys.argv = ['lowercache', *sys.argv[1:]]\ntry:\n    runpy.run_module('lowercache.cli', run_name='__main__')\n"
                  "except SystemExit as e:\n    code = e.code\nprint('torch' in sys.modules, 'executorch' in sys.modules, code, file=sys.stderr)\n")


@pytest.mark.quick
@pytest.mark.parametrize("command", [["stats"], ["explain", "model.py:model", "-t", "tosa-fp"], ["gc"], ["config"], ["server", "status"],
                                     ["lower", "--help"], ["verify", "--help"]])
def test_housekeeping_commands_import_no_torch(command, tmp_path, cache_dir):
    """docs/server.md: the cheap commands stay in the client and never pay torch's import (1.2 s or more)."""
    (tmp_path / "model.py").write_text("")
    result = subprocess.run([sys.executable, "-c", _IMPORTS_TORCH, *command], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LOWERCACHE_DIR": str(cache_dir)})
    assert result.stderr.strip().splitlines()[-1].startswith("False False "), result.stderr[-2000:]


@pytest.mark.quick
@pytest.mark.parametrize("command", [["lower", TINY, "-t", "tosa-int", "-o", "out"], ["verify", TINY, "-t", "tosa-int"]])
def test_a_bad_setting_is_refused_before_torch_is_imported(command, tmp_path, cache_dir):
    """``LOWERCACHE_SPEEDUPS=bogus``: one line, exit 2, without paying torch's import (8-13 s under load)."""
    result = subprocess.run([sys.executable, "-c", _IMPORTS_TORCH, *command], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "LOWERCACHE_DIR": str(cache_dir), "LOWERCACHE_SPEEDUPS": "bogus"})
    assert result.stderr.strip().splitlines()[-1] == "False False 2", result.stderr[-2000:]
    assert error_lines(result) == [line for line in result.stderr.splitlines() if line.startswith("lowercache:")]
    assert len(error_lines(result)) == 1 and "unknown speed-up 'bogus'" in error_lines(result)[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
@pytest.mark.parametrize("command, expected", [
    (["lower", "nope.py:model", "-t", "tosa-int", "-o", "out"], "model file not found: nope.py"),
    (["lower", "gone.pt2", "-t", "tosa-int", "-o", "out", "--json"], "saved program not found: gone.pt2"),
    (["lower", "model.py", "-t", "tosa-int", "-o", "out"], "bad model 'model.py'"),
    (["lower", "model.py:model", "-tethos-u99", "-o", "out"], "unknown target 'ethos-u99'"),
    (["lower", "model.py:model", "--target=ethos-u55-128", "--system-config", "nope", "-o", "out"], "unknown --system-config 'nope'"),
    (["verify", "nope.py:model", "--target", "tosa-int"], "model file not found: nope.py"),
    (["verify", "model.py:model", "-t", "ethos-u99"], "unknown target 'ethos-u99'"),
])
def test_a_bad_model_or_target_is_refused_at_once_with_the_server_on(command, expected, tmp_path, cache_dir):
    """A mistyped MODEL or target, as a person types it with the server on (the default): one line and exit 2 from
    the client, before torch is imported and without starting a server (which took 6-9 s for this one line)."""
    (tmp_path / "model.py").write_text("")
    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir), "LOWERCACHE_SERVER": "1"}
    result = subprocess.run([sys.executable, "-c", _IMPORTS_TORCH, *command], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.stderr.strip().splitlines()[-1] == "False False 2", result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("lowercache:")] == error_lines(result)
    assert len(error_lines(result)) == 1 and expected in error_lines(result)[0], result.stderr
    if "--json" in command:
        assert json.loads(result.stdout) == {"error": error_lines(result)[0].removeprefix("lowercache: error: "), "exit": 2}
    assert not (tmp_path / "out").exists()
    status = subprocess.run([sys.executable, "-m", "lowercache.cli", "server", "status"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=env)
    assert status.stdout.startswith("no server running"), status.stdout


def test_stats_json_and_zero_and_a_json_error(tmp_path, cache_dir):
    """Also, after the first lowering: its output directory and files get the user's normal permissions (the umask's)."""
    lowered = cli("lower", TINY, "-t", "tosa-fp", "-o", tmp_path / "out", cache_dir=cache_dir)
    assert lowered.returncode == 0 and "wrote 3 files" in lowered.stdout, lowered.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "out" / "model.pte").stat().st_mode & 0o777 == 0o666 & ~umask
    figures = json.loads(cli("stats", "--json", cache_dir=cache_dir).stdout)
    assert figures["outcomes"]["flow"]["miss"] == 1 and figures["steps"] > 0
    assert cli("stats", "--zero", cache_dir=cache_dir).returncode == 0
    zeroed = json.loads(cli("stats", "--json", cache_dir=cache_dir).stdout)
    assert zeroed["outcomes"] == {} and zeroed["saved_seconds"] == 0 and zeroed["steps"] == figures["steps"]
    failed = cli("lower", "nothere.py:model", "-t", "tosa-fp", "-o", tmp_path / "x", "--json", cache_dir=cache_dir, cwd=tmp_path)
    assert failed.returncode == 2
    assert json.loads(failed.stdout) == {"error": "model file not found: nothere.py", "exit": 2}
    # as ccache -s: the limit, when the counters were zeroed, what failed; no line past 80 columns but the directory's
    after = json.loads(cli("stats", "--json", cache_dir=cache_dir).stdout)
    assert after["failed"] == {"input": 1, "lowering": 0} and after["zeroed"] is not None and after["max_bytes"] > after["bytes"]
    shown = cli("stats", cache_dir=cache_dir, env={"COLUMNS": "80"}).stdout
    assert "errors           1 (1 in the input, 0 inside torch or ExecuTorch)" in shown and "counters zeroed  20" in shown, shown
    assert all(len(line) <= 80 for line in shown.splitlines() if not line.startswith("cache directory")), shown
