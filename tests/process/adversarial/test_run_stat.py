"""``lowercache run``'s replay sees every stat field a script could observe (issue 51 §5, first bullet).

Each script writes a field it read; it is replayed, the field is changed without changing any file's content, and the
next run must run the script and write what plain ``python`` writes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import replay



def _chmod_round_trip(project: Path) -> None:
    os.chmod(project / "in.txt", 0o755)
    os.chmod(project / "in.txt", 0o644)


def _copy_and_move(project: Path) -> None:
    """``cp -p in.txt in.tmp && mv in.tmp in.txt``: the same bytes, mode and mtime in a new inode."""
    shutil.copy2(project / "in.txt", project / "in.tmp")
    os.replace(project / "in.tmp", project / "in.txt")


def _append(project: Path) -> None:
    with open(project / "data" / "b.txt", "ab") as f:
        f.write(b"more")


CASES = {
    "ctime": ("os.stat('in.txt').st_ctime_ns", _chmod_round_trip),
    "getctime": ("os.path.getctime('in.txt')", _chmod_round_trip),
    "fstat-ctime": ("(lambda f: os.fstat(f.fileno()).st_ctime_ns)(open('in.txt'))", _chmod_round_trip),
    "inode": ("os.stat('in.txt').st_ino", _copy_and_move),
    "samefile": ("os.path.samefile('in.txt', 'twin.txt')", _copy_and_move),
    "nlink": ("Path('in.txt').stat().st_nlink", lambda p: os.link(p / "in.txt", p / "in-again.txt")),
    "lstat": ("os.lstat('in.txt').st_ctime_ns", _chmod_round_trip),
    "dir-mtime": ("os.stat('data').st_mtime_ns", lambda p: (p / "data" / "c.txt").write_bytes(b"")),
    "scandir-stat": ("sorted((e.name, e.stat().st_size) for e in os.scandir('data'))", _append),
    "scandir-inode": ("sorted((e.name, e.inode()) for e in os.scandir('data'))",
                      lambda p: (shutil.copy2(p / "data" / "a.txt", p / "a.tmp"), os.replace(p / "a.tmp", p / "data" / "a.txt"))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_run_replays_a_stat_field_only_while_it_is_unchanged(tmp_path, cache_dir, case):
    seen, change = CASES[case]
    project = replay.project(tmp_path, f"import os\nfrom pathlib import Path\nopen('out.txt', 'w').write(str({seen}))\n")
    (project / "data").mkdir()
    (project / "data" / "a.txt").write_bytes(b"a")
    (project / "data" / "b.txt").write_bytes(b"b")
    os.link(project / "in.txt", project / "twin.txt")
    os.utime(project / "data", ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))
    replay.replayed(project, cache_dir)
    change(project)
    replay.same_as_plain(project, cache_dir)
