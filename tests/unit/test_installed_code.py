"""A record holds the installed code its process loaded (``Recorder.installed_code``): an edit in place to an installed
library, which neither a version nor the site directory's listing shows, stops the record from answering."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from lowercache.config import Settings
from lowercache.record import places, recorder
from lowercache.record.trust import check_inputs, inputs_changed

pytestmark = pytest.mark.quick


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site directory of its own, with one installed library, ``fakelib``, loaded."""
    site = tmp_path / "site"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text("SCALE = 1\n")
    monkeypatch.setattr(places, "site_dirs", lambda: {"purelib": str(site)})
    monkeypatch.syspath_prepend(str(site))
    importlib.import_module("fakelib")
    yield site
    sys.modules.pop("fakelib", None)


def _inputs(found):
    return {"files": [], "listings": [], "lookups": [], "syspath": [], "installed": found, "env": {},
            "location": {"root": "/", "portable": False, "why": ""}}


def test_an_edit_in_place_to_a_loaded_library_is_seen_and_same_bytes_are_not(tmp_path, site):
    rec = recorder.Recorder(str(tmp_path / "project"), Settings(cache_dir=tmp_path / "cache"))
    found = rec.installed_code()
    assert [ref for ref, *_ in found if ref[1].startswith("fakelib")] == [["purelib", "fakelib/__init__.py"]]
    inputs = _inputs(found)
    check_inputs(inputs)
    here = places.Places(str(tmp_path / "project"))
    assert inputs_changed(inputs, here, 0, str(tmp_path), {}) is None
    module = site / "fakelib" / "__init__.py"
    module.write_text("SCALE = 2\n")  # the same size: only the content (and the ctime) moved
    assert inputs_changed(inputs, here, 0, str(tmp_path), {}) == f"installed code changed: {module}"
    module.write_text("SCALE = 1\n")  # the bytes recorded, a new stat: the content decides
    assert inputs_changed(inputs, here, 0, str(tmp_path), {}) is None
    module.unlink()
    assert inputs_changed(inputs, here, 0, str(tmp_path), {}) == f"installed code changed: {module}"


def test_what_the_toolchain_part_hashes_and_lowercache_are_left_to_the_identity(tmp_path, site):
    import torch  # noqa: F401  (loaded, hashed whole into the toolchain identity)

    monkeypatch_site = {"purelib": os.path.dirname(os.path.dirname(torch.__file__))}
    rec = recorder.Recorder(str(tmp_path / "project"), Settings(cache_dir=tmp_path / "cache"))
    rec.places.anchors.update(monkeypatch_site)
    paths = [rec.places.path(ref) for ref, *_ in rec.installed_code()]
    of_torch = [p for p in paths if p.startswith(os.path.dirname(torch.__file__) + os.sep)]
    assert paths and of_torch and all(p.endswith(".so") for p in of_torch)  # its compiled libraries: by version only
    assert not [p for p in paths if p.startswith(recorder._PACKAGE + os.sep)]


def test_a_record_without_installed_code_is_malformed():
    inputs = _inputs([])
    del inputs["installed"]
    with pytest.raises(ValueError):
        check_inputs(inputs)
    with pytest.raises(ValueError):
        check_inputs(_inputs([[["purelib", "x.py"], "not a stat", "d"]]))


class _Below:
    """What the backstop below Python reports: paths, each with how the process used it."""

    def __init__(self, seen: dict[str, list[str]]):
        self.seen = seen

    def report(self) -> dict:
        return {"seen": self.seen, "odd": [], "processes": [], "stops": [len(self.seen), len(self.seen)]}


