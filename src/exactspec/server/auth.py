"""An API key: an ASGI middleware that answers 401 unless a request carries the key.

The key comes as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients),
compared in constant time. `/health` stays public (load balancers probe it). The 401's body is in the
API's own error shape (`refuse(path)`, as the body limit's).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable

from ..errors import ExactSpecError

PUBLIC = ("/health",)
ENV = "EXACTSPEC_API_KEY"


def presented(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries, or None."""
    fields = dict(headers)
    if (key := fields.get(b"x-api-key")) is not None:
        return key
    scheme, _, token = fields.get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class ApiKey:
    """Wraps an ASGI app; `refuse(path)` -> (status, JSON body) of the 401."""

    def __init__(self, app, key: str, refuse: Callable[[str], tuple[int, bytes]]) -> None:
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC:
            return await self.app(scope, receive, send)
        given = presented(scope.get("headers", []))
        if given is not None and hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        status, body = self.refuse(scope["path"])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def read_key(key: str | None, key_file: str | None) -> str | None:
    """The key from `--api-key`, `--api-key-file` (its first line) or $EXACTSPEC_API_KEY, in that order."""
    if key is not None and key_file is not None:
        raise ExactSpecError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ExactSpecError(f"cannot read --api-key-file {key_file}: {e.strerror}") from None
    key = key if key is not None else os.environ.get(ENV) or None
    if key is not None and (not key or any(c.isspace() for c in key)):
        raise ExactSpecError("the API key must be non-empty and contain no spaces")
    return key
