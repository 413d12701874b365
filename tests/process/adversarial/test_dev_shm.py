"""A project under ``/dev/shm`` is a project like any other (issue 51 §2): device nodes and kernel files are known by
what they are, not by a path prefix, so its model file, modules and data are inputs.

Each case edits one input of a project in a fresh directory under ``/dev/shm`` (removed after) and compares what
lowercache serves with a fresh run in a new process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import replay
from tests.helpers.direct import MODEL, explain, fresh, lower, make_project, served, until_served, weights


# A miss goes through the worker's warm server (tests/process/conftest.py), as a user's does by default.
pytestmark = [pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm"),
              pytest.mark.usefixtures("through_server")]


@pytest.fixture
def shm():
    """A directory of the test's own under /dev/shm."""
    where = Path(tempfile.mkdtemp(prefix="lowercache-test-", dir="/dev/shm"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def test_direct_mode_sees_every_edit_of_a_project_under_dev_shm(shm, tmp_path):
    project, cache = make_project(shm / "proj"), tmp_path / "cache"
    time.sleep(0.1)
    previous = until_served(project, cache)
    edits = [
        ("helper.py", lambda: (project / "helper.py").write_text("OFFSET = 0.5\n")),
        ("weights.pt", lambda: torch.save(weights(2), project / "weights.pt")),
        ("model.py", lambda: (project / "model.py").write_text(MODEL.replace("torch.relu(", "torch.sigmoid("))),
    ]
    for name, edit in edits:
        edit()
        manifest, pte, _ = lower(project, cache)
        assert not served(manifest) and name in explain(project, cache), name
        assert pte == fresh(project, tmp_path) and pte != previous, name
        previous = until_served(project, cache)


def test_run_replays_a_script_under_dev_shm_only_while_its_inputs_stay(shm, cache_dir):
    """The script reads a module, a data file, a device node and a kernel file: the first two are inputs, the others
    the machine's (a replay still happens)."""
    script = ("import helper\nopen('/dev/null').read()\nopen('/proc/cpuinfo').read()\n"
              "open('out.txt', 'w').write(helper.VALUE + open('in.txt').read())\n")
    project = replay.project(shm, script)
    (project / "helper.py").write_text("VALUE = 'one '\n")
    time.sleep(0.1)
    for name, edit in (("helper.py", lambda: (project / "helper.py").write_text("VALUE = 'two '\n")),
                       ("in.txt", lambda: (project / "in.txt").write_text("xyz"))):
        replay.replayed(project, cache_dir)
        edit()
        assert name in replay.same_as_plain(project, cache_dir), name


def test_run_replays_a_script_whose_locks_are_posix_semaphores(tmp_path, cache_dir):
    """multiprocessing's locks are glibc semaphores, ``/dev/shm/sem.*`` files made and unlinked at once (by native code:
    the backstop below Python sees them): scratch, as a temporary file gone by the exit, not a write outside the tree."""
    script = ("import multiprocessing\nlock = multiprocessing.Lock()\n"
              "with lock:\n    open('out.txt', 'w').write(open('in.txt').read())\n")
    project = replay.project(tmp_path, script)
    replay.replayed(project, cache_dir)
    (project / "in.txt").write_text("xyz")
    assert "in.txt" in replay.same_as_plain(project, cache_dir)
