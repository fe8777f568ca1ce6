"""One exception type for problems the user can fix; the CLI prints it without a traceback."""


class NestlingError(Exception):
    """A user-facing error: the message says what was wrong and what to do."""
