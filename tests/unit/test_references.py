"""The run's shared fresh references (``tests/helpers/references.py``): one run per key, a fresh run on any change."""

from __future__ import annotations

import importlib.util
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import references

# Writes what it read (through the link too) and where it ran to out/result.txt, and counts its runs outside the tree.
SCRIPT = """
import os, sys
os.makedirs("out", exist_ok=True)
text = open("input.txt").read() + open("linked/data.txt").read() + os.environ.get("GREETING", "-")
open("out/result.txt", "w").write(text + " in " + os.getcwd())
open(sys.argv[1], "a").write("run\\n")
print("lowered", text, os.environ.get("PYTEST_CURRENT_TEST", "by hand"))
"""


@pytest.fixture
def run_dir(tmp_path):
    """A run's directory of its own, as ``conftest.py`` sets one for the whole suite; the suite's put back after."""
    previous = references.directory()
    references.begin(tmp_path / "run")
    (tmp_path / "run").mkdir()
    yield tmp_path / "run"
    references.begin(previous)


def project(base: Path, text: str = "a", data: str = "x") -> Path:
    root = base / "project"
    root.mkdir(parents=True)
    for name, content in (("one", data), ("two", "y")):  # outside the project: found through the link
        (base / "targets" / name).mkdir(parents=True)
        (base / "targets" / name / "data.txt").write_text(content)
    (root / "linked").symlink_to("../targets/one")
    (root / "input.txt").write_text(text)
    (root / "script.py").write_text(SCRIPT)
    return root


def fresh(base: Path, counter: Path, **env: str) -> tuple[str, str]:
    root = base / "project"
    result = references.run([sys.executable, "script.py", counter], cwd=root, env={**os.environ, **env},
                            outputs=[root / "out" / "result.txt"], places={base: "<tmp>"}, ignore=(str(root / "out"),))
    assert result.returncode == 0, result.stderr
    return (root / "out" / "result.txt").read_text(), result.stdout


def runs(counter: Path) -> int:
    return len(counter.read_text().split()) if counter.exists() else 0


def test_the_same_project_in_another_test_directory_is_run_once(tmp_path, run_dir):
    counter = tmp_path / "runs.log"
    first, second = tmp_path / "a", tmp_path / "b"
    project(first), project(second)
    assert fresh(first, counter) == (f"ax- in {first / 'project'}", "lowered ax- by hand\n")  # pytest's variables left out
    assert fresh(second, counter) == (f"ax- in {second / 'project'}", "lowered ax- by hand\n")  # paths written for this test
    assert runs(counter) == 1
    assert references.summary(run_dir) == "fresh references shared across the run: 1 served, 1 run"


@pytest.mark.parametrize("change, read", [
    (lambda root: (root / "input.txt").write_text("b"), "bx-"),
    (lambda root: (root.parent / "targets" / "one" / "data.txt").write_text("z"), "az-"),  # read through the link
    (lambda root: ((root / "linked").unlink(), (root / "linked").symlink_to("../targets/two")), "ay-"),
    (lambda root: (root / "script.py").chmod(0o700), "ax-"),
    (lambda root: (root / "extra.txt").write_text(""), "ax-"),
], ids=["file", "link-target", "re-pointed-link", "mode", "new-file"])
def test_a_changed_input_is_run_again(tmp_path, run_dir, change, read):
    counter = tmp_path / "runs.log"
    root = project(tmp_path)
    fresh(tmp_path, counter)
    change(root)
    assert fresh(tmp_path, counter)[0] == f"{read} in {root}"
    assert runs(counter) == 2


def test_a_changed_variable_or_an_earlier_output_counts_only_where_it_is_an_input(tmp_path, run_dir):
    counter = tmp_path / "runs.log"
    project(tmp_path)
    fresh(tmp_path, counter)
    assert fresh(tmp_path, counter, GREETING="hi")[0].startswith("axhi")
    assert runs(counter) == 2
    (tmp_path / "project" / "out" / "stale.txt").write_text("an earlier output")
    fresh(tmp_path, counter)
    assert runs(counter) == 2


