"""What a direct-mode record and a ``lowercache run`` replay record must see (issue 40 §2, §3, §5; issue 41 item 1).

Each case changes an input the record once left out, then compares what
lowercache serves with a fresh run in a new process (``--no-cache
--no-server`` for ``lower``, plain ``python`` for ``run``).
"""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lowercache import sweep

from tests.helpers import replay
from tests.helpers.direct import (MODEL, PORTABLE_MODEL, TARGET, cli_env, explain, fresh, lower, make_project, served, tiny_project,
                                  until_served)


# A miss goes through the worker's warm server (tests/process/conftest.py), as a user's does by default.
pytestmark = pytest.mark.usefixtures("through_server")

BYTECODE_ON = {"PYTHONDONTWRITEBYTECODE": ""}  # the suite turns bytecode writing off; users have it on


# -- direct mode: a helper run from its bytecode --------------------------------------------------------

SPEC_LOADED = '''
import importlib.util
import torch


def model():
    spec = importlib.util.spec_from_file_location("width_helper", "helper.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, helper.WIDTH), torch.nn.ReLU())
    return net.eval(), (torch.randn(1, 8),)
'''

HUB_LOADED = '''
import torch


def model():
    width = torch.hub.load(".", "width", source="local", trust_repo=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU())
    return net.eval(), (torch.randn(1, 8),)
'''


@pytest.mark.parametrize("loader, helper, text", [
    ("spec", "helper.py", "WIDTH = {}\n"),
    ("hub", "hubconf.py", "def width():\n    return {}\n"),
])
def test_a_helper_run_from_its_bytecode_is_an_input(tmp_path, loader, helper, text):
    """With bytecode on, ``exec_module`` of a file outside ``sys.modules`` reads only its ``.pyc``: the source is an input
    all the same. The first lowering records (Python writing that ``.pyc`` is no "file descriptor" of the factory's)."""
    project = tiny_project(tmp_path / "proj", SPEC_LOADED if loader == "spec" else HUB_LOADED)
    (project / helper).write_text(text.format(4))
    cache = tmp_path / "cache"
    first, _, _ = lower(project, cache, env=BYTECODE_ON)
    assert first["direct"]["record"] == "unconfirmed", first["direct"]
    assert list((project / "__pycache__").glob(f"{Path(helper).stem}.*.pyc"))
    until_served(project, cache, BYTECODE_ON)

    (project / helper).write_text(text.format(12))
    manifest, pte, _ = lower(project, cache, env=BYTECODE_ON)
    assert not served(manifest) and helper in explain(project, cache)
    assert pte == fresh(project, tmp_path, BYTECODE_ON)


# -- direct mode: where the project is -------------------------------------------------------------------

LOCATED = '''
import os
from pathlib import Path
import torch


def model():
    width = int({where}.rsplit("_", 1)[-1])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, width, 3), torch.nn.ReLU())
    return net.eval(), (torch.randn(1, 3, 8, 8),)
'''
WHERE = {"cwd": "os.path.basename(os.getcwd())", "path-cwd": "Path.cwd().name", "file": "Path(__file__).resolve().parent.name"}


@pytest.mark.parametrize("how", sorted(WHERE))
def test_a_record_made_outside_a_git_tree_does_not_answer_in_another_directory(tmp_path, how):
    """Outside a git work tree the project root is the working directory: a factory reading its directory's name
    must not be served the other directory's ``.pte``."""
    model = LOCATED.format(where=WHERE[how])
    first, second = tiny_project(tmp_path / "one" / "net_4", model, git=False), tiny_project(tmp_path / "two" / "net_6", model, git=False)
    cache = tmp_path / "cache"
    served_first = until_served(first, cache)
    manifest, pte, _ = lower(second, cache)
    assert not served(manifest) and "another directory" in explain(second, cache)
    assert pte == fresh(second, tmp_path) and pte != served_first


