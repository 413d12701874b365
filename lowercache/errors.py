"""What users see of problems: one-line errors, and warnings in one line each."""

import logging
import os
import re
import sys
from typing import Iterable


class LowercacheError(Exception):
    """Bad input or environment. The CLI prints the message and exits non-zero."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


INTERRUPTED = 130  # the exit code of a command stopped by Ctrl-C, as a shell gives it


def interrupted() -> int:
    """Say that Ctrl-C stopped the command, as ccache and Bazel do, and return its exit code."""
    print("lowercache: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


def by_ctrl_c(error: BaseException) -> bool:
    """Whether ``error`` (typer's exit, say) came of a KeyboardInterrupt: its causes and contexts hold one."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        stack += [e.__cause__, e.__context__]
    return False


_shown: set[str] = set()  # the warnings this command has shown


class _OneLineWarnings(logging.Handler):
    """Each distinct warning once per command: a fault met by every store a command opens (a dead remote) is one line."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in _shown:
            _shown.add(message)
            print(f"lowercache: warning: {message}", file=sys.stderr)


def show_warnings_in_one_line() -> None:
    """Print lowercache's warnings as ``lowercache: warning: ...`` (the CLI, and scripts under ``lowercache run``)."""
    log = logging.getLogger("lowercache")
    if not any(isinstance(h, _OneLineWarnings) for h in log.handlers):
        log.addHandler(_OneLineWarnings(level=logging.WARNING))
    log.propagate = False


def new_command(shown: Iterable[str] = ()) -> None:
    """A command starts (a new process, a server's child, one of ``watch``'s lowerings): its warnings are shown afresh,
    but for ``shown``, those its own client showed already (direct mode opens the stores before the server's child)."""
    _shown.clear()
    _shown.update(shown)


def warnings_shown() -> list[str]:
    """The warnings this command has shown so far (a client hands them to the server's child it runs the command in)."""
    return sorted(_shown)


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def user_line(error: BaseException, text: str = "") -> str | None:
    """``file:line`` of the innermost frame of the user's own code in the error's traceback, else the last one ``text``
    names (a graph node's stack trace); None when neither is the user's (or ``text`` already says it).

    The user's code is anything outside the standard library, site-packages
    and lowercache; the file is named relative to the working directory when
    it is below it.
    """
    import sysconfig

    installed = tuple(os.path.join(os.path.normpath(p), "") for p in sysconfig.get_paths().values()) + (_PACKAGE_DIR,)

    def own(path: str) -> bool:
        return os.path.isabs(path) and not os.path.abspath(path).startswith(installed)

    found = None
    tb = error.__traceback__
    while tb is not None:
        if own(tb.tb_frame.f_code.co_filename):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    named = [(f, int(n)) for f, n in _FILE_LINE.findall(text) if own(f)]
    if found is None and named:
        found = named[-1]
    if found is None or named and found == named[-1]:
        return None
    path, line = found
    try:
        shown = os.path.relpath(path)
    except ValueError:
        shown = path
    return f"{path if shown.startswith('..') else shown}:{line}"
