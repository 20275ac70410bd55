"""The error a request is refused with, shared by every door (each renders it in its API's own shape)."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses: rendered as OpenAI's error object (or a door's own)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
