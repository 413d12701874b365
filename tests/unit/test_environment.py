"""The environment rule (``lowercache/environment.py``): every variable is an input but a short, documented list."""

from __future__ import annotations

import os
import re

import pytest

from lowercache import environment, startup
from tests.helpers import ROOT

pytestmark = pytest.mark.quick

CLIENT = {"HOME": "/home/u", "PATH": "/usr/bin", "LANG": "C.UTF-8"}


def test_the_documented_list_is_the_code():
    """docs/direct-mode.md's table names every variable and prefix on the list, and nothing else."""
    page = (ROOT / "docs" / "direct-mode.md").read_text()
    table = page.split("## The environment", 1)[1].split("\n\n", 3)[2]
    cells = " ".join(line.split("|")[2] for line in table.splitlines()[2:])
    found = re.findall(r"`([A-Z_]+)(\*?)`", cells)
    assert {name for name, star in found if not star} == {*environment.TERMINAL, *environment.SESSION, *environment.CI}
    assert {name for name, star in found if star} == {*environment.TERMINAL_PREFIXES, *environment.SESSION_PREFIXES,
                                                      *environment.CI_PREFIXES, *environment.OWN_PREFIXES}


@pytest.mark.parametrize("name", ["COLUMNS", "TERM", "NO_COLOR", "TTY_COMPATIBLE", "CI", "GITHUB_RUN_ID", "RUNNER_TEMP", "SSH_TTY",
                                  "TMUX_PANE", "TERM_PROGRAM_VERSION", "_", "SHLVL", "LOWERCACHE_DIR", "PYTEST_CURRENT_TEST"])
def test_what_only_says_how_output_is_shown_is_no_input(name):
    assert environment.shown_only(name)
    assert name not in startup.variables({**CLIENT, name: "x"})


@pytest.mark.parametrize("name", ["TZ", "LC_ALL", "MALLOC_ARENA_MAX", "MY_LIBRARY_OPTION", "HOME", "PATH", "TERMINFO_DIRS",
                                  "CIRCUIT", "SSL_CERT_FILE", "OPENBLAS_NUM_THREADS"])
def test_any_other_variable_is_an_input(name):
    assert not environment.shown_only(name)
    assert name in startup.variables({**CLIENT, name: "x"})


def test_values_are_kept_as_digests():
    state = startup.state({**CLIENT, "API_TOKEN": "hunter2"})
    assert "API_TOKEN" in state["variables"] and "hunter2" not in repr(state)


def test_the_server_stands_in_under_other_presentation_and_not_under_another_input():
    """``why_not``: a client at a terminal, in CI, at 80 columns is the same client; one under another TZ is not."""
    shown = {"COLUMNS": "80", "LINES": "24", "TERM": "dumb", "NO_COLOR": "1", "CI": "true", "GITHUB_ACTIONS": "true",
             "TTY_COMPATIBLE": "1", "SHLVL": "3", "_": "/usr/bin/lowercache", "OMP_NUM_THREADS": "1"}
    assert startup.why_not({**CLIENT, **shown}, CLIENT, [], "/", {}) is None
    assert startup.why_not({**CLIENT, "TZ": "Asia/Tokyo"}, CLIENT, [], "/", {}) == "environment variable TZ differs from the server's"
    assert startup.why_not(CLIENT, {**CLIENT, "MY_LIBRARY_OPTION": "1"}, [], "/", {}) is not None  # unset in the client
    assert startup.changed(startup.state(CLIENT), startup.state({**CLIENT, "TZ": "UTC"}), "the record's") == \
        "environment variable TZ differs from the record's"


def test_a_site_file_rewritten_with_the_same_content_is_the_same_start(tmp_path, monkeypatch):
    """``pip install -e .`` run again rewrites its ``.pth`` file and finder with the same bytes: the same start-up state
    (before, their stat was the state, and every re-run of the quick start's first command made direct mode record
    afresh). Another content is another state."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    monkeypatch.setattr(startup, "_site_dirs", lambda: [str(site_dir)])
    finder = site_dir / "__editable___pkg_0_1_finder.py"
    pth = site_dir / "__editable__.pkg-0.1.pth"
    finder.write_text("MAPPING = {'pkg': '/one/pkg'}\n")
    pth.write_text("import __editable___pkg_0_1_finder\n")
    before = startup.state(CLIENT)
    for path in (finder, pth):
        _rewritten_later(path)
    assert startup.state(CLIENT) == before
    finder.write_text("MAPPING = {'pkg': '/two/pkg'}\n")
    assert startup.changed(before, startup.state(CLIENT), "the record's") == \
        "site-packages' .pth files or import finders differ from the record's"


def test_a_server_sees_a_rewritten_site_file_by_its_content(tmp_path, monkeypatch):
    """The warm server stops when a file it imported changed; a top-level site-packages file rewritten with the same
    bytes (``pip install -e .`` again) has not changed."""
    from lowercache.server.warm import Warm, _file_stamp

    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    monkeypatch.setattr(startup, "_site_dir_set", lambda: frozenset({str(site_dir)}))
    finder = site_dir / "__editable___pkg_0_1_finder.py"
    finder.write_text("MAPPING = {'pkg': '/one/pkg'}\n")
    other = tmp_path / "elsewhere.py"
    other.write_text("X = 1\n")
    warm = Warm(threads=1, cpus=1, start_env={}, base_path=None)
    warm.files = {str(path): _file_stamp(str(path)) for path in (finder, other)}
    _rewritten_later(finder)
    assert warm.changed_file() is None
    finder.write_text("MAPPING = {'pkg': '/two/pkg'}\n")
    assert warm.changed_file() == str(finder)
    finder.write_text("MAPPING = {'pkg': '/one/pkg'}\n")
    _rewritten_later(other)
    assert warm.changed_file() == str(other)  # elsewhere, a stat is still the stamp


def _rewritten_later(path) -> None:
    """``path`` written again with its own bytes, its mtime seven seconds on (as ``pip install -e .`` run again leaves it)."""
    path.write_text(path.read_text())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 7_000_000_000))
