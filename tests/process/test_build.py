"""``lowercache build`` end to end, in subprocesses: build file errors, -j 2 bytes against stock and ``lower``,
only changed pairs run again, --keep-going, Ctrl-C, the report's comparison, and Ray on a local cluster with Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lowercache.zoo import report

from tests.helpers import ROOT
from tests.helpers.cli import command_env
from tests.helpers.oracle import reference

pytestmark = pytest.mark.usefixtures("through_server")

TINY = """
from lowercache.bench.models import tiny_cnn


def model():
    return tiny_cnn({args})
"""
# The edit: a classifier after the CNN, which costs Ethos-U cycles.
TINY_WIDER = """
import torch
from lowercache.bench.models import tiny_cnn


def model():
    module, inputs = tiny_cnn()
    torch.manual_seed(0)
    return torch.nn.Sequential(module, torch.nn.Linear(10, 64)).eval(), inputs
"""
FAILING = """
def model():
    raise RuntimeError("the checkpoint is missing")
"""


def cli(*args, cwd, env=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "lowercache.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=command_env(env or {}), timeout=timeout)


def project(root: Path, files: dict[str, str], build_file: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    (root / "lowercache.toml").write_text(textwrap.dedent(build_file))
    return root


def outcomes(root: Path, out: str = "build") -> dict[tuple[str, str], dict]:
    data = json.loads((root / out / "build-report.json").read_text())
    return {(r["model"], r["target"]): r for r in data["pairs"]}


ZOO = """
    out = "build"
    targets = ["tosa-fp"]

    [models.a]
    model = "a.py:model"
    targets = ["ethos-u55-128"]

    [models.b]
    model = "b.py:model"