@pytest.mark.parametrize("how", ["python", "native"])
def test_a_data_file_read_in_site_packages_is_checked_with_the_installed_code(tmp_path, site, how):
    """A library's own data (a vocabulary, a config shipped in the wheel) read from Python or native code."""
    data = site / "fakelib" / "vocab.json"
    data.write_text('{"a": 1}\n')
    rec = recorder.Recorder(str(tmp_path / "project"), Settings(cache_dir=tmp_path / "cache"))
    if how == "python":
        rec.event("open", (str(data), "r", os.O_RDONLY))  # what the audit hook hands it for open(data)
    else:
        rec.below = _Below({str(data): ["read"], str(site / "fakelib"): ["list"]})
        rec.below_python(set())
    assert rec.unrecordable == []
    found = rec.installed_code()
    assert ["purelib", "fakelib/vocab.json"] in [ref for ref, *_ in found]
    inputs = _inputs(found)
    here = places.Places(str(tmp_path / "project"))
    assert inputs_changed(inputs, here, 0, str(tmp_path), {}) is None
    data.write_text('{"a": 2}\n')
    assert inputs_changed(inputs, here, 0, str(tmp_path), {}) == f"installed code changed: {data}"


def test_a_standard_library_module_the_process_loaded_is_checked_too(tmp_path, site):
    import textwrap as loaded  # in sys.modules, from the standard library

    rec = recorder.Recorder(str(tmp_path / "project"), Settings(cache_dir=tmp_path / "cache"))
    found = {rec.places.path(ref): state for ref, *state in rec.installed_code()}
    assert os.path.abspath(loaded.__file__) in found
    copy = tmp_path / "textwrap.py"
    copy.write_bytes(open(loaded.__file__, "rb").read())
    here = places.Places(str(tmp_path / "project"))
    state = found[os.path.abspath(loaded.__file__)]
    assert places.same_installed(loaded.__file__, state)
    assert places.same_installed(str(copy), state)  # another file, the same bytes (another machine)
    copy.write_text(copy.read_text() + "# edited\n")
    assert not places.same_installed(str(copy), state)
    assert inputs_changed(_inputs([[["abs", str(copy)], *state]]), here, 0, str(tmp_path), {}) == f"installed code changed: {copy}"


def test_making_a_record_reads_only_installed_files_that_moved(tmp_path, site, monkeypatch):
    """Digests found before are kept under their stats (``InstalledDigests``); a file past the racy window is read once."""
    import time

    module = site / "fakelib" / "__init__.py"
    time.sleep(places.RACY_NS / 1e9 + 0.2)  # its ctime past the racy window: only then may its stat stand for its bytes
    reads = []
    digest_of = places._file_digest
    monkeypatch.setattr(places, "_file_digest", lambda path: reads.append(path) or digest_of(path))
    first = places.InstalledDigests()
    state = first.state(str(module))
    first.save()
    assert reads == [str(module)]
    again = places.InstalledDigests()
    assert again.state(str(module)) == state and reads == [str(module)]  # from the memo: not read
    module.write_text("SCALE = 2\n")
    moved = places.InstalledDigests().state(str(module))
    assert reads == [str(module)] * 2 and moved[1] != state[1]
    assert places.same_installed(str(module), moved) and not places.same_installed(str(module), state)


def test_a_file_inside_the_racy_window_is_not_kept(tmp_path, site):
    module = site / "fakelib" / "fresh.py"
    module.write_text("X = 1\n")
    memo = places.InstalledDigests()
    memo.state(str(module))
    assert str(module) not in memo.known and not memo.changed


def test_installed_code_loaded_before_the_window_is_recorded_as_it_ran(tmp_path, site, monkeypatch):
    """Its state is found before the backstop starts (where each stat is cheap), which is also the code that ran: an
    edit in place during the window leaves a record that no longer answers, not one that vouches for the edit."""
    from lowercache.record import backstop

    monkeypatch.setattr(backstop, "start", lambda: "not started in this test")
    module = site / "fakelib" / "__init__.py"
    ran = places.installed_state(str(module))
    rec = recorder.Recorder(str(tmp_path / "project"), Settings(cache_dir=tmp_path / "cache"))
    rec.watch_below()
    module.write_text("SCALE = 2\n")  # edited after it was loaded, while the window runs
    found = {rec.places.path(ref): state for ref, *state in rec.installed_code()}
    assert found[str(module)] == ran
    here = places.Places(str(tmp_path / "project"))
    assert inputs_changed(_inputs(rec.installed_code()), here, 0, str(tmp_path), {}) == f"installed code changed: {module}"