def test_through_the_remote_tier_a_clone_elsewhere_gets_its_own_bytes(tmp_path, s3_url):
    """Clones with empty local caches and one shared remote: a second clone that sees its directory is not answered
    from the first's record; once two clones lowered the same inputs to the same key, a third is, from the remote."""
    env = {"LOWERCACHE_REMOTE": s3_url, "LOWERCACHE_HMAC_KEY": "records-test-key",
           **{k: v for k, v in os.environ.items() if k.startswith(("AWS_", "LOWERCACHE_S3_"))}}
    model = LOCATED.format(where=WHERE["cwd"])
    first = tiny_project(tmp_path / "one" / "net_4", model, git=False)
    until_served(first, tmp_path / "cache-one", env)
    second = tiny_project(tmp_path / "two" / "net_6", model, git=False)
    manifest, pte, _ = lower(second, tmp_path / "cache-two", env=env)
    assert not served(manifest) and pte == fresh(second, tmp_path)

    original = make_project(tmp_path / "a" / "proj", model=PORTABLE_MODEL)
    until_served(original, tmp_path / "cache-a", env)
    for name in ("b", "c"):
        clone = tmp_path / name / "clone"
        shutil.copytree(original, clone, ignore=shutil.ignore_patterns("out", "fresh", "__pycache__"))
        manifest, pte, _ = lower(clone, tmp_path / f"cache-{name}", env=env)
        assert served(manifest) == (name == "c"), explain(clone, tmp_path / f"cache-{name}")  # b confirmed it elsewhere
    assert manifest["steps"][0]["tier"] == "remote" and pte == fresh(clone, tmp_path)


def test_a_copy_hits_once_a_second_directory_confirmed_the_record_and_never_when_its_code_sees_where_it_is(tmp_path):
    """A copy of a project is answered from the original's record once another copy lowered the same inputs to the
    same key; a factory that can see its checkout misses, with the copy's bytes."""
    cache = tmp_path / "cache"
    original = make_project(tmp_path / "a" / "proj", model=PORTABLE_MODEL)
    until_served(original, cache)
    for name in ("b", "c"):
        copy = tmp_path / name / "clone"
        shutil.copytree(original, copy, ignore=shutil.ignore_patterns("out", "fresh", "__pycache__"))
        manifest, pte, _ = lower(copy, cache)
        assert served(manifest) == (name == "c"), explain(copy, cache)
        assert pte == fresh(copy, tmp_path)

    # Its checkpoint found through __file__; a width from the checkout's name; the same through code it compiles,
    # whose file names nothing (and an absolute path's resolve() calls no os.getcwd()).
    located = {"checkout": "Path.cwd().name", "compiled": 'eval("Path(__fi" + "le__).resolve().parent.name")'}
    for name in ("file", "checkout", "compiled"):
        if name == "file":
            original = make_project(tmp_path / name / "net_4", model=MODEL)
        else:
            original = tiny_project(tmp_path / name / "net_4", LOCATED.format(where=located[name]))
        lower(original, cache)
        lower(original, cache)  # confirmed
        copy = tmp_path / name / "net_6"
        shutil.copytree(original, copy, ignore=shutil.ignore_patterns("out", "fresh", "__pycache__"))
        manifest, pte, _ = lower(copy, cache)
        assert not served(manifest) and "another directory" in explain(copy, cache), name
        assert pte == fresh(copy, tmp_path), name


# -- direct mode: files native code reads ------------------------------------------------------------------

NATIVE = '''
import torch


def model():
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    with torch.no_grad():
        net.weight.copy_(torch.from_file("weights/fc.bin", size=32, dtype=torch.float32).reshape(4, 8))
        net.bias.copy_(torch.from_file("scales.f32", size=4, dtype=torch.float32))
    return net.eval(), (torch.randn(1, 8),)
'''


