"""Which environment variables are inputs: all of them, but for a short list that only says how and where output is shown.

Native code reads variables Python never sees (``getenv`` in C and C++
libraries: the C library's ``TZ`` and locale, malloc's tunables, OpenMP's,
a library's own), so no list of the variables that matter can be complete.
The rule is the other way round: the whole environment is an input of a
direct-mode record, of ``lowercache run``'s replay and of the warm server's
identity, except the variables below. Each names the terminal, the login
session, a CI run, or lowercache's own settings; none is read by anything
that lowers a model or runs its factory, and each changes between runs that
should share a result (a pipe and a terminal, two shells, two CI runs). When
the user's code reads one of them (``os.environ``, ``os.getenv``: the
recorder hears it), it is an input of that record after all. Values are kept
as digests, never as text (docs/direct-mode.md).
"""

from __future__ import annotations

from typing import Any, Mapping

# The terminal: its size, kind and colours; what terminal emulators and multiplexers say about themselves.
TERMINAL = ("COLUMNS", "LINES", "TERM", "COLORTERM", "COLORFGBG", "NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE",
            "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LS_COLORS", "STY", "WINDOW", "WINDOWID", "GPG_TTY")
TERMINAL_PREFIXES = ("TERM_PROGRAM", "TERM_SESSION_ID", "TMUX", "VTE_", "ITERM_", "KONSOLE_", "GNOME_TERMINAL_", "KITTY_",
                     "ALACRITTY_", "WEZTERM_", "WT_", "VSCODE_")
# The login session and the shell: where the shell is, how deep, the last command, the display, the session's sockets.
SESSION = ("PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "DISPLAY", "WAYLAND_DISPLAY", "XAUTHORITY", "DBUS_SESSION_BUS_ADDRESS",
           "SESSION_MANAGER", "XDG_RUNTIME_DIR", "XDG_SEAT", "XDG_VTNR", "INVOCATION_ID", "JOURNAL_STREAM")
SESSION_PREFIXES = ("SSH_", "XDG_SESSION_")
# A CI run's identity: which run, job, commit and runner, its tokens and its step files; new in every run. And a
# test runner's: the test that runs, the worker it runs in.
CI = ("CI", "BUILD_ID", "BUILD_NUMBER", "BUILD_TAG", "BUILD_URL", "EXECUTOR_NUMBER", "PYTEST_CURRENT_TEST")
CI_PREFIXES = ("GITHUB_", "RUNNER_", "ACTIONS_", "CI_", "GITLAB_", "BUILDKITE", "CIRCLE", "TRAVIS", "JENKINS_", "PYTEST_XDIST_")
# lowercache's own settings: those that shape a result are parts of every key and identity by their value.
OWN_PREFIXES = ("LOWERCACHE_",)

_NAMES = frozenset((*TERMINAL, *SESSION, *CI))
_PREFIXES = (*TERMINAL_PREFIXES, *SESSION_PREFIXES, *CI_PREFIXES, *OWN_PREFIXES)


def shown_only(name: str) -> bool:
    """Whether the variable is on the list: it says how or where output is shown, and reaches no lowered byte."""
    return name in _NAMES or name.startswith(_PREFIXES)


def inputs(environ: Mapping[str, str] | Any) -> dict[str, str]:
    """The variables of ``environ`` that are inputs: every one not on the list."""
    return {name: environ[name] for name in environ if not shown_only(name)}
