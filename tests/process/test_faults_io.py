"""Faults a user's input files and output directories meet (issue #30, items 1, 7, 8).

Each test reproduces the fault for real where the machine allows it: a
crafted ``.pt2`` that runs a command under ``torch.export.load``, a tmpfs
mount point as output, a read-only parent mount, writers racing on one
directory. Each ends with the bytes of a clean run or a one-line error, and
nothing run, left half-written or stored.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from lowercache import api
from lowercache.cache.store import Store
from lowercache.errors import LowercacheError
from lowercache.lowering.flow import Artifacts

from tests.helpers.cli import TINY, cli, error_lines, stock_tiny
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("through_server")




# --- a .pt2 never runs code -------------------------------------------------


class _RunsCommand:
    """Unpickling this runs ``touch marker``: what a hostile weight would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> Path:
    """examples/tiny_cnn.py saved with torch.export.save."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_example_io", ROOT / "examples" / "tiny_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net, example = module.model()
    path = tmp_path_factory.mktemp("saved") / "tiny.pt2"
    torch.export.save(torch.export.export(net, example), path)
    return path


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy the archive, letting ``edit(entries)`` change, add or drop entries (names without the root folder)."""
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
        entries = {name.split("/", 1)[1]: z.read(name) for name in z.namelist()}
    edit(entries)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(f"{root}/{name}", data)


def _pickled_weight(entries, marker):
    config = json.loads(entries["data/weights/model_weights_config.json"])
    first = next(iter(config["config"].values()))
    first["use_pickle"] = True
    entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()
    entries[f"data/weights/{first['path_name']}"] = pickle.dumps(_RunsCommand(marker))


def _constant(entries, marker, path_name):
    meta = json.loads(entries["data/weights/model_weights_config.json"])["config"]["fc.bias"]["tensor_meta"]
    config = {"config": {"hostile": {"path_name": path_name, "is_param": False, "use_pickle": True, "tensor_meta": meta}}}
    entries["data/constants/model_constants_config.json"] = json.dumps(config).encode()
    entries[f"data/constants/{path_name}"] = pickle.dumps(_RunsCommand(marker))


def _pickled_example_inputs(entries, marker):
    import io

    buffer = io.BytesIO()
    torch.save(((_RunsCommand(marker),), {}), buffer)  # a weights-only load refuses it; torch then retries without
    entries["data/sample_inputs/model.pt"] = buffer.getvalue()


def _graph_edit(entries, edit):
    doc = json.loads(entries["models/model.json"])
    edit(doc)
    entries["models/model.json"] = json.dumps(doc).encode()


def _sympy_text(entries, marker):
    def edit(doc):
        meta = doc["graph_module"]["graph"]["tensor_values"]
        name = next(iter(meta))
        meta[name]["sizes"][0] = {"as_expr": {"expr_str": f"__import__('os').system('touch {marker}')", "hint": None}}

    _graph_edit(entries, edit)


