"""The one error type users see: a one-line message naming the problem."""


class LowercacheError(Exception):
    """Bad input or environment. The CLI prints the message and exits non-zero."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
