"""Run ahead (``run/ahead.py``): at a script's first strict export, a confined copy goes on non-strictly and fills the cache.

The script here lags on purpose after its first export (in the script's own
process only), so the runner reaches the partition's TOSA lowering and Vela
compile first: the script's steps are then served from what the runner
stored. What must hold: the script's .pte is stock ExecuTorch's (strict
exports), and nothing but cache entries shows that a copy ran: one line in
each file the script writes after the export, one line of its output, no
process and no scratch directory left.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from lowercache.bench import models
from lowercache.cache.store import Store
from lowercache.run import ahead as runahead

from tests.helpers.oracle import stock_pte
from tests.helpers.runserver import run
from tests.helpers.server import Server


PY = sys.executable
pytestmark = pytest.mark.skipif(runahead.landlock_abi() < 3 or runahead._cores() < 2,
                                reason="run ahead needs Landlock (ABI 3) and two cores")

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, get_symmetric_quantization_config
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from lowercache.bench import models

    probe = os.environ.get("PROBE") == "1"
    script = os.getpid()
    opened = open("opened-before.txt", "a")
    module, example = models.tiny_cnn()
    ep = torch.export.export(module, example, strict=True)
    if probe:
        try:  # refused in the runner, which goes on
            with open("after-export.txt", "a") as f:
                f.write(f"{os.getpid()}\\n")
        except PermissionError:
            pass
        opened.write(f"{os.getpid()}\\n")
        opened.flush()
        print("after export", flush=True)
        if os.getpid() == script:
            with open(f"/proc/{script}/task/{threading.get_native_id()}/children") as f:
                children = f.read().split()
            with open("children.txt", "w") as f:
                f.write(" ".join(children))
            mine, nice = os.nice(0), {}
            for _ in range(50):  # the runner lowers its own priority as it starts
                for pid in children:
                    with open(f"/proc/{pid}/stat") as f:
                        nice[pid] = int(f.read().rsplit(")", 1)[1].split()[16])
                if all(n != mine for n in nice.values()):
                    break
                time.sleep(0.1)
            with open("nice.txt", "w") as f:
                f.write(" ".join(str(n) for n in (mine, *nice.values())))
            time.sleep(float(os.environ.get("LAG", "0")))
    spec = EthosUCompileSpec("ethos-u55-128")
    quantizer = EthosUQuantizer(spec)
    quantizer.set_global(get_symmetric_quantization_config())
    prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
    prepared(*example)
    ep = torch.export.export(convert_pt2e(prepared), example, strict=True)
    edge = to_edge_transform_and_lower(ep, partitioner=[EthosUPartitioner(spec)])
    with open("model.pte", "wb") as f:
        f.write(edge.to_executorch().buffer)
    """
)


@pytest.fixture(scope="module")
def expected() -> bytes:
    module, example = models.tiny_cnn()
    return stock_pte(module, example, "ethos-u55-128", strict=True)