def _os_system_node(entries, marker):
    def edit(doc):
        doc["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"

    _graph_edit(entries, edit)


def _guard_code(entries, marker):
    _graph_edit(entries, lambda doc: doc.update(guards_code=[f"__import__('os').system('touch {marker}')"]))


def _legacy_weights(entries, marker):
    entries["data/weights/model.pt"] = pickle.dumps(_RunsCommand(marker))


# (craft, reason in the error, whether stock torch.export.load runs the command on it)
HOSTILE = {
    "pickled_weight": (_pickled_weight, "weight 'conv1.weight' is stored as a pickle", True),
    "pickled_constant": (lambda e, m: _constant(e, m, "tensor_0"), "constant 'hostile' is stored as a pickle", True),
    "opaque_object": (lambda e, m: _constant(e, m, "opaque_obj_0"), "is a opaque_obj_ object", True),
    "custom_object": (lambda e, m: _constant(e, m, "custom_obj_0"), "is a custom_obj_ object", False),
    "pickled_example_inputs": (_pickled_example_inputs, "example inputs need a full unpickle", True),
    "sympy_text": (_sympy_text, "symbolic shape expressions", True),
    "os_system_node": (_os_system_node, "a node calls 'torch.os.system'", False),
    "guard_code": (_guard_code, "guard code", False),
    "legacy_weights": (_legacy_weights, "data/weights/model.pt is a pickle", False),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_pt2_is_refused_in_one_line_and_runs_nothing(case, saved_tiny, tmp_path, cache_dir):
    craft, reason, stock_runs_it = HOSTILE[case]
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.pt2"
    _rewrite(saved_tiny, hostile, lambda entries: craft(entries, marker))
    if stock_runs_it:  # the file is live: stock torch runs its command
        subprocess.run([sys.executable, "-c", f"import torch\ntry: torch.export.load({str(hostile)!r})\nexcept Exception: pass"], capture_output=True, timeout=300)
        assert marker.exists(), "the crafted file should run its command under torch.export.load"
        marker.unlink()
    out = tmp_path / "out"
    result = cli("lower", hostile, "-t", "tosa-fp", "-o", out, cache_dir=cache_dir)
    assert result.returncode == 2, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and str(hostile) in lines[0] and reason in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not out.exists()
    if cache_dir.is_dir():
        assert Store(cache_dir).entry_count() == {"actions": 0, "blobs": 0}


def test_built_program_calling_a_non_operator_is_refused(saved_tiny):
    """The check after building, for a target the text check would let through: it must not reach a run."""
    from lowercache.lowering.stored import savedprogram

    program = savedprogram.load_saved_program(str(saved_tiny))
    next(n for n in program.graph.nodes if n.op == "call_function").target = os.system
    with pytest.raises(savedprogram.Refused, match="calls <built-in function system>"):
        savedprogram._check_nodes(program)


def test_saved_program_loads_as_torch_loads_it(saved_tiny):
    from lowercache.lowering.stored.savedprogram import load_saved_program

    ours, theirs = load_saved_program(str(saved_tiny)), torch.export.load(saved_tiny)
    assert str(ours.graph) == str(theirs.graph)
    assert ours.graph_signature == theirs.graph_signature
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    for name, value in ours.state_dict.items():
        assert type(value) is type(theirs.state_dict[name]) and torch.equal(value, theirs.state_dict[name])
    assert all(torch.equal(a, b) for a, b in zip(ours.example_inputs[0], theirs.example_inputs[0]))


def test_saved_program_lowers_to_stock_bytes(saved_tiny, tmp_path, cache_dir):
    out = tmp_path / "out"
    result = cli("lower", saved_tiny, "-t", "tosa-fp", "-o", out, cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.load(saved_tiny)
    edge = to_edge_transform_and_lower(program, partitioner=[TOSAPartitioner(TosaCompileSpec("TOSA-1.0+FP"))])
    assert (out / "model.pte").read_bytes() == edge.to_executorch().buffer


# --- errors stay one line -------------------------------------------------------

FACTORIES = '''
import sys
import torch

def exits():
    sys.exit(3)

def exits_with_text():
    sys.exit("no GPU here")

def mismatch():
    return torch.nn.Linear(10, 2).eval(), (torch.randn(1, 12),)
'''


@pytest.mark.parametrize(
    "model, code, expected",
    [
        ("factories.py:exits", 2, "factory factories.py:exits exited with status 3"),
        ("factories.py:exits_with_text", 2, "exited with status 1: no GPU here"),
        ("factories.py:mismatch", 1, "a and b must have same reduction dim"),
        ("broken.pt2", 2, "cannot load saved program broken.pt2"),
    ],
)
def test_errors_stay_one_line(model, code, expected, tmp_path, cache_dir):
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "broken.pt2").write_bytes(b"PK\x03\x04 this is not a saved program")
    result = cli("lower", model, "-t", "tosa-int", "-o", tmp_path / "out", cache_dir=cache_dir, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and expected in lines[0], result.stderr
    # besides the lines a CI log shows as each phase ends ("lowercache: [2/7] export: 1.20 s"), the error is the only line
    others = [line for line in result.stderr.strip().splitlines() if not re.fullmatch(r"lowercache: \[\d+/\d+\] [\w ]+: \d+\.\d\d s", line)]
    assert "Traceback" not in result.stderr and others == lines, result.stderr
    assert not (tmp_path / "out").exists()


def test_debug_keeps_torch_tracebacks(tmp_path, cache_dir):
    (tmp_path / "factories.py").write_text(FACTORIES)
    result = cli("lower", "factories.py:mismatch", "-t", "tosa-int", "-o", tmp_path / "out", cache_dir=cache_dir, cwd=tmp_path, env={"LOWERCACHE_DEBUG": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr


# --- output directories -------------------------------------------------------


def _artifacts(files: dict[str, bytes]) -> Artifacts:
    from lowercache.cache.hashing import digest

    manifest = {"files": {n: {"size": len(d), "xxh3_128": digest(d)} for n, d in sorted(files.items())}}
    return Artifacts(files=dict(files), manifest=manifest)


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_cross_device_rename_is_never_needed(tmp_path, monkeypatch):
    """The output directory as a mount point: a rename into or out of it fails with EXDEV, as the kernel's would."""
    out = tmp_path / "volume"
    out.mkdir()

    def on_volume(path) -> bool:
        resolved = Path(path).resolve()
        return resolved == out or out in resolved.parents

    def across_devices(real):
        def move(src, dst, *args, **kwargs):
            if on_volume(src) != on_volume(dst):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
            return real(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(os, "rename", across_devices(os.rename))
    monkeypatch.setattr(os, "replace", across_devices(os.replace))
    api.write_artifacts(_artifacts({"model.pte": b"pte", "partition_0.tosa": b"tosa"}), out)
    contents = _contents(out)
    assert set(contents) == {"model.pte", "partition_0.tosa", "manifest.json"}
    assert contents["model.pte"] == b"pte" and contents["partition_0.tosa"] == b"tosa"


def _mount_tmpfs(path: Path, options: str = "size=64m") -> None:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")


@contextlib.contextmanager
def _mounts():
    """Mount points made in the block, unmounted (innermost first) at its end."""
    made: list[Path] = []

    def mount(path: Path, options: str = "size=64m") -> Path:
        _mount_tmpfs(path, options)
        made.append(path)
        return path

    try:
        yield mount
    finally:
        for path in reversed(made):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_mount_point_receives_output(tmp_path, cache_dir):
    """A tmpfs mount point as --out: another device than the cache and the temp folder."""
    with _mounts() as mount:
        volume = mount(tmp_path / "volume")
        assert os.stat(volume).st_dev != os.stat(tmp_path).st_dev
        result = cli("lower", TINY, "-t", "tosa-fp", "-o", volume, cache_dir=cache_dir)
        assert result.returncode == 0, result.stderr
        assert (volume / "model.pte").read_bytes() == stock_tiny("tosa-fp")
        assert not [p for p in volume.iterdir() if p.name.startswith(".")]


def test_read_only_parent(tmp_path, cache_dir):
    """A writable mount inside a read-only one receives output; a new directory there fails before any lowering."""
    with _mounts() as mount:
        parent = mount(tmp_path / "ro")
        (parent / "out").mkdir()
        mount(parent / "out")
        remount = subprocess.run(["mount", "-o", "remount,ro", str(parent)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remount.stderr.strip()}")
        with pytest.raises(OSError):
            (parent / "probe").mkdir()
        result = cli("lower", TINY, "-t", "tosa-fp", "-o", parent / "out", cache_dir=cache_dir)
        assert result.returncode == 0, result.stderr
        assert (parent / "out" / "model.pte").read_bytes() == stock_tiny("tosa-fp")

        result = cli("lower", TINY, "-t", "tosa-int", "-o", parent / "new", cache_dir=tmp_path / "cache2")
        assert result.returncode == 2, result.stderr
        lines = error_lines(result)
        assert len(lines) == 1 and "cannot write output directory" in lines[0] and "Read-only file system" in lines[0], result.stderr
        assert not (tmp_path / "cache2").is_dir() or Store(tmp_path / "cache2").entry_count() == {"actions": 0, "blobs": 0}


def test_reused_directory_drops_only_files_the_previous_manifest_lists(tmp_path):
    out = tmp_path / "out"
    api.write_artifacts(_artifacts({"model.pte": b"old", "partition_0.tosa": b"t0", "partition_1.tosa": b"t1", "partition_1.vela.bin": b"v1", "partition_2.tosa": b"t2"}), out)
    (out / "notes.txt").write_text("the user's own file")
    (out / "partition_2.tosa").write_bytes(b"edited by the user")  # listed, but no longer what lowercache wrote
    api.write_artifacts(_artifacts({"model.pte": b"new", "partition_0.tosa": b"t0"}), out)
    assert _contents(out) == {
        "model.pte": b"new",
        "partition_0.tosa": b"t0",
        "partition_2.tosa": b"edited by the user",
        "notes.txt": b"the user's own file",
        "manifest.json": _contents(out)["manifest.json"],
    }
    assert set(json.loads(_contents(out)["manifest.json"])["files"]) == {"model.pte", "partition_0.tosa"}


def test_manifest_cannot_name_files_outside_the_directory(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_bytes(b"keep")
    api.write_artifacts(_artifacts({"model.pte": b"old"}), out)
    manifest = json.loads((out / "manifest.json").read_text())
    from lowercache.cache.hashing import digest

    for name in ("../victim.txt", str(victim)):
        manifest["files"][name] = {"size": 4, "xxh3_128": digest(b"keep")}
    (out / "manifest.json").write_text(json.dumps(manifest))
    api.write_artifacts(_artifacts({"model.pte": b"new"}), out)
    assert victim.read_bytes() == b"keep"


def test_staging_left_by_a_killed_run_is_removed_later(tmp_path):
    out = tmp_path / "out"
    abandoned, live = out / ".lowercache-tmp-killed", out / ".lowercache-tmp-live"
    for folder in (abandoned, live):
        folder.mkdir(parents=True)
        (folder / "model.pte").write_bytes(b"half")
    os.utime(abandoned, (0, 0))
    api.write_artifacts(_artifacts({"model.pte": b"pte"}), out)
    assert not abandoned.exists() and (live / "model.pte").read_bytes() == b"half"


def test_reused_directory_after_ethos_u_holds_only_the_new_lowering(tmp_path, cache_dir):
    out = tmp_path / "out"
    assert cli("lower", TINY, "-t", "ethos-u55-128", "-o", out, cache_dir=cache_dir).returncode == 0
    assert any(p.name.startswith("partition_0.vela") for p in out.iterdir())
    result = cli("lower", TINY, "-t", "tosa-fp", "-o", out, cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.pte", "partition_0.tosa"]
    assert (out / "model.pte").read_bytes() == stock_tiny("tosa-fp")


def test_racing_writers_of_a_new_directory_both_succeed(tmp_path):
    files = {"model.pte": os.urandom(4096), "partition_0.tosa": os.urandom(2048)}
    expected = None
    for i in range(300):
        out = tmp_path / f"race{i}" / "out"
        barrier = threading.Barrier(2)
        failures: list[BaseException] = []

        def write():
            barrier.wait()
            try:
                api.write_artifacts(_artifacts(files), out)
            except BaseException as e:  # noqa: BLE001  (any failure is the finding)
                failures.append(e)

        threads = [threading.Thread(target=write) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not failures, failures
        contents = _contents(out)
        expected = expected or contents
        assert contents == expected


def test_racing_processes_write_the_same_bytes(tmp_path):
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from lowercache import api\n"
        "from lowercache.lowering.flow import Artifacts\n"
        "files = {'model.pte': bytes(range(256)) * 64, 'partition_0.tosa': b'tosa' * 512}\n"
        "for i in range(100):\n"
        "    api.write_artifacts(Artifacts(files=files, manifest={'n': 1}), Path(sys.argv[1]) / str(i) / 'out')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    for i in range(100):
        assert sorted(_contents(tmp_path / str(i) / "out")) == ["manifest.json", "model.pte", "partition_0.tosa"]


def test_failed_write_leaves_no_new_directory(tmp_path, monkeypatch):
    real_replace = os.replace

    def full_disk(src, dst, *args, **kwargs):
        if Path(dst).name == "partition_0.tosa":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full_disk)
    out = tmp_path / "out"
    before = set(tmp_path.iterdir())  # the test's own settings (conftest.py)
    with pytest.raises(LowercacheError, match="No space left on device"):
        api.write_artifacts(_artifacts({"model.pte": b"pte", "partition_0.tosa": b"t"}), out)
    assert not out.exists() and set(tmp_path.iterdir()) == before


@pytest.mark.parametrize("data", [b"PK\x03\x04 this is not a saved program", b"hello"])
def test_an_unreadable_archive_is_named_in_one_sentence(data, tmp_path):
    """torch's reader says what is wrong, then adds advice about corrupt checkpoints: only the first is kept."""
    from lowercache.lowering.stored.savedprogram import load_saved_program

    (tmp_path / "broken.pt2").write_bytes(data)
    with pytest.raises(LowercacheError) as caught:
        load_saved_program(str(tmp_path / "broken.pt2"))
    message = str(caught.value)
    assert message.startswith(f"cannot load saved program {tmp_path}/broken.pt2: RuntimeError: PytorchStreamReader")
    assert "zip archive" in message and "internal miniz error" not in message and "\n" not in message
    assert len(message) < 200 + len(str(tmp_path)), message
