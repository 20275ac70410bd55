"""One exception type for every user-facing failure, so the CLI and server can report it in one line."""


class ExactSpecError(ValueError):
    """Bad input or an unusable model: the message is meant for the user, no traceback needed."""
