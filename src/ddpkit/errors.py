"""The one exception type that means "the user asked for something we cannot do"."""


class UsageError(Exception):
    """Bad input. The CLI prints its message as one line on stderr and exits with status 2.

    The message says what was wrong and how to fix it, e.g.
    ``--batch-size must be at least 1, got 0``.

    ``said_elsewhere``: another rank (rank 0) prints the same message; this one exits 2 silently.
    """

    def __init__(self, message: str, *, said_elsewhere: bool = False):
        super().__init__(message)
        self.said_elsewhere = said_elsewhere


EXIT_USAGE = 2


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (torch and torchvision write several), or its type."""
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__
