"""The one exception type that means "the user asked for something we cannot do"."""


class UsageError(Exception):
    """Bad input. The CLI prints its message as one line on stderr and exits with status 2.

    The message says what was wrong and how to fix it, e.g.
    ``--batch-size must be at least 1, got 0``.
    """


EXIT_USAGE = 2
