"""One exception type for every user-facing failure, so the CLI and server can report it in one line."""


class ExactSpecError(ValueError):
    """Bad input or an unusable model: the message is meant for the user, no traceback needed."""


class FieldError(ExactSpecError):
    """A request field that is malformed or out of bounds; `param` names it (`tool_choice.function.name`),
    so the server answers 400 naming the field and `exactspec batch` fails that line alone."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
