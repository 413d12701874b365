"""The command's own output files (``sweep.streams_written``): found for ``> log`` and ``| tee log``, and a pipe that stdout
and stderr share (``2>&1 | tee``) is followed through ``/proc`` once, not once per stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CODE = """
import json, os, time
from lowercache import sweep
while not os.path.exists("build.log"):  # a pipeline starts its commands at once: wait for tee to open its file
    time.sleep(0.01)
walks = []
follow = sweep._tee_files
sweep._tee_files = lambda pipe: walks.append(pipe) or follow(pipe)
out, err = sweep.streams_written()
print(json.dumps({"out": out, "err": err, "walks": len(walks)}))
"""


def _ran(shell: str, cwd) -> dict:
    subprocess.run(["sh", "-c", shell.format(python=sys.executable, code=CODE.replace("'", "\\'"))], cwd=cwd, check=True,
                   stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)  # no other file written
    return json.loads((cwd / "build.log").read_text())


def _id(path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def test_one_pipe_for_both_streams_is_followed_once(tmp_path):
    found = _ran("{python} -c '{code}' 2>&1 | tee build.log >/dev/null", tmp_path)
    assert found["walks"] == 1
    assert found["out"] == found["err"] == [_id(tmp_path / "build.log")]


def test_two_pipes_are_each_followed(tmp_path):
    found = _ran("{{ {python} -c '{code}' 2>/dev/fd/3 | tee build.log >/dev/null; }} 3>&1 | cat >/dev/null", tmp_path)
    assert found["walks"] == 2
    assert found["out"] == [_id(tmp_path / "build.log")] and found["err"] == []


def test_a_file_is_no_pipe(tmp_path):
    found = _ran("{python} -c '{code}' >build.log 2>&1", tmp_path)
    assert found["walks"] == 0
    assert found["out"] == found["err"] == [_id(tmp_path / "build.log")]