"""


@pytest.mark.parametrize(
    "build_file, key",
    [
        ('targets = ["tosa-fp"]\n[models.a]\nmodel = "a.py:model"\nper_tensor = true\n', "models.a.per_tensor: unknown key"),
        ('targets = ["tosa-fq"]\n[models.a]\nmodel = "a.py:model"\n', "targets.0: unknown target 'tosa-fq'"),
        ('[models.a]\nmodel = "a.py:model"\nper-tensor = "maybe"\ntargets = ["tosa-fp"]\n', "models.a.per-tensor: Input should be a valid boolean"),
        ('targets = ["tosa-fp"]\n[models.a]\nmodel = "gone.py:model"\n', "models.a.model: file not found: gone.py"),
        ('targets = ["tosa-fp", "tosa-int"]\nlayout = "{model}"\n[models.a]\nmodel = "a.py:model"\n', "layout: a layout must contain {target}"),
        ('[models.a]\nmodel = "a.py:model"\n', "models.a.targets: no targets"),
        ('targets = ["tosa-fp"]\n', "models: Field required"),
        ('targets = [\n', "not valid TOML"),
    ],
)
def test_bad_build_file_is_one_line_naming_the_key_and_writes_nothing(tmp_path, build_file, key):
    root = project(tmp_path / "p", {"a.py": TINY.format(args="")}, build_file)
    result = cli("build", cwd=root)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowercache: error: ") and key in lines[0], result.stderr
    assert sorted(p.name for p in root.iterdir()) == ["a.py", "lowercache.toml"]


def test_build_file_in_pyproject_and_unknown_model_name(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "zoo"\n\n[tool.lowercache]\ntargets = ["tosa-fp"]\nbogus = 1\n')
    result = cli("build", cwd=root)
    assert result.returncode == 2 and "pyproject.toml: tool.lowercache.bogus: unknown key" in result.stderr
    (root / "pyproject.toml").write_text('[tool.lowercache]\ntargets = ["tosa-fp"]\n[tool.lowercache.models.a]\nmodel = "a.py:model"\n')
    (root / "a.py").write_text(TINY.format(args=""))
    result = cli("build", "nope", cwd=root)
    assert result.returncode == 2 and "no model named 'nope' in pyproject.toml (models: a)" in result.stderr


def test_parallel_build_gives_stock_bytes_and_only_changed_pairs_run_again(tmp_path):
    # Stock bytes first: lowering in this process sets variables (TORCHINDUCTOR_CACHE_DIR) the builds' environment would then change by.
    stock = {("a", "ethos-u55-128"): reference("tiny_cnn", "ethos-u55-128"), ("b", "tosa-fp"): reference("tiny_cnn", "tosa-fp", "weights")}
    root = project(tmp_path / "zoo", {"a.py": TINY.format(args=""), "b.py": TINY.format(args='edit="weights"')}, ZOO)
    env = {"LOWERCACHE_DIR": str(tmp_path / "cache")}

    cold = cli("build", "-j", "2", cwd=root, env=env)
    assert cold.returncode == 0, cold.stderr
    first = outcomes(root)
    assert {k: r["outcome"] for k, r in first.items()} == {("a", "ethos-u55-128"): "miss", ("b", "tosa-fp"): "miss"}
    built = lambda model, target: (root / "build" / model / target / "model.pte").read_bytes()  # noqa: E731
    for (model, target), expected in stock.items():
        assert built(model, target) == expected, (model, target)
    # Every file of the Ethos-U pair equals a sequential `lowercache lower` of it, in a cache of its own.
    alone = cli("lower", "a.py:model", "-t", "ethos-u55-128", "-o", tmp_path / "alone", "--no-cache", cwd=root)
    assert alone.returncode == 0, alone.stderr
    pair_dir = root / "build" / "a" / "ethos-u55-128"
    for path in (tmp_path / "alone").iterdir():
        if path.name != "manifest.json":
            assert (pair_dir / path.name).read_bytes() == path.read_bytes(), path.name
    estimate = first[("a", "ethos-u55-128")]["estimate"]
    assert estimate["cycles"] > 0 and estimate["sram_kib"] > 0 and estimate["flash_kib"] > 0
    assert first[("a", "ethos-u55-128")]["pte"]["size"] == len(built("a", "ethos-u55-128"))
    assert first[("b", "tosa-fp")]["estimate"] is None
    assert "| a | ethos-u55-128 | miss |" in (root / "build" / "build-report.md").read_text()

    # Nothing changed: flow hits in the workers (and direct mode confirms its records), then direct-mode hits without a worker.
    again = cli("build", "-j", "2", cwd=root, env=env)
    assert again.returncode == 0, again.stderr
    assert {(r["outcome"], r["how"]) for r in outcomes(root).values()} == {("hit", "worker")}
    warm = cli("build", cwd=root, env=env)
    assert warm.returncode == 0, warm.stderr
    assert {(r["outcome"], r["how"]) for r in outcomes(root).values()} == {("hit", "direct")}
    for model, target in stock:  # answered in the build's own process, which never imported torch
        manifest = json.loads((root / "build" / model / target / "manifest.json").read_text())
        assert manifest["direct"] == {"outcome": "hit", "torch_imported": False}
    assert built("a", "ethos-u55-128") == stock[("a", "ethos-u55-128")]
    previous = tmp_path / "previous.json"
    previous.write_bytes((root / "build" / "build-report.json").read_bytes())

    # One model edited: only its pairs run; the comparison says what the edit cost on the NPU.
    (root / "a.py").write_text(TINY_WIDER)
    edited = cli("build", "-j", "2", "--compare", previous, cwd=root, env=env)
    assert edited.returncode == 0, edited.stderr
    now = outcomes(root)
    assert {k: (r["outcome"], r["how"]) for k, r in now.items()} == {
        ("a", "ethos-u55-128"): ("miss", "worker"), ("b", "tosa-fp"): ("hit", "direct")}
    before, after = estimate["cycles"], now[("a", "ethos-u55-128")]["estimate"]["cycles"]
    assert after > before
    expected = f"a: {(after - before) / before:.1%} slower on ethos-u55-128"
    changes = json.loads((root / "build" / "build-report.json").read_text())["changes"]
    assert any(line.startswith(expected) for line in changes), changes
    assert expected in edited.stdout and expected in (root / "build" / "build-report.md").read_text()


def test_a_failing_model_stops_the_build_or_with_keep_going_is_reported_at_the_end(tmp_path):
    build_file = """
        targets = ["tosa-fp"]
        [models.broken]
        model = "broken.py:model"
        [models.good]
        model = "good.py:model"
    """
    root = project(tmp_path / "p", {"broken.py": FAILING, "good.py": TINY.format(args="")}, build_file)
    env = {"LOWERCACHE_DIR": str(tmp_path / "cache")}

    stopped = cli("build", "-j", "1", cwd=root, env=env)
    assert stopped.returncode == 1
    rows = outcomes(root)
    assert rows[("broken", "tosa-fp")]["outcome"] == "failed" and "the checkpoint is missing" in rows[("broken", "tosa-fp")]["error"]
    assert rows[("good", "tosa-fp")]["outcome"] == "skipped"
    assert not (root / "build" / "good").exists()

    going = cli("build", "-j", "2", "--keep-going", cwd=root, env=env)
    assert going.returncode == 1
    rows = outcomes(root)
    assert rows[("good", "tosa-fp")]["outcome"] == "miss"
    assert (root / "build" / "good" / "tosa-fp" / "model.pte").read_bytes() == reference("tiny_cnn", "tosa-fp")
    last = going.stdout.strip().splitlines()
    failure = next(line for line in last if line.startswith("failed: "))
    assert failure.startswith("failed: broken on tosa-fp: ") and "RuntimeError: the checkpoint is missing" in failure
    assert last.index(failure) > max(i for i, line in enumerate(last) if line.startswith("good "))  # reported at the end


def test_ctrl_c_stops_the_workers_and_leaves_no_partial_output(tmp_path):
    slow = "import os, time\n\n\ndef model():\n    open(f'started-{os.getpid()}', 'w').close()\n    time.sleep(120)\n"
    root = project(tmp_path / "p", {"slow.py": slow}, 'targets = ["tosa-fp", "tosa-int"]\n[models.slow]\nmodel = "slow.py:model"\n')
    proc = subprocess.Popen([sys.executable, "-m", "lowercache.cli", "build", "-j", "2"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "LOWERCACHE_DIR": str(tmp_path / "cache")},
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(root.glob("started-*"))) < 2:  # both workers are inside the factory
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - started < 30
    assert "interrupted" in stdout
    assert {r["outcome"] for r in outcomes(root).values()} == {"skipped"}
    assert not (root / "build" / "slow").exists()
    leftover = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_comparison_against_a_previous_report():
    def row(model, target, cycles=None, size=1000, digest="x", outcome="miss"):
        estimate = {"cycles": cycles, "sram_kib": 10.0, "flash_kib": 20.0, "cpu_operators": 2} if cycles else None
        return {"model": model, "target": target, "outcome": outcome, "pte": {"size": size, "xxh3_128": digest}, "estimate": estimate}

    before = {"pairs": [row("kws", "ethos-u55-128", 100_000), row("kws", "tosa-fp"), row("vww", "ethos-u55-128", 5000), row("old", "tosa-fp")]}
    after = [row("kws", "ethos-u55-128", 108_000, size=1200), row("kws", "tosa-fp", digest="y"), row("vww", "ethos-u55-128", 4000),
             row("new", "tosa-fp")]
    assert report.compare(before, after) == [
        "kws: 8.0% slower on ethos-u55-128 (cycles/inference 100,000 -> 108,000)",
        "kws on ethos-u55-128: model.pte 1,000 -> 1,200 bytes",
        "kws on tosa-fp: model.pte changed (same size)",
        "vww: 20.0% faster on ethos-u55-128 (cycles/inference 5,000 -> 4,000)",
        "new on tosa-fp: new",
        "old on tosa-fp: gone",
    ]


def test_ray_build_on_a_local_cluster_shares_results_through_redis(tmp_path, redis_url, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'lowercache[ray]'")
    from lowercache.cli import dispatch

    monkeypatch.setenv("LOWERCACHE_HMAC_KEY", "team-secret")  # each Ray worker has its own; lowercache sends no secret
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    build_file = 'targets = ["tosa-fp"]\n[models.a]\nmodel = "a.py:model"\n[models.b]\nmodel = "b.py:model"\n'
    root = project(tmp_path / "zoo", {"a.py": TINY.format(args=""), "b.py": TINY.format(args='edit="weights"')}, build_file)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    monkeypatch.chdir(root)
    try:
        code = dispatch(["build", "--executor", "ray", "--remote", redis_url, "--cache-dir", str(tmp_path / "node-cache")])
    finally:
        ray.shutdown()
    assert code == 0
    rows = outcomes(root)
    assert {r["outcome"] for r in rows.values()} == {"miss"} and all(r["how"].startswith("ray (") for r in rows.values())
    assert (root / "build" / "a" / "tosa-fp" / "model.pte").read_bytes() == reference("tiny_cnn", "tosa-fp")
    assert (root / "build" / "b" / "tosa-fp" / "model.pte").read_bytes() == reference("tiny_cnn", "tosa-fp", "weights")

    # Another machine: an empty local cache, the same Redis; every pair is a hit served by the shared tier.
    other = cli("build", "-j", "2", "--remote", redis_url, "--cache-dir", tmp_path / "other-cache", cwd=root)
    assert other.returncode == 0, other.stderr
    assert {r["outcome"] for r in outcomes(root).values()} == {"hit"}
    for model in ("a", "b"):
        manifest = json.loads((root / "build" / model / "tosa-fp" / "manifest.json").read_text())
        flow = next(s for s in manifest["steps"] if s["kind"] == "flow")
        assert flow["outcome"] == "hit" and flow["tier"] == "remote"


@pytest.mark.quick
def test_the_example_zoo_build_file_is_valid():
    from lowercache.zoo import buildfile

    build = buildfile.load(ROOT / "examples" / "lowercache.toml")
    assert build.names == ["tiny_cnn", "mobilenet_v2"] and len(build.pairs) == 6
    assert {p.memory for p in build.pairs if p.name == "mobilenet_v2"} == {3 * 2**30}


def test_a_ray_cluster_that_refuses_the_token_is_one_line_with_the_hint(tmp_path):
    """A cluster with token authentication (Ray 2.59 on) and another token here: Ray's native client prints a line a
    second while it retries; the user gets one line that says what to set."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'lowercache[ray]'")
    root = project(tmp_path / "zoo", {"a.py": TINY.format(args="")}, 'targets = ["tosa-fp"]\n[models.a]\nmodel = "a.py:model"\n')
    head = ("import ray, sys\nray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address='127.0.0.1')\n"
            "print(ray.get_runtime_context().gcs_address, flush=True)\nsys.stdin.read()\nray.shutdown()\n")
    auth = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    cluster = subprocess.Popen([sys.executable, "-c", head], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env={**os.environ, **auth, "RAY_AUTH_TOKEN": "c" * 32})  # Ray reads these at import
    try:
        address = cluster.stdout.readline().strip()
        assert address, "the Ray cluster did not start"
        refused = cli("build", "--executor", "ray", "--ray-address", address, cwd=root, env={**auth, "RAY_AUTH_TOKEN": "d" * 32})
    finally:
        cluster.stdin.close()
        cluster.wait(timeout=120)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert lines == [f"lowercache: error: cannot reach the Ray cluster at {address}: it refused this machine's authentication token "
                     "(set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, to the cluster's: `ray get-auth-token` on its head prints it; "
                     "RAY_AUTH_MODE=token)"], refused.stderr[-3000:]
    assert not (root / "build").exists()


