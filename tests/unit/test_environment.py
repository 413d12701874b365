"""The environment rule (``lowercache/environment.py``): every variable is an input but a short, documented list."""

from __future__ import annotations

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
