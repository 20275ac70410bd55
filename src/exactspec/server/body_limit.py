"""An ASGI middleware that refuses request bodies over a byte limit while they are read.

A declared Content-Length over the limit is refused before anything is read; a chunked body (no
Content-Length) is read only up to the limit, then refused: the server never holds more than
`limit` bytes of one request. A body within the limit is replayed to the app, and later `receive`
calls go to the client (so a disconnect is still seen).
"""

from __future__ import annotations

from collections.abc import Callable

TOO_DEEP = "malformed JSON body: its arrays and objects are nested too deeply to parse"


def unparsable(error: Exception) -> str | None:
    """The message for a body the JSON parser gave up on (FastAPI reports any such failure as a bare
    "There was an error parsing the body"); None for other HTTP errors. A body nested deeper than
    Python's recursion limit (`[` * 100000) raises RecursionError in the parser: caught there, a 400."""
    cause = error.__cause__
    if isinstance(cause, RecursionError):
        return TOO_DEEP
    if isinstance(cause, ValueError):  # e.g. UnicodeDecodeError
        return f"malformed JSON body: {cause}"
    return None


class BodyLimit:
    """Wraps an ASGI app; `refuse(path)` -> (status, JSON body) of the answer to an oversized body."""

    def __init__(self, app, limit: int, refuse: Callable[[str], tuple[int, bytes]]) -> None:
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(scope, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        status, body = self.refuse(scope["path"])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
