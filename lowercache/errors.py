"""What users see of problems: one-line errors, and warnings in one line each."""

import logging
import sys


class LowercacheError(Exception):
    """Bad input or environment. The CLI prints the message and exits non-zero."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class _OneLineWarnings(logging.Handler):
    """Each distinct warning once per command: a fault met by every store a command opens (a dead remote) is one line."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.shown: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.shown:
            self.shown.add(message)
            print(f"lowercache: warning: {message}", file=sys.stderr)


def show_warnings_in_one_line() -> None:
    """Print lowercache's warnings as ``lowercache: warning: ...`` (the CLI, and scripts under ``lowercache run``)."""
    log = logging.getLogger("lowercache")
    if not any(isinstance(h, _OneLineWarnings) for h in log.handlers):
        log.addHandler(_OneLineWarnings(level=logging.WARNING))
    log.propagate = False


def new_command() -> None:
    """A command starts (a new process, a server's child, one of ``watch``'s lowerings): its warnings are shown afresh."""
    for handler in logging.getLogger("lowercache").handlers:
        if isinstance(handler, _OneLineWarnings):
            handler.shown.clear()
