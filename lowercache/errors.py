"""What users see of problems: one-line errors, and warnings in one line each."""

import logging
import sys


class LowercacheError(Exception):
    """Bad input or environment. The CLI prints the message and exits non-zero."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class _OneLineWarnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(f"lowercache: warning: {record.getMessage()}", file=sys.stderr)


def show_warnings_in_one_line() -> None:
    """Print lowercache's warnings as ``lowercache: warning: ...`` (the CLI, and scripts under ``lowercache run``)."""
    log = logging.getLogger("lowercache")
    if not any(isinstance(h, _OneLineWarnings) for h in log.handlers):
        log.addHandler(_OneLineWarnings(level=logging.WARNING))
    log.propagate = False