def _values(path: Path, seed: int, count: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    path.write_bytes(torch.randn(count).numpy().tobytes())


def test_files_read_by_native_code_are_inputs(tmp_path):
    """``torch.from_file`` reads in C++, unheard: a weights file in the project tree, and a data file beside the model
    whatever its suffix, are swept and checked on each hit."""
    project, cache = tiny_project(tmp_path / "proj", NATIVE), tmp_path / "cache"
    _values(project / "weights" / "fc.bin", 1, 32)
    _values(project / "scales.f32", 1, 4)
    until_served(project, cache)
    edits = (("weights/fc.bin", 32), ("scales.f32", 4))
    for name, count in edits:
        _values(project / name, 2, count)  # same size, other values
        manifest, pte, _ = lower(project, cache)
        assert not served(manifest) and name in explain(project, cache), name
        assert pte == fresh(project, tmp_path), name
        if (name, count) != edits[-1]:
            lower(project, cache)  # the re-run confirms the new record, so the next edit meets a trusted one


def test_past_the_sweeps_bound_no_record_is_used(tmp_path):
    """More data files than a hit can afford to check: no record is trusted, and ``explain`` says why."""
    project, cache = tiny_project(tmp_path / "proj", NATIVE), tmp_path / "cache"
    _values(project / "weights" / "fc.bin", 1, 32)
    _values(project / "scales.f32", 1, 4)
    (project / "data").mkdir()
    for i in range(sweep.MAX_FILES + 1):
        (project / "data" / f"{i}.npy").write_bytes(b"")
    for _ in range(2):
        manifest, _, _ = lower(project, cache)
        assert not served(manifest) and manifest["direct"]["record"] == "untrusted"
    assert f"more than {sweep.MAX_FILES} data files" in explain(project, cache)


# -- direct mode at a terminal ---------------------------------------------------------------------------


def lower_at_terminal(project: Path, cache: Path) -> tuple[dict, bytes, str]:
    """``lowercache lower`` with a pseudo-terminal as its standard streams (the progress display runs)."""
    import json

    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "lowercache.cli", "lower", "model.py:model", "-t", TARGET, "-o", "out"],
        stdin=child, stdout=child, stderr=child, cwd=project, env=cli_env(cache, {"TERM": "xterm", "COLUMNS": "100"}),
    )
    os.close(child)
    output = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        output += chunk
    os.close(main)
    assert process.wait(timeout=900) == 0, output.decode(errors="replace")[-3000:]
    manifest = json.loads((project / "out" / "manifest.json").read_text())
    return manifest, (project / "out" / "model.pte").read_bytes(), output.decode(errors="replace")


def test_at_a_terminal_a_warm_run_is_a_direct_hit_and_a_factorys_thread_still_counts(tmp_path):
    """lowercache's own progress thread is not the factory's; a thread the factory leaves, named like it, still is."""
    project, cache = make_project(tmp_path / "proj"), tmp_path / "cache"
    outcomes = [lower_at_terminal(project, cache) for _ in range(3)]
    assert "\x1b[" in outcomes[0][2]  # the progress display drew
    assert [m["direct"].get("record") for m, _, _ in outcomes[:2]] == ["unconfirmed", "confirmed"], outcomes[1][0]["direct"]
    assert served(outcomes[2][0]) and outcomes[2][1] == fresh(project, tmp_path)

    threaded = MODEL.replace("    torch.manual_seed(0)\n", "    import threading, time\n    threading.Thread(target=time.sleep, args=(60,), "
                             "name='lowercache-progress', daemon=True).start()\n    torch.manual_seed(0)\n")
    project = make_project(tmp_path / "threaded", model=threaded)
    manifest, _, _ = lower_at_terminal(project, cache)
    assert manifest["direct"] == {"record": "untrusted", "reason": "the factory left a thread running (lowercache-progress)"}


# -- lowercache run --------------------------------------------------------------------------------------