def test_bytecode_of_the_source_is_no_input_and_other_bytecode_is(tmp_path, run_dir):
    """Bytecode Python wrote from the source (an earlier run's) leaves the key as it was, so another test's copy of the
    project shares it; bytecode of other code under the source's recorded mtime and size, which Python runs, does not,
    until the source's mtime moves on."""
    counter = tmp_path / "runs.log"
    script = "import sys, helper\nopen('out.txt', 'w').write(helper.VALUE)\nopen(sys.argv[1], 'a').write('run\\n')\n"

    def run(base: Path) -> str:
        root = base / "project"
        result = references.run([sys.executable, "script.py", counter], cwd=root, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""},
                                outputs=[root / "out.txt"], places={base: "<tmp>"})
        assert result.returncode == 0, result.stderr
        return (root / "out.txt").read_text()

    for name in ("a", "b"):
        (tmp_path / name / "project").mkdir(parents=True)
        (tmp_path / name / "project" / "script.py").write_text(script)
        (tmp_path / name / "project" / "helper.py").write_text("VALUE = 'a'\n")
    assert run(tmp_path / "a") == "a"
    assert list((tmp_path / "a" / "project" / "__pycache__").glob("helper.*.pyc"))  # the run wrote it
    assert run(tmp_path / "a") == run(tmp_path / "b") == "a"
    assert runs(counter) == 1

    helper = tmp_path / "b" / "project" / "helper.py"
    info = helper.stat()
    header = b"".join(value.to_bytes(4, "little") for value in (0, int(info.st_mtime) & 0xFFFFFFFF, info.st_size))
    (helper.parent / "__pycache__").mkdir()
    (helper.parent / "__pycache__" / f"helper.{sys.implementation.cache_tag}.pyc").write_bytes(
        importlib.util.MAGIC_NUMBER + header + marshal.dumps(compile("VALUE = 'b'\n", str(helper), "exec")))
    assert run(tmp_path / "b") == "b"  # Python trusted the bytecode: the reference ran again and saw it
    assert runs(counter) == 2
    os.utime(helper, (info.st_atime, info.st_mtime + 5))
    assert run(tmp_path / "b") == "a"  # the recorded mtime is not the source's: Python compiled the source, as at first
    assert runs(counter) == 2


def test_a_damaged_entry_is_run_again_and_nothing_is_kept_outside_a_run(tmp_path, run_dir):
    counter = tmp_path / "runs.log"
    project(tmp_path)
    fresh(tmp_path, counter)
    for entry in run_dir.iterdir():
        if len(entry.name) == 64:
            entry.write_bytes(entry.read_bytes()[:-3] + b"xyz")
    assert fresh(tmp_path, counter)[0].startswith("ax-")
    assert runs(counter) == 2
    references.begin(None)
    fresh(tmp_path, counter)
    fresh(tmp_path, counter)
    assert runs(counter) == 4


def test_a_failed_run_is_not_kept(tmp_path, run_dir):
    counter = tmp_path / "runs.log"
    root = project(tmp_path)
    (root / "input.txt").unlink()
    for _ in range(2):
        result = references.run([sys.executable, "script.py", counter], cwd=root, env=dict(os.environ),
                                outputs=[root / "out" / "result.txt"], places={tmp_path: "<tmp>"})
        assert result.returncode != 0 and "input.txt" in result.stderr
    assert not any(len(entry.name) == 64 for entry in run_dir.iterdir())


def test_workers_share_one_run_through_the_lock(tmp_path, run_dir):
    """Two processes asking at once: the second waits for the first one's result."""
    counter = tmp_path / "runs.log"
    for name in ("a", "b"):
        project(tmp_path / name)
    code = ("import sys; from pathlib import Path; from tests.helpers import references; references.begin(sys.argv[1]); "
            "base = Path(sys.argv[2]); root = base / 'project'; "
            "r = references.run([sys.executable, 'script.py', sys.argv[3]], cwd=root, env={}, "
            "outputs=[root / 'out' / 'result.txt'], places={base: '<tmp>'}); assert r.returncode == 0")
    workers = [subprocess.Popen([sys.executable, "-c", code, str(run_dir), str(tmp_path / name), str(counter)],
                                cwd=Path(references.__file__).parents[2]) for name in ("a", "b")]
    assert [worker.wait(timeout=120) for worker in workers] == [0, 0]
    assert runs(counter) == 1
    assert (tmp_path / "b" / "project" / "out" / "result.txt").read_text().endswith(str(tmp_path / "b" / "project"))
