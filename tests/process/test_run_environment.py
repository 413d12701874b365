"""``lowercache run``'s replay under the environment rule: every variable is an input (``TZ``, which only C code reads,
included) but the short list of those that only say how output is shown (``lowercache/environment.py``)."""

from __future__ import annotations

from tests.helpers import replay

# The local hour at the epoch: C's localtime reads TZ itself, Python's os.environ never hears it.
SCRIPT = """
import time
with open("out.txt", "w") as f:
    f.write(time.strftime("%H", time.localtime(0)))
print("done")
"""


def test_a_replay_follows_tz_and_not_the_terminal(tmp_path):
    project, cache = replay.project(tmp_path, SCRIPT), tmp_path / "cache"
    utc = {"TZ": "UTC"}
    for _ in range(3):
        assert replay.run(project, cache, env=utc).returncode == 0
    assert "latest lookup: hit" in replay.explain(project, cache) and (project / "out.txt").read_text() == "00"

    for shown in ({"COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}, {"CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_RUN_ID": "7"}):
        assert replay.run(project, cache, env={**utc, **shown}).returncode == 0
        assert "latest lookup: hit" in replay.explain(project, cache)

    tokyo = {"TZ": "Asia/Tokyo"}
    assert replay.run(project, cache, env=tokyo).returncode == 0
    served = (project / "out.txt").read_text()
    assert "environment variable TZ differs from the record's" in replay.explain(project, cache)
    assert replay.plain(project, env=tokyo).returncode == 0
    assert served == (project / "out.txt").read_text() == "09"