def test_run_sees_which_checkout_pythonpath_names(tmp_path, cache_dir):
    for name in ("checkout-a", "checkout-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendored.py").write_text(f"VALUE = {name!r}\n")
    project = replay.project(tmp_path, "import vendored\nopen('out.txt', 'w').write(vendored.VALUE)\nprint(vendored.VALUE)\n")
    behind = os.pathsep + os.environ.get("PYTHONPATH", "")  # where this lowercache is found
    replay.replayed(project, cache_dir, {"PYTHONPATH": str(tmp_path / "checkout-a") + behind})
    explained = replay.same_as_plain(project, cache_dir, {"PYTHONPATH": str(tmp_path / "checkout-b") + behind})
    assert "PYTHONPATH" in explained and (project / "out.txt").read_text() == "checkout-b"


@pytest.mark.parametrize("script, change", [
    ("import os\nopen('out.txt', 'w').write(str(os.path.getmtime('in.txt')))\n",
     lambda p: os.utime(p / "in.txt", ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))),
    ("import os\nopen('out.txt', 'w').write(str(os.access('in.txt', os.X_OK)))\n", lambda p: os.chmod(p / "in.txt", 0o755)),
], ids=["mtime", "mode"])
def test_run_sees_a_files_mtime_and_mode(tmp_path, cache_dir, script, change):
    project = replay.project(tmp_path, script)
    replay.replayed(project, cache_dir)
    change(project)
    explained = replay.same_as_plain(project, cache_dir)
    assert "in.txt changed" in explained


@pytest.mark.parametrize("read", ["posix.environ[b'GREETING']", "posix.environ.get(b'GREETING')"])
def test_run_sees_the_bytes_environ(tmp_path, cache_dir, read):
    project = replay.project(tmp_path, f"import os, posix\nopen('out.txt', 'wb').write({read})\n")
    replay.replayed(project, cache_dir, {"GREETING": "hello"})
    explained = replay.same_as_plain(project, cache_dir, {"GREETING": "bye"})
    assert "environment variable GREETING differs from the record's" in explained  # every variable is in the identity


def test_run_sees_a_file_read_by_native_code(tmp_path, cache_dir):
    script = textwrap.dedent("""
        import ctypes
        libc = ctypes.CDLL(None)
        buffer = ctypes.create_string_buffer(16)
        fd = libc.open(b"weights.bin", 0)
        size = libc.read(fd, buffer, 16)
        libc.close(fd)
        open("out.txt", "wb").write(buffer.raw[:size])
        """)
    project = replay.project(tmp_path, script)
    (project / "weights.bin").write_bytes(b"0123456789")
    replay.replayed(project, cache_dir)
    (project / "weights.bin").write_bytes(b"9876543210")
    explained = replay.same_as_plain(project, cache_dir)
    assert "weights.bin changed" in explained


def test_run_records_with_bytecode_writing_on_and_still_refuses_a_users_descriptor(tmp_path, cache_dir):
    """Python writing a new module's ``.pyc`` goes through a descriptor; a script reading through one is still refused."""
    project = replay.project(tmp_path, "import helper\nopen('out.txt', 'w').write(helper.VALUE)\n")
    (project / "helper.py").write_text("VALUE = 'one'\n")
    assert replay.run(project, cache_dir, env=BYTECODE_ON).returncode == 0
    assert "latest record: unconfirmed" in replay.explain(project, cache_dir), replay.explain(project, cache_dir)
    assert list((project / "__pycache__").glob("helper.*.pyc"))

    (project / "script.py").write_text("import os\nfd = os.open('in.txt', os.O_RDONLY)\nopen('out.txt', 'w').write(os.fdopen(fd).read())\n")
    for _ in range(2):
        assert replay.run(project, cache_dir, env=BYTECODE_ON).returncode == 0
    assert "opened a file descriptor" in replay.explain(project, cache_dir)
    replay.same_as_plain(project, cache_dir, BYTECODE_ON)
