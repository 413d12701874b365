"""How the recorder judges what the backstop below Python saw (``Recorder.below_python``), from a tracer's report.

The report here is what ``tracer.py`` writes (path -> kinds of access); the
judging runs after the recorded code, when some paths the code named are
gone: a descriptor's ``/proc/self/fd/N`` once closed is still the kernel's,
while a user's file that is gone is an input (missing).
"""

from __future__ import annotations

import os

from lowercache.config import Settings
from lowercache.record.recorder import Recorder


class _Report:
    """A finished tracer's report, as ``backstop.Backstop.report`` returns it."""

    def __init__(self, seen: dict[str, list[str]]):
        self.seen = seen

    def report(self) -> dict:
        return {"seen": self.seen, "odd": [], "processes": [], "stops": [len(self.seen), len(self.seen)]}


def _judged(tmp_path, seen: dict[str, list[str]]) -> tuple[set[str], set[str], list[str]]:
    recorder = Recorder(str(tmp_path), Settings(cache_dir=tmp_path / "cache"))
    recorder.below = _Report(seen)
    files, listed = recorder.below_python(set())
    return files, listed, list(recorder.unrecordable)


def test_a_closed_descriptors_proc_entry_is_no_input(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    gone = f"/proc/self/fd/{fd}"
    os.close(fd)
    assert not os.path.lexists(gone)
    files, listed, refused = _judged(tmp_path, {gone: ["look"], "/proc/self/status": ["read"], "/dev/null": ["read"]})
    assert (files, listed, refused) == (set(), set(), [])


def test_a_users_file_that_is_gone_is_an_input(tmp_path):
    gone = str(tmp_path / "data" / "w.bin")
    there = tmp_path / "w2.bin"
    there.write_bytes(b"1")
    files, _, refused = _judged(tmp_path, {gone: ["read"], str(there): ["read"]})
    assert files == {gone, str(there)} and refused == []