def _run(server: Server, project, mode: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    """The script under ``lowercache run``, with a cache of the project's own (cold at first)."""
    project.mkdir(exist_ok=True)
    (project / "export.py").write_text(SCRIPT)
    (project / "tmp").mkdir(exist_ok=True)
    flags = (*flags, "--no-server") if mode == "new process" else flags
    result = run(server, project, PY, "export.py", flags=flags, LOWERCACHE_DIR=str(project / "cache"),
                 TMPDIR=str(project / "tmp"), **env)
    assert result.returncode == 0, result.stderr[-3000:].decode(errors="replace")
    return result


def _counters(project, kind: str) -> tuple[int, int]:
    counters = Store(project / "cache").counters()
    return counters.get(f"count/{kind}/hit", 0), counters.get(f"count/{kind}/miss", 0)


@pytest.mark.parametrize("mode", ["new process", "warm server"])
def test_runner_serves_a_lagging_script_and_leaves_no_trace(server, tmp_path, expected, mode):
    project = tmp_path / "project"
    result = _run(server, project, mode, PROBE="1", LAG="10")
    assert (project / "model.pte").read_bytes() == expected
    script_lines = (project / "after-export.txt").read_text().split()
    assert len(script_lines) == 1  # the runner's write after the export was refused
    assert (project / "opened-before.txt").read_text().split() == script_lines  # its inherited file went to /dev/null
    assert result.stdout.count(b"after export") == 1
    children = [int(p) for p in (project / "children.txt").read_text().split()]
    assert children, "no runner was started"
    mine, *runners = (int(n) for n in (project / "nice.txt").read_text().split())
    assert runners == [min(19, mine + runahead.RUNNER_NICE)] * len(children)  # it yields to the script and the tracer
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [n for n in os.listdir(project / "tmp") if n.startswith("lowercache-runahead-")]  # its scratch is gone
    for kind in ("tosa", "vela"):  # a cold cache, yet the script's steps hit: the runner computed them
        assert _counters(project, kind) == (1, 0), kind
    store = Store(project / "cache")
    reexports = [store.get(kind, key) for kind, key in store.actions() if kind == "reexport"]
    # the script's strict re-export, and the runner's non-strict one (``lower``'s key), laid out as strict for it
    assert sorted(entry.meta["strict"] for entry in reexports) == [False, True]


def test_the_script_and_its_runner_share_the_cache_without_damage(server, tmp_path):
    """No SQLite connection crosses the fork (``store.close_for_fork``). When the runner opened its own beside the
    script's copied ones, their writes damaged the index in 5 of 6 runs of aot_arm_compiler on transformer_block: a
    warning, a cache started afresh, and a command that could not be recorded ("opened an SQLite database")."""
    project, scratch = tmp_path / "project", tmp_path / "tmp"  # temporary files outside the project: no outputs
    project.mkdir()
    scratch.mkdir()
    (tmp_path / "inductor").mkdir()  # as once any process has lowered: torch's cache_dir() makes it in each, exist_ok
    (project / "model.py").write_text(
        "from lowercache.bench import models\nModelUnderTest, ModelInputs = models.transformer_block()\n"
    )
    aot = ["-m", "executorch.backends.arm.scripts.aot_arm_compiler", "--model_name=model.py", "--delegate", "--quantize",
           "--target=ethos-u55-128", "--output=out"]
    env = {"LOWERCACHE_DIR": str(project / "cache"), "TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for flags in [("--no-server",), ("--no-server",), ("--no-server", "--explain")]:
        result = run(server, project, PY, *aot, flags=flags, **env)
        assert result.returncode == 0, result.stderr[-3000:].decode(errors="replace")
        assert b"damaged" not in result.stderr and b"cannot be written" not in result.stderr, result.stderr[-2000:]
    assert "latest record: confirmed" in result.stdout.decode(), result.stdout.decode()


def test_off_by_setting(server, tmp_path, expected):
    project = tmp_path / "project"
    _run(server, project, "new process", PROBE="1", LAG="3", LOWERCACHE_RUN_AHEAD="0")
    assert (project / "children.txt").read_text().split() == []
    assert (project / "model.pte").read_bytes() == expected
    assert _counters(project, "tosa") == (0, 1)


@pytest.mark.parametrize("run_ahead", ["1", "0"])
def test_the_record_still_replays(server, tmp_path, expected, run_ahead):
    """The fork is lowercache's, not the script's: it does not make the command unrecordable. Nor does a Vela compile
    step's scratch in the temporary directory, inside the project here: the cold run makes it (without a runner, or with
    one that is behind), the re-runs are served the step."""
    project = tmp_path / "project"
    for _ in range(3):
        _run(server, project, "warm server", LOWERCACHE_RUN_AHEAD=run_ahead)
        assert (project / "model.pte").read_bytes() == expected
    explained = _run(server, project, "warm server", "--explain").stdout.decode()
    assert "latest lookup: hit: replayed" in explained, explained


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_confinement(tmp_path):
    """What a runner may still do after ``silence_descriptors`` and ``confine``: write under the allowed directory, nothing else."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inherited = open(tmp_path / "inherited.txt", "w")
    port = _closed_port()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            runahead.silence_descriptors(keep=(write_fd,))
            runahead.confine([str(allowed)])
            outcomes = []
            for attempt in (
                lambda: (allowed / "inside.txt").write_text("ok"),
                lambda: (tmp_path / "outside.txt").write_text("no"),
                lambda: os.remove(tmp_path / "inherited.txt"),
                lambda: socket.create_connection(("127.0.0.1", port), timeout=2),
                lambda: os.kill(os.getppid(), 0),
            ):
                try:
                    attempt()
                    outcomes.append("done")
                except OSError as e:  # Landlock's refusal, not the port's or the kernel's
                    outcomes.append("refused" if e.errno in (errno.EACCES, errno.EPERM) else f"failed {e.errno}")
            inherited.write("from the child")
            inherited.flush()
            print("to stdout", flush=True)
            os.write(write_fd, " ".join(outcomes).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    outcomes = os.read(read_fd, 1000).decode().split()
    os.waitpid(pid, 0)
    inherited.close()
    assert outcomes == ["done", "refused", "refused", "refused", "refused"]
    assert (allowed / "inside.txt").read_text() == "ok"
    assert not (tmp_path / "outside.txt").exists()
    assert (tmp_path / "inherited.txt").read_text() == ""