# Two models, each for an Arm target and an XNNPACK one (issue 56: a zoo build file with both families builds both).
BOTH_MODELS = """
import torch

EDIT = None


def cnn():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3), torch.nn.ReLU()).eval()
    if EDIT == "weight":
        with torch.no_grad():
            net[2].weight[0, 0, 0, 0] += 0.5
    return net, (torch.randn(1, 3, 12, 12),)


def mlp():
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval(), (torch.randn(1, 8),)
"""
BOTH_ZOO = """
    out = "build"
    targets = ["ethos-u55-128", "xnnpack-int8"]

    [models.cnn]
    model = "models.py:cnn"

    [models.mlp]
    model = "models.py:mlp"
    targets = ["tosa-fp", "xnnpack"]
"""
BOTH_PAIRS = [("cnn", "ethos-u55-128"), ("cnn", "xnnpack-int8"), ("mlp", "tosa-fp"), ("mlp", "xnnpack")]


def test_a_build_file_with_both_families_builds_both_to_stock_bytes(tmp_path):
    from tests.helpers.xnnstock import stock_bytes

    (tmp_path / "stock").mkdir()
    lowerings = [(None, m, t) for m, t in BOTH_PAIRS] + [("weight", "cnn", t) for t in ("ethos-u55-128", "xnnpack-int8")]
    stock = stock_bytes(BOTH_MODELS, lowerings, tmp_path / "stock")
    root = project(tmp_path / "zoo", {"models.py": BOTH_MODELS}, BOTH_ZOO)
    env = {"LOWERCACHE_DIR": str(tmp_path / "cache")}
    built = lambda model, target: (root / "build" / model / target / "model.pte").read_bytes()  # noqa: E731

    cold = cli("build", "-j", "2", cwd=root, env=env)
    assert cold.returncode == 0, cold.stderr
    assert {k: r["outcome"] for k, r in outcomes(root).items()} == dict.fromkeys(BOTH_PAIRS, "miss")
    for model, target in BOTH_PAIRS:
        assert built(model, target) == stock[None, model, target], (model, target)
    again = cli("build", "-j", "2", cwd=root, env=env)
    assert again.returncode == 0, again.stderr
    assert {r["outcome"] for r in outcomes(root).values()} == {"hit"}

    (root / "models.py").write_text(textwrap.dedent(BOTH_MODELS).replace("EDIT = None", 'EDIT = "weight"'))
    edited = cli("build", "-j", "2", cwd=root, env=env)
    assert edited.returncode == 0, edited.stderr
    assert {k: r["outcome"] for k, r in outcomes(root).items()} == {
        ("cnn", "ethos-u55-128"): "miss", ("cnn", "xnnpack-int8"): "miss", ("mlp", "tosa-fp"): "hit", ("mlp", "xnnpack"): "hit"}
    for model, target in BOTH_PAIRS:
        assert built(model, target) == stock["weight" if model == "cnn" else None, model, target], (model, target)
